"""``kvx metadata --event-loop``: the loop asked for is the loop that runs,
and a loop that is not installed is named, with what to install, before
anything starts. kvx proxy stays on asyncio's loop, uvloop installed or not."""

import asyncio
import sys

import pytest

from kvx import _loop, cli
from kvx.errors import KvxError


async def _running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize("name", _loop.LOOPS)
def test_the_loop_asked_for_is_the_loop_that_runs(name: str) -> None:
    # uvloop is in the test extras: without it this fails rather than skips.
    assert _loop.run(_loop.loop_factory(name), _running_loop_module()).split(".")[0] == name


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(KvxError, match="--event-loop must be one of asyncio, uvloop"):
        _loop.loop_factory("trio")


def test_kvx_metadata_without_uvloop_says_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop fails

    def no_store(*args, **kwargs):
        raise AssertionError("a store was made before the event loop was checked")

    monkeypatch.setattr("kvx.metadata.store.MemoryStore", no_store)
    code = cli.main(
        ["metadata", "--listen", "127.0.0.1:0", "--admin-listen", "off", "--event-loop", "uvloop"]
    )
    assert code == 1
    assert "pip install 'kvx[uvloop]'" in capsys.readouterr().err


def test_kvx_proxy_runs_on_asyncios_loop_with_uvloop_installed() -> None:
    """uvicorn's default ("auto") would pick uvloop wherever it is installed."""
    from kvx.proxy._serve import ProxyConfig, uvicorn_config

    assert uvicorn_config(object(), ProxyConfig()).loop == "asyncio"
