"""Cross-memory attach (the shm backend's byte path): C and twin alike,
against a real second process."""

import multiprocessing
import os

import numpy as np
import pytest

from kvx._datapath import cma_py as _cma_py

try:
    from kvx._datapath import _cma
except ImportError:  # only allowed when the twin was asked for
    _cma = None

IMPLS = [pytest.param(_cma_py, id="python")] + ([pytest.param(_cma, id="native")] if _cma else [])
SIZE = 1 << 20


def _holder(conn):
    buf = np.frombuffer(np.random.default_rng(3).bytes(SIZE), np.uint8).copy()
    conn.send((os.getpid(), buf.ctypes.data))
    while True:
        cmd = conn.recv()
        if cmd == "dump":
            conn.send(buf.tobytes())
        else:
            return


@pytest.fixture(scope="module")
def holder():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child,), daemon=True)
    proc.start()
    pid, base = parent.recv()
    yield pid, base, parent
    parent.send("stop")
    proc.join(10)


def _u64(values):
    return np.asarray(values, dtype=np.uint64)


@pytest.mark.parametrize("impl", IMPLS)
def test_scattered_read_then_write(impl, holder):
    pid, base, conn = holder
    conn.send("dump")  # the holder is shared: an earlier test may have written it
    expected = np.frombuffer(conn.recv(), np.uint8)
    rng = np.random.default_rng(1)
    # 2,500 remote pieces (more than IOV_MAX) read into a differently cut local buffer.
    starts = np.sort(rng.choice(SIZE // 8, 2500, replace=False)) * 8
    lens = np.full(2500, 8, np.uint64)
    local = np.zeros(2500 * 8, np.uint8)
    impl.vm_readv(
        pid,
        _u64([local.ctypes.data, local.ctypes.data + 7]),
        _u64([7, len(local) - 7]),
        _u64(base + starts),
        lens,
    )
    assert local.tobytes() == b"".join(expected[s : s + 8].tobytes() for s in starts)
    # Write it back one piece further on.
    impl.vm_writev(pid, _u64([local.ctypes.data]), _u64([len(local)]), _u64(base + starts + 8), lens)
    conn.send("dump")
    after = np.frombuffer(conn.recv(), np.uint8)
    for k, s in enumerate(starts):
        if k + 1 == len(starts) or starts[k + 1] != s + 8:  # not overwritten by the next piece
            assert after[s + 8 : s + 16].tobytes() == local[k * 8 : k * 8 + 8].tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_errors_name_the_cause(impl, holder):
    pid, base, _ = holder
    buf = np.zeros(64, np.uint8)
    one = (_u64([buf.ctypes.data]), _u64([64]))
    with pytest.raises(OSError) as info:
        impl.vm_readv(pid, *one, _u64([4096]), _u64([64]))  # not mapped in the other process
    assert info.value.errno == 14
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    with pytest.raises(ProcessLookupError):
        impl.vm_readv(dead.pid, *one, _u64([base]), _u64([64]))
    with pytest.raises(ValueError, match="same number of bytes"):
        impl.vm_readv(pid, *one, _u64([base]), _u64([63]))


@pytest.mark.parametrize("impl", IMPLS)
def test_memcpyv_copies_triples_in_this_process(impl):
    src = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    lens = np.array([100, 7, 4096, 0, 33], np.uint64)
    src_at = np.array([0, 200, 1000, 9000, 60000], np.uint64)
    dst_at = np.array([50000, 0, 8, 77, 5000], np.uint64)
    impl.memcpyv(dst.ctypes.data + dst_at, src.ctypes.data + src_at, lens)
    expected = np.zeros_like(src)
    for d, s, n in zip(dst_at.tolist(), src_at.tolist(), lens.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)
    with pytest.raises(ValueError):
        impl.memcpyv(np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.zeros(2, np.uint64))
