"""The shm backend's copies, run by the initiator once the target has pinned
its regions (``Link.post_pinned``): cross-memory attach and shared segments."""

from __future__ import annotations

import array
import errno
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx.backends.control.pinned import PinnedCopy
from kvx.errors import AccessError, PeerLostError, ProtocolError, TransferError
from kvx.memory import SMALL_LIST
from kvx.transfer import Op


class CmaCopy(PinnedCopy):
    """Cross-memory attach: process_vm_readv/writev on the peer's process."""

    __slots__ = ("pid",)

    def __init__(self, pid: int, *args: Any) -> None:
        super().__init__(*args)
        self.pid = pid

    def __call__(self, pinned: Any) -> None:
        # A few descriptors in one region (the latency case): plain Python
        # beats the dozen numpy calls of the general path.
        remote = self.remote
        if len(remote) <= SMALL_LIST and len(self.regions) == 1 and len(pinned) == 2:
            base, size = int(pinned[0]), int(pinned[1])
            addrs, lens = array.array("Q"), array.array("Q")
            for _, offset, length in remote.tolist():
                if offset > size or length > size - offset:
                    break  # the general path names the descriptor
                addrs.append(base + offset)
                lens.append(length)
            else:
                try:
                    (_io.vm_writev if self.op is Op.WRITE else _io.vm_readv)(
                        self.pid, self.addrs, self.lens, addrs, lens
                    )
                except OSError as exc:
                    raise copy_error(exc, self.pid, self.peer) from exc
                return
        super().__call__(np.asarray(pinned, np.uint64))

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        at = 0 if len(self.regions) == 1 else np.searchsorted(self.regions, self.remote["region"])
        move = _io.vm_writev if self.op is Op.WRITE else _io.vm_readv
        try:
            move(
                self.pid,
                self.addrs,
                self.lens,
                np.ascontiguousarray(self.remote["offset"] + bases[at], np.uint64),
                np.ascontiguousarray(self.remote["length"]),
            )
        except OSError as exc:
            raise copy_error(exc, self.pid, self.peer) from exc


class SegmentCopy(PinnedCopy):
    """Through the peer's shared segments, mapped here (segments.py)."""

    __slots__ = ("maps",)

    def __init__(self, maps: dict[int, Any], *args: Any) -> None:
        super().__init__(*args)
        self.maps = maps

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        mapped = [self.maps[int(rid)] for rid in self.regions.tolist()]
        if any(m.size != int(size) for m, size in zip(mapped, sizes.tolist(), strict=True)):
            raise ProtocolError(f"peer {self.peer!r} pinned a region whose size differs from its segment")
        if self.op is Op.WRITE and not all(m.writable for m in mapped):
            # The target pins such a region for writing only if it lies; never write a read-only mapping.
            raise AccessError(
                f"peer {self.peer!r} gave a read-only segment for a region it pinned for writing"
            )
        dsts, srcs, lens = self.triples(np.array([m.base for m in mapped], np.uint64))
        _io.memcpyv(
            np.ascontiguousarray(dsts, np.uint64),
            np.ascontiguousarray(srcs, np.uint64),
            np.ascontiguousarray(lens, np.uint64),
        )


def copy_error(exc: OSError, pid: int, peer: str) -> Exception:
    if exc.errno == errno.ESRCH:
        return PeerLostError(f"peer {peer!r} (pid {pid}) is gone")
    if exc.errno == errno.EPERM:
        return AccessError(f"cross-memory attach to peer {peer!r} (pid {pid}) is no longer permitted: {exc}")
    if exc.errno == errno.EFAULT:
        return TransferError(
            f"peer {peer!r} (pid {pid}): a pinned range is not mapped in its process (EFAULT); "
            "was its memory freed without deregister()?"
        )
    return TransferError(f"cross-memory attach to peer {peer!r} (pid {pid}) failed: {exc}")
