"""The ibverbs provider (``kvx._verbs``), with the Endpoint contract of ``fabric.py``.

``kvx._verbs`` is built only where rdma-core's headers exist
(``libibverbs-dev``) and opens ``libibverbs.so.1`` at first use (or the library
named by ``KVX_IBVERBS_LIB``). This wrapper turns its failures into kvx
errors and picks the RoCE v2 GID from sysfs (:mod:`.verbs_info`) unless one
is given. Connecting is ``prepare``/``complete`` over kvx's control
connection; a peer whose QP broke (an error completion or a timeout) raises
:class:`VerbsError` with ``status == "QP_BROKEN"`` until it is disconnected
and connected again.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvx.backends.rdma import topology
from kvx.errors import ConfigError, ProtocolError, RegionError, TransferError
from kvx.errors import TimeoutError as KvxTimeoutError

READ, WRITE = 0, 1


class VerbsError(TransferError):
    """An ibverbs failure: ``status`` is ``ibv_wc_status_str`` of the completion (or a kvx name)."""

    def __init__(self, status: str, text: str, peer: int) -> None:
        super().__init__(f"{status} (peer {peer}): {text}")
        self.status = status
        self.text = text
        self.peer = peer


class PeerInfoError(ProtocolError, ValueError):
    """The connection info a peer sent is malformed (size, version, reserved bits)."""


def _native() -> Any:
    return importlib.import_module("kvx._verbs")


def available() -> str | None:
    """None when an RDMA device can be opened, else why not (and how to fix it)."""
    try:
        verbs = _native()
    except ImportError:
        return (
            "kvx was built without rdma-core's headers (apt-get install libibverbs-dev, then reinstall kvx)"
        )
    try:
        verbs.Endpoint().close()
    except verbs.Error as error:
        return str(error.args[1])
    return None


def _u64(values: Any, name: str) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=np.uint64)
    if array.ndim != 1:
        raise ConfigError(f"{name} must be a one-dimensional list of integers")
    return array


def gid_for(
    device: str, port: int, root: str | None = None, env: Mapping[str, str] | None = None
) -> int | None:
    """The GID index a queue pair on ``device``'s ``port`` uses: the one
    topology.pick_gid finds (``KVX_RDMA_GID_INDEX`` overrides it); None when
    sysfs does not list the device (kvx._verbs then picks). Raises
    ConfigError with the fix when the port has no usable GID."""
    root = root or os.environ.get("KVX_SYSFS_ROOT") or "/"
    for found in topology.rdma_devices(root):
        if found.name == device:
            gid, _ = topology.pick_gid(topology.find_port(found, port), root, env)
            return gid.index
    return None


class Endpoint:
    """One port of one RDMA device: its PD, one CQ, and an RC QP per peer."""

    virt_addr = True

    def __init__(self, device: str | None = None, port: int = 1, gid_index: int | None = None) -> None:
        verbs = _native()
        self._error = verbs.Error
        if gid_index is None and device is not None:
            gid_index = gid_for(device, port)
        try:
            self._ep = verbs.Endpoint(device, port, gid_index)
        except verbs.Error as error:
            raise ConfigError(f"cannot open RDMA device {device or '(first)'}: {error.args[1]}") from error
        self.provider: str = self._ep.provider
        self.fabric: str = self._ep.fabric
        self.domain: str = self._ep.domain
        self.address: bytes = self._ep.address
        self.max_sge: int = self._ep.max_sge
        self.max_outstanding: int = self._ep.max_outstanding
        self.max_msg: int = self._ep.max_msg

    def _raise(self, error: Exception) -> None:
        status, text, peer = error.args
        raise VerbsError(status, text, peer) from error

    def register(
        self, addr: int, length: int, *, remote_read: bool, remote_write: bool, device: int = -1
    ) -> Any:
        """Register ``[addr, addr+length)``; ``mr.key`` is the rkey, ``mr.how`` how (dma-buf...)."""
        try:
            return self._ep.register(
                addr, length, remote_read=remote_read, remote_write=remote_write, device=device
            )
        except self._error as error:
            raise RegionError(str(error.args[1])) from error

    def prepare(self) -> tuple[int, bytes]:
        try:
            half, info = self._ep.prepare()
        except self._error as error:
            self._raise(error)
        return half, info

    def complete(self, half: int, remote_info: bytes) -> int:
        try:
            return int(self._ep.complete(half, bytes(remote_info)))
        except ValueError as error:
            raise PeerInfoError(f"the peer's RDMA connection info is malformed: {error}") from error
        except self._error as error:
            self._raise(error)
            raise  # unreachable: _raise always raises

    def disconnect(self, peer: int) -> None:
        self._ep.disconnect(peer)

    def peer_state(self, peer: int) -> tuple[str, int, str]:
        """('free'|'prepared'|'connected'|'broken', qp_num or -1, why it broke)."""
        state, qpn, why = self._ep.peer_state(peer)
        return state, qpn, why

    def post(
        self,
        op: int,
        peer: int,
        local_addrs: Any,
        local_lens: Any,
        remote_addrs: Any,
        remote_lens: Any,
        remote_keys: Any,
        timeout_ms: int,
    ) -> None:
        arrays = [
            _u64(local_addrs, "local_addrs"),
            _u64(local_lens, "local_lens"),
            _u64(remote_addrs, "remote_addrs"),
            _u64(remote_lens, "remote_lens"),
            _u64(remote_keys, "remote_keys"),
        ]
        try:
            self._ep.post(op, peer, *arrays, timeout_ms)
        except TimeoutError as error:
            raise KvxTimeoutError(str(error)) from error
        except ValueError as error:
            raise ConfigError(str(error)) from error
        except self._error as error:
            self._raise(error)

    def close(self) -> None:
        self._ep.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<verbs Endpoint {self.domain} max_sge={self.max_sge} max_msg={self.max_msg}>"
