"""GPU memory over a socket: a pipeline through pinned host buffers.

A READ or WRITE that touches CUDA memory cannot hand device addresses to
``sendv``/``recvv``. Its bytes go through two pinned host buffers instead,
chunk by chunk:

- out (send): the engine gathers chunk k+1 of the scattered device ranges
  into buffer (k+1) % 2 while the socket sends chunk k from buffer k % 2;
- in (receive): the socket fills buffer k % 2 while the engine scatters
  chunk k-1 from the other buffer into the device ranges.

So the device copies hide behind the network and a GPU-to-GPU transfer runs
at about the host tcp rate. The wire format is unchanged: the peer sees the
same bytes in the same order as from host memory.

The engine (kvx._datapath.gpu.Engine on a GPU) does the device work and returns an
event per chunk; this module only orders it. It imports no CUDA library, and
tests/unit/test_staging.py runs it on the CPU with a host-memory engine.

Every device copy a pipeline started is waited for before the pipeline
returns or raises: a transfer never ends while a copy into its memory runs,
and a staging buffer is never reused under a copy still reading it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

# Bytes per chunk: large enough that a chunk's fixed costs (a kernel launch, an
# event, a system call) are small beside its copy, small enough that the first
# chunk's gather delays the first byte on the wire little.
CHUNK_BYTES = 4 << 20


class Event(Protocol):
    def synchronize(self) -> None: ...


class Engine(Protocol):
    chunk_bytes: int

    def buffer(self, slot: int) -> int:
        """Address of pinned host buffer ``slot`` (0 or 1), chunk_bytes long."""

    def stage_out(self, slot: int, addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> Event:
        """Start copying the ranges, in order, into buffer ``slot``."""

    def stage_in(self, slot: int, addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> Event:
        """Start copying buffer ``slot``, in order, out to the ranges."""


def chunks(addrs: Any, lens: Any, chunk: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Cut (address, length) ranges, taken in order, into consecutive chunks
    of at most ``chunk`` bytes: (addresses, lengths, bytes) each. A range
    that crosses a chunk boundary is split there."""
    addrs = np.asarray(addrs, dtype=np.uint64)
    lens = np.asarray(lens, dtype=np.uint64)
    keep = lens > 0
    addrs, lens = addrs[keep], lens[keep]
    ends = np.cumsum(lens, dtype=np.uint64)
    total = int(ends[-1]) if len(ends) else 0
    if total <= chunk:
        return [(addrs, lens, total)] if total else []
    bounds = np.arange(0, total, chunk, dtype=np.uint64)
    bounds = np.append(bounds, np.uint64(total))
    points = np.union1d(np.concatenate(([0], ends)).astype(np.uint64), bounds)
    starts = ends - lens
    owner = np.searchsorted(ends, points[:-1], side="right")  # the range each piece lies in
    piece_addrs = addrs[owner] + (points[:-1] - starts[owner])
    piece_lens = np.diff(points)
    at = np.searchsorted(points, bounds)  # piece index where each chunk starts
    return [
        (piece_addrs[at[k] : at[k + 1]], piece_lens[at[k] : at[k + 1]], int(bounds[k + 1] - bounds[k]))
        for k in range(len(bounds) - 1)
    ]


