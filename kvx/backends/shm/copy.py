"""The shm backend's copies, run by the initiator once the target has pinned
its regions (``Link.post_pinned``): cross-memory attach and shared segments."""

from __future__ import annotations

import array
import errno
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx.backends.control.pinned import PinnedCopy, check_pinned
from kvx.descs import DESC_DTYPE
from kvx.errors import AccessError, PeerLostError, ProtocolError, TransferError
from kvx.memory import REMOTE_READ, REMOTE_WRITE
from kvx.transfer import Op


class CmaCopy(PinnedCopy):
    """Cross-memory attach: process_vm_readv/writev on the peer's process."""

    __slots__ = ("pid",)

    def __init__(self, pid: int, *args: Any) -> None:
        super().__init__(*args)
        self.pid = pid

    def __call__(self, pinned: Any) -> None:
        if len(pinned) != 2 * len(self.regions):
            raise ProtocolError(
                f"peer {self.peer!r} answered a pin of {len(self.regions)} regions with "
                f"{len(pinned) * 8} bytes"
            )
        cma_copy(
            self.pid, self.peer, self.op is Op.WRITE, self.addrs, self.lens, self.remote, self.regions, pinned
        )


def cma_copy(
    pid: int, peer: str, writing: bool, addrs: Any, lens: Any, remote: np.ndarray, regions: Any, pinned: Any
) -> None:
    """Copy between the local ranges and the ``remote`` descriptors of process
    ``pid``, through what its target pinned or leased for ``regions`` (sorted
    uint32 ids): per region a (base, size) pair in ``pinned``. One C call
    checks every descriptor against those ranges, resolves and merges them,
    and copies, so the latency path runs no Python per descriptor."""
    assert remote.dtype == DESC_DTYPE
    if type(pinned) is tuple:  # a lease's pairs
        pinned = array.array("Q", pinned)
    if not remote.flags.c_contiguous:
        remote = np.ascontiguousarray(remote)
    try:
        bad = _io.leased_copy(
            pid, writing, addrs, lens, remote, regions, pinned, REMOTE_WRITE if writing else REMOTE_READ
        )
    except OSError as exc:
        raise copy_error(exc, pid, peer) from exc
    except ValueError as exc:  # the lists kvx built itself disagree: a bug, nothing copied
        raise TransferError(f"copy to peer {peer!r} refused: {exc}") from exc
    if bad >= 0:
        raise refused(remote, bad, np.asarray(regions), np.asarray(pinned, np.uint64), peer, writing)


def refused(
    remote: np.ndarray, bad: int, regions: np.ndarray, pinned: np.ndarray, peer: str, writing: bool
) -> AccessError:
    """The error for descriptor ``bad``, which the pinned or leased ranges do not cover."""
    rid, offset, length = (int(v) for v in remote[bad].tolist())
    what = f"peer {peer!r}: remote {'write' if writing else 'read'} descriptor {bad} (region {rid}, "
    what += f"offset {offset}, length {length})"
    at = int(np.searchsorted(regions, rid))
    if at >= len(regions) or int(regions[at]) != rid:
        return AccessError(f"{what} names a region the peer did not pin for it")
    try:  # the message the target's own check gives: which descriptor, which size
        check_pinned(remote[: bad + 1], regions, pinned[1 : 2 * len(regions) : 2], peer, writing)
    except AccessError as exc:
        return exc
    return AccessError(
        f"{what} overflows the address space at base {int(pinned[2 * at]):#x}; the pin is bogus"
    )


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
