"""The staging pipeline (kvx/_datapath/staging.py) that moves GPU memory over a socket,
run on the CPU with an engine that copies host memory.

The engine defers every copy until its event is waited for, the way a GPU
stream runs behind the host: a pipeline that sent a buffer before its gather
finished, reused a buffer under a scatter still reading it, or returned
before its last scatter would move wrong bytes here, and these tests would
see them. The CUDA engine itself is tested in tests/gpu/.
"""

import ctypes
import socket
import threading

import numpy as np
import pytest

from kvx._datapath import staging as _staging


class _Deferred:
    def __init__(self, work):
        self.work = work

    def synchronize(self):
        if self.work is not None:
            self.work()
            self.work = None


class DeferredHostEngine:
    def __init__(self, chunk_bytes):
        self.chunk_bytes = chunk_bytes
        self.bufs = [np.zeros(chunk_bytes, np.uint8) for _ in range(2)]
        self.staged = 0

    def buffer(self, slot):
        return self.bufs[slot].ctypes.data

    def stage_out(self, slot, addrs, lens, nbytes):
        assert int(np.sum(lens)) == nbytes <= self.chunk_bytes
        snapshot = [(int(a), int(n)) for a, n in zip(addrs, lens, strict=True)]
        self.staged += 1

        def gather():
            at = self.buffer(slot)
            for a, n in snapshot:
                ctypes.memmove(at, a, n)
                at += n

        return _Deferred(gather)

    def stage_in(self, slot, addrs, lens, nbytes):
        assert int(np.sum(lens)) == nbytes <= self.chunk_bytes
        snapshot = [(int(a), int(n)) for a, n in zip(addrs, lens, strict=True)]
        self.staged += 1

        def scatter():
            at = self.buffer(slot)
            for a, n in snapshot:
                ctypes.memmove(a, at, n)
                at += n

        return _Deferred(scatter)


def _ranges(rng, pool, count, max_len):
    """Non-overlapping random ranges of ``pool``, in a shuffled order."""
    lens = rng.integers(1, max_len, count)
    gaps = rng.integers(0, 64, count)
    starts = np.cumsum(gaps + np.concatenate(([0], lens[:-1])))
    assert starts[-1] + lens[-1] <= pool.nbytes
    order = rng.permutation(count)
    return (pool.ctypes.data + starts[order]).astype(np.uint64), lens[order].astype(np.uint64)


def _gather(addrs, lens):
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(addrs, lens, strict=True))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_chunks_cover_the_ranges_in_order_within_the_chunk_size(chunk):
    rng = np.random.default_rng(chunk)
    pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    addrs, lens = _ranges(rng, pool, 50, 5000)
    parts = _staging.chunks(addrs, lens, chunk)
    assert all(0 < n <= chunk and int(np.sum(ln)) == n for _, ln, n in parts)
    assert all(n == chunk for _, _, n in parts[:-1])
    assert b"".join(_gather(a, ln) for a, ln, _ in parts) == _gather(addrs, lens)


def test_chunks_skip_empty_ranges_and_empty_lists():
    assert _staging.chunks(np.zeros(0, np.uint64), np.zeros(0, np.uint64), 8) == []
    parts = _staging.chunks(np.array([100, 200, 300], np.uint64), np.array([0, 10, 0], np.uint64), 4)
    assert [(a.tolist(), ln.tolist(), n) for a, ln, n in parts] == [
        ([200], [4], 4),
        ([204], [4], 4),
        ([208], [2], 2),
    ]


def test_pieces_cut_long_copies_and_keep_short_ones():
    dsts = np.array([1000, 50000], np.uint64)
    srcs = np.array([9000, 90000], np.uint64)
    lens = np.array([10, 25], np.uint64)
    d, s, n = _staging.pieces(dsts, srcs, lens, 8)
    assert n.tolist() == [8, 2, 8, 8, 8, 1]
    assert d.tolist() == [1000, 1008, 50000, 50008, 50016, 50024]
    assert s.tolist() == [9000, 9008, 90000, 90008, 90016, 90024]
    same = _staging.pieces(dsts, srcs, lens, 64)
    assert [x.tolist() for x in same] == [dsts.tolist(), srcs.tolist(), lens.tolist()]


def test_pair_matches_two_different_range_lists():
    rng = np.random.default_rng(3)
    src_pool = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    dst_pool = np.zeros(1 << 18, np.uint8)
    src_addrs, src_lens = _ranges(rng, src_pool, 40, 3000)
    total = int(src_lens.sum())
    # The destination cuts the same bytes differently.
    cuts = np.unique(np.concatenate(([0], rng.integers(1, total, 25), [total])))
    dst_lens = np.diff(cuts).astype(np.uint64)
    dst_addrs = (dst_pool.ctypes.data + cuts[:-1] + 16 * np.arange(len(dst_lens))).astype(np.uint64)
    dsts, srcs, lens = _staging.pair(dst_addrs, dst_lens, src_addrs, src_lens)
    assert int(lens.sum()) == total and len(lens) <= len(src_lens) + len(dst_lens)
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    assert _gather(dst_addrs, dst_lens) == _gather(src_addrs, src_lens)
    with pytest.raises(ValueError, match="cover"):
        _staging.pair(dst_addrs, dst_lens, src_addrs[:-1], src_lens[:-1])


