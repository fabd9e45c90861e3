"""The public surface of ``kvx``: what ``__all__`` promises is there, and the
version the package reports is the one it was installed as."""

from __future__ import annotations

import importlib.metadata

import pytest

import kvx


@pytest.mark.parametrize("name", kvx.__all__)
def test_every_name_in_all_is_there(name: str) -> None:
    assert hasattr(kvx, name), f"kvx.__all__ names {name!r}, which kvx does not define"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from kvx import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(kvx.__all__)
    assert len(set(kvx.__all__)) == len(kvx.__all__), "a name is listed twice in kvx.__all__"


def test_version_is_the_installed_distribution_version() -> None:
    try:
        installed = importlib.metadata.version("kvx")
    except importlib.metadata.PackageNotFoundError:
        # scripts/gpu_check.sh builds a checkout in place and installs nothing.
        pytest.skip("kvx is not installed here, only built in place; CI installs it (pip install -e)")
    assert kvx.__version__ == installed
