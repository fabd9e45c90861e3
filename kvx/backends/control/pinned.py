"""What a copy of pinned ranges checks before it moves a byte.

Backends whose initiator moves the bytes itself (shm, cuda_ipc, or a new
one) post transfers with ``Link.post_pinned``; per part, the target checks
the regions against its table and pins them, and answers where each
starts and how large it is. ``PinnedCopy`` checks that answer (its size,
and every descriptor against the pinned sizes) and hands the result to the
backend's ``move``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvx._datapath import staging as _staging
from kvx.errors import AccessError, ProtocolError
from kvx.memory import VALID, check_descs
from kvx.transfer import Op


class PinnedCopy:
    """Moves one part's bytes. Called on the reader thread with what the
    target answered to the pin, or on the posting thread with what it leased
    (``Link.copy_leased``): per region a (base, size) pair, then whatever
    ``extra_bytes`` per region the pin's kind adds."""

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

    def __call__(self, pinned: Any) -> None:
        pinned = np.asarray(pinned, np.uint64)  # a lease's pairs come as a tuple
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