def test_pair_cuts_once_where_both_lists_end_together():
    rng = np.random.default_rng(4)
    src_pool = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    dst_pool = np.zeros(1 << 18, np.uint8)
    src_addrs, src_lens = _ranges(rng, src_pool, 40, 3000)
    src_ends = np.cumsum(src_lens)
    total = int(src_ends[-1])
    # Every source end is a destination end too, and some destination ends lie between.
    cuts = np.unique(np.concatenate(([0], src_ends, rng.integers(1, total, 25))))
    dst_lens = np.diff(cuts).astype(np.uint64)
    dst_addrs = (dst_pool.ctypes.data + cuts[:-1] + 16 * np.arange(len(dst_lens))).astype(np.uint64)
    dsts, srcs, lens = _staging.pair(dst_addrs, dst_lens, src_addrs, src_lens)
    assert len(lens) == len(dst_lens) and lens.all()  # no empty piece at a shared cut
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    assert _gather(dst_addrs, dst_lens) == _gather(src_addrs, src_lens)


@pytest.fixture(params=["native", "python"])
def io(request):
    if request.param == "native":
        try:
            from kvx._datapath import _native
        except ImportError:
            pytest.skip("kvx._datapath._native is not built")
        return _native
    from kvx._datapath import io_py as _io_py

    return _io_py


@pytest.mark.parametrize("chunk", [4096, 65536, 1 << 22])
def test_send_and_recv_move_scattered_ranges_through_two_buffers(io, chunk):
    rng = np.random.default_rng(chunk)
    src_pool = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    dst_pool = np.zeros(1 << 22, np.uint8)
    src_addrs, src_lens = _ranges(rng, src_pool, 300, 12000)
    # The receiver lands the bytes in other ranges of the same total.
    dst_lens = rng.permutation(src_lens)
    starts = np.concatenate(([0], np.cumsum(dst_lens[:-1] + 16)))
    dst_addrs = (dst_pool.ctypes.data + starts).astype(np.uint64)
    out, into = DeferredHostEngine(chunk), DeferredHostEngine(chunk)
    a, b = socket.socketpair()
    prefix = b"HEADER--"
    try:
        got_prefix = bytearray(len(prefix))

        def receive():
            b.recv_into(got_prefix, len(prefix), socket.MSG_WAITALL)
            _staging.recv(into, io.recvv, b.fileno(), dst_addrs, dst_lens, 10_000)

        reader = threading.Thread(target=receive)
        reader.start()
        _staging.send(out, io.sendv, a.fileno(), prefix, src_addrs, src_lens, 10_000)
        reader.join(30)
        assert not reader.is_alive()
    finally:
        a.close()
        b.close()
    assert bytes(got_prefix) == prefix
    assert _gather(dst_addrs, dst_lens) == _gather(src_addrs, src_lens)
    total = int(src_lens.sum())
    assert out.staged == into.staged == -(-total // chunk)


def test_a_receive_that_breaks_still_lands_the_chunks_it_took(io):
    chunk = 4096
    src = np.arange(10 * chunk, dtype=np.uint32).view(np.uint8)[: 10 * chunk].copy()
    dst = np.zeros_like(src)
    into = DeferredHostEngine(chunk)
    a, b = socket.socketpair()
    try:
        a.sendall(src[: 3 * chunk + 100].tobytes())
        a.close()
        with pytest.raises(ConnectionError):
            _staging.recv(
                into,
                io.recvv,
                b.fileno(),
                np.array([dst.ctypes.data], np.uint64),
                np.array([dst.nbytes], np.uint64),
                5_000,
            )
    finally:
        b.close()
    # The three whole chunks were scattered before the error came up; nothing after them.
    assert np.array_equal(dst[: 3 * chunk], src[: 3 * chunk])
    assert not dst[3 * chunk :].any()


def test_a_send_that_breaks_waits_for_its_gathers(io):
    chunk = 4096
    src = np.ones(8 * chunk, np.uint8)
    out = DeferredHostEngine(chunk)
    events = []
    stage_out = out.stage_out

    def tracked(*args):
        events.append(stage_out(*args))
        return events[-1]

    out.stage_out = tracked
    a, b = socket.socketpair()
    b.close()
    try:
        with pytest.raises(OSError):
            _staging.send(
                out,
                io.sendv,
                a.fileno(),
                b"",
                np.array([src.ctypes.data], np.uint64),
                np.array([src.nbytes], np.uint64),
                5_000,
            )
    finally:
        a.close()
    assert events and all(e.work is None for e in events)
