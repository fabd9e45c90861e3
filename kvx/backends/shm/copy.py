"""Copies the initiator runs itself once the target has pinned its regions
(``Link.post_pinned``): cross-memory attach, shared segments, and the
checks every such copy makes of what the target pinned."""

from __future__ import annotations

import errno
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx._datapath import staging as _staging
from kvx.errors import AccessError, PeerLostError, ProtocolError, TransferError
from kvx.memory import VALID, check_descs
from kvx.transfer import Op


class PinnedCopy:
    """Moves one part's bytes. Called on the reader thread with what the
    target answered to the pin: per region a (base, size) pair, then
    whatever ``extra_bytes`` per region the pin's kind adds."""

    __slots__ = ("op", "peer", "addrs", "lens", "remote", "regions")
    extra_bytes = 0

    def __init__(
        self, op: Op, peer: str, addrs: Any, lens: Any, remote: np.ndarray, regions: np.ndarray
    ) -> None:
        self.op = op
        self.peer = peer
        self.addrs = addrs
        self.lens = lens
        self.remote = remote
        self.regions = regions

    def __call__(self, pinned: np.ndarray) -> None:
        n = len(self.regions)
        if len(pinned) * 8 != n * (16 + self.extra_bytes):
            raise ProtocolError(
                f"peer {self.peer!r} answered a pin of {n} regions with {len(pinned) * 8} bytes"
            )
        bases, sizes = pinned[0 : 2 * n : 2], pinned[1 : 2 * n : 2]
        check_pinned(self.remote, self.regions, sizes, self.peer, self.op is Op.WRITE)
        self.move(bases, sizes, pinned[2 * n :])

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        raise NotImplementedError

    def triples(self, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, len) triples: the remote descriptors, where ``bases``
        says each pinned region starts in this process, paired with the local
        ranges in the direction of the operation."""
        at = 0 if len(self.regions) == 1 else np.searchsorted(self.regions, self.remote["region"])
        remote_addrs = np.asarray(bases[at] + self.remote["offset"], np.uint64)
        remote_lens = np.ascontiguousarray(self.remote["length"], np.uint64)
        local_addrs, local_lens = np.asarray(self.addrs, np.uint64), np.asarray(self.lens, np.uint64)
        if self.op is Op.WRITE:
            return _staging.pair(remote_addrs, remote_lens, local_addrs, local_lens)
        return _staging.pair(local_addrs, local_lens, remote_addrs, remote_lens)


class CmaCopy(PinnedCopy):
    """Cross-memory attach: process_vm_readv/writev on the peer's process."""

    __slots__ = ("pid",)

    def __init__(self, pid: int, *args: Any) -> None:
        super().__init__(*args)
        self.pid = pid

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
        dsts, srcs, lens = self.triples(np.array([m.base for m in mapped], np.uint64))
        _io.memcpyv(
            np.ascontiguousarray(dsts, np.uint64),
            np.ascontiguousarray(srcs, np.uint64),
            np.ascontiguousarray(lens, np.uint64),
        )


def check_pinned(
    remote: np.ndarray, regions: np.ndarray, sizes: np.ndarray, peer: str, writing: bool
) -> None:
    """Every remote descriptor lies inside the size the target pinned."""
    offsets, lengths = remote["offset"], remote["length"]
    size = sizes[0] if len(regions) == 1 else sizes[np.searchsorted(regions, remote["region"])]
    # The initiator checked against the sizes the peer published; these are the ones it pinned.
    if not ((offsets <= size) & (lengths <= size - np.minimum(offsets, size))).all():
        top = int(regions.max()) + 1
        flags = np.zeros(top, np.uint8)
        flags[regions] = VALID
        table = np.zeros(top, np.uint64)
        table[regions] = sizes
        check_descs(remote, flags, table, 0, f"peer {peer!r}: remote {'write' if writing else 'read'}")
        raise AccessError(f"peer {peer!r}: a descriptor lies outside the region it pinned")


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
