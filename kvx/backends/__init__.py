"""Data-plane transports, one package each, behind one small interface (``base.py``).

The registry below is the one place that knows which backends exist: a
backend name, and where its ``Backend`` class lives. Adding a backend is a
package under ``kvx/backends/`` and one line here (or one call to
``register`` from outside the package). Classes are imported when an agent
starts, so a backend's heavy dependencies stay out of ``import kvx``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvx.errors import ConfigError

if TYPE_CHECKING:
    from kvx.backends.base import Backend

_REGISTRY: dict[str, str] = {
    "tcp": "kvx.backends.tcp:TcpBackend",
    "shm": "kvx.backends.shm:ShmBackend",
    "cuda_ipc": "kvx.backends.cuda_ipc:CudaIpcBackend",
    "rdma": "kvx.backends.rdma:RdmaBackend",
}


def register(name: str, target: str) -> None:
    """Make backend ``name`` available: ``target`` is "module:Class"."""
    if not name.isidentifier() or name == "auto":
        raise ConfigError(f"a backend name must be an identifier other than 'auto', not {name!r}")
    if ":" not in target:
        raise ConfigError(f"a backend target is 'module:Class', not {target!r}")
    _REGISTRY[name] = target


def names() -> tuple[str, ...]:
    """The registered backends."""
    return tuple(_REGISTRY)


def load(name: str) -> type[Backend]:
    """The class of backend ``name``."""
    try:
        module, _, cls = _REGISTRY[name].partition(":")
    except KeyError:
        raise ConfigError(f"no backend named {name!r}; registered: {', '.join(_REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)
