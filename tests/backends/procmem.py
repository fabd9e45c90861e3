"""A test-only backend: same-host host memory through /proc/PID/mem.

It shows what adding a backend takes: this module and one registration line
(``kvx.backends.register("procmem", "tests.backends.procmem:ProcMemBackend")``).
It reuses the control connection's pins (the target checks and pins the
regions, exactly as for shm) and moves the bytes with pread/pwrite on the
peer's /proc/PID/mem, which the kernel allows where it allows cross-memory
attach. Pure Python, and only under ``backend="procmem"``: ``auto`` never
picks it.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from kvx.backends.base import Backend, Channel, same_host
from kvx.backends.control.link import Link
from kvx.backends.control.pinned import PinnedCopy
from kvx.errors import PeerLostError
from kvx.transfer import Op, Transfer
from kvx.v1 import agent_pb2


class ProcMemBackend(Backend):
    name = "procmem"
    auto = False

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        if not same_host(md):
            return f"peer {md.name!r} is on another host", ""
        if not md.shm_probe_address:
            return f"peer {md.name!r} serves no pins (its backend setting is tcp)", ""
        try:
            os.close(os.open(f"/proc/{md.pid}/mem", os.O_RDWR))
        except OSError as exc:
            return f"cannot open /proc/{md.pid}/mem: {exc}", ""
        return None, f"same host, /proc/{md.pid}/mem is open to this process"

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        return ProcMemChannel(link, md.pid), ""


class ProcMemChannel(Channel):
    def __init__(self, link: Link, pid: int) -> None:
        super().__init__(link)
        self._fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        link.when_closed(lambda: os.close(self._fd))

    def post(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        local_device: int = -1,
        remote_device: int = -1,
        remote_ipc: bool = False,
    ) -> None:
        assert local_device < 0 and remote_device < 0, "procmem moves host memory only"
        fd, peer = self._fd, self._link.peer
        self._link.post_pinned(
            transfer,
            op,
            local_addrs,
            local_lens,
            total,
            remote,
            notify,
            0,
            lambda *part: _ProcMemCopy(fd, op, peer, *part),
        )


class _ProcMemCopy(PinnedCopy):
    __slots__ = ("fd",)

    def __init__(self, fd: int, *args: Any) -> None:
        super().__init__(*args)
        self.fd = fd

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        # triples() gives (dst, src, len): on a read the remote address is the source.
        for dst, src, n in zip(*self.triples(bases), strict=True):
            dst, src, n = int(dst), int(src), int(n)
            try:
                if self.op is Op.READ:
                    data = os.pread(self.fd, n, src)
                    if len(data) != n:
                        raise PeerLostError(f"peer {self.peer!r}: short read of its memory")
                    ctypes.memmove(dst, data, n)
                elif os.pwrite(self.fd, ctypes.string_at(src, n), dst) != n:
                    raise PeerLostError(f"peer {self.peer!r}: short write into its memory")
            except OSError as exc:
                raise PeerLostError(f"peer {self.peer!r}: /proc/PID/mem failed: {exc}") from exc