def pieces(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray, piece: int) -> tuple[np.ndarray, ...]:
    """(dst, src, len) triples with every len at most ``piece``: long copies
    are cut, so that a kernel spreads them over its blocks."""
    lens = np.asarray(lens, dtype=np.uint64)
    if not len(lens) or int(lens.max()) <= piece:
        return dsts, srcs, lens
    counts = (lens + np.uint64(piece - 1)) // np.uint64(piece)
    counts = np.maximum(counts, 1).astype(np.intp)
    owner = np.repeat(np.arange(len(lens)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = (np.arange(len(owner)) - first).astype(np.uint64) * np.uint64(piece)
    return (dsts[owner] + within, srcs[owner] + within, np.minimum(lens[owner] - within, np.uint64(piece)))


def offsets(base: int, lens: np.ndarray) -> np.ndarray:
    """Where each range goes in a contiguous buffer at ``base``."""
    ends = np.cumsum(lens, dtype=np.uint64)
    return np.uint64(base) + ends - lens


SendV = Callable[[int, bytes, Any, Any, int], None]
RecvV = Callable[[int, Any, Any, int], None]


def send(
    engine: Engine, sendv: SendV, fd: int, prefix: bytes, addrs: Any, lens: Any, timeout_ms: int
) -> None:
    """Send ``prefix``, then the bytes of the device ranges, in order."""
    parts = chunks(addrs, lens, engine.chunk_bytes)
    if not parts:
        sendv(fd, prefix, np.zeros(0, np.uint64), np.zeros(0, np.uint64), timeout_ms)
        return
    pending: list[Event | None] = [engine.stage_out(0, *parts[0]), None]
    try:
        for k, (_, _, nbytes) in enumerate(parts):
            slot = k % 2
            if k + 1 < len(parts):  # the other buffer's send has returned: refill it
                pending[1 - slot] = engine.stage_out(1 - slot, *parts[k + 1])
            event, pending[slot] = pending[slot], None
            assert event is not None  # staged in the previous round (or before the loop)
            event.synchronize()
            sendv(
                fd,
                prefix if k == 0 else b"",
                np.array([engine.buffer(slot)], np.uint64),
                np.array([nbytes], np.uint64),
                timeout_ms,
            )
    except BaseException:
        _settle(pending, quiet=True)
        raise


def recv(engine: Engine, recvv: RecvV, fd: int, addrs: Any, lens: Any, timeout_ms: int) -> None:
    """Receive exactly the bytes of the device ranges, in order."""
    parts = chunks(addrs, lens, engine.chunk_bytes)
    pending: list[Event | None] = [None, None]
    try:
        for k, (chunk_addrs, chunk_lens, nbytes) in enumerate(parts):
            slot = k % 2
            event, pending[slot] = pending[slot], None
            if event is not None:  # the scatter of chunk k-2 has read this buffer
                event.synchronize()
            recvv(fd, np.array([engine.buffer(slot)], np.uint64), np.array([nbytes], np.uint64), timeout_ms)
            pending[slot] = engine.stage_in(slot, chunk_addrs, chunk_lens, nbytes)
    except BaseException:
        _settle(pending, quiet=True)
        raise
    _settle(pending)


def _settle(pending: list[Event | None], quiet: bool = False) -> None:
    """Wait for every copy still running; then raise the first error, unless
    ``quiet`` (another error is already on its way up)."""
    error: BaseException | None = None
    for i, event in enumerate(pending):
        if event is None:
            continue
        pending[i] = None
        try:
            event.synchronize()
        except BaseException as exc:  # noqa: B036 (waited for all, then raised)
            error = error or exc
    if error is not None and not quiet:
        raise error


def pair(
    dst_addrs: np.ndarray, dst_lens: np.ndarray, src_addrs: np.ndarray, src_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, len) triples that copy the source ranges, in order, into the
    destination ranges, in order (both cover the same number of bytes): each
    range is cut where a range of the other side ends."""
    if len(dst_lens) == len(src_lens) and np.array_equal(dst_lens, src_lens):
        return dst_addrs, src_addrs, dst_lens
    keep_d, keep_s = dst_lens > 0, src_lens > 0
    dst_addrs, dst_lens = dst_addrs[keep_d], dst_lens[keep_d]
    src_addrs, src_lens = src_addrs[keep_s], src_lens[keep_s]
    dst_ends = np.cumsum(dst_lens, dtype=np.uint64)
    src_ends = np.cumsum(src_lens, dtype=np.uint64)
    if dst_ends[-1] != src_ends[-1]:
        raise ValueError(
            f"destination ranges cover {int(dst_ends[-1])} bytes, source ranges {int(src_ends[-1])}"
        )
    # Both ends lists are strictly increasing (no empty ranges): a stable sort of
    # the two runs is a merge, and equal neighbours are the shared cuts. (np.union1d
    # hashes: ten times slower for thousands of ranges.)
    points = np.concatenate((np.zeros(1, np.uint64), dst_ends, src_ends))
    points.sort(kind="stable")
    points = points[np.concatenate(([True], points[1:] != points[:-1]))]
    starts = points[:-1]
    d = np.searchsorted(dst_ends, starts, side="right")
    s = np.searchsorted(src_ends, starts, side="right")
    return (
        dst_addrs[d] + (starts - (dst_ends[d] - dst_lens[d])),
        src_addrs[s] + (starts - (src_ends[s] - src_lens[s])),
        np.diff(points),
    )
