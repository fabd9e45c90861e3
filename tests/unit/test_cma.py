"""Cross-memory attach (the shm backend's byte path): C and twin alike,
against a real second process."""

import multiprocessing
import os

import numpy as np
import pytest

from kvx._datapath import cma_py as _cma_py
from kvx.descs import DESC_DTYPE

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


# leased_copy: the shm backend's leased path in one call. The lease of the
# holder's buffer: region 3 is its first 64 KiB, region 9 the 64 KiB after.
READ, WRITE = 2, 4  # kvx.memory.REMOTE_READ, REMOTE_WRITE
LEASE_BYTES = 1 << 16


def _descs(rows):
    out = np.zeros(len(rows), DESC_DTYPE)
    for i, (region, offset, length) in enumerate(rows):
        out[i] = (region, offset, length)
    return out


def _lease(base):
    return np.array([3, 9], "<u4"), _u64([base, LEASE_BYTES, base + LEASE_BYTES, LEASE_BYTES])


@pytest.mark.parametrize("impl", IMPLS)
def test_leased_copy_resolves_merges_and_copies(impl, holder):
    pid, base, conn = holder
    conn.send("dump")
    expected = np.frombuffer(conn.recv(), np.uint8)
    regions, lease = _lease(base)
    # Adjacent pieces (merged), a zero-length one (skipped), both regions, and
    # 2,500 pieces of 8 bytes: more than IOV_MAX on both sides.
    rows = [(3, 100, 50), (3, 150, 50), (3, 300, 0), (9, 0, 16)] + [(9, 64 + 16 * k, 8) for k in range(2500)]
    descs = _descs(rows)
    local = np.zeros(116 + 2500 * 8, np.uint8)
    ranges = [(0, 7), (7, len(local) - 7)]
    addrs = _u64([local.ctypes.data + a for a, _ in ranges])
    lens = _u64([n for _, n in ranges])
    assert impl.leased_copy(pid, False, addrs, lens, descs, regions, lease, READ) == -1
    want = b"".join(expected[(LEASE_BYTES if r == 9 else 0) + o :][:n].tobytes() for r, o, n in rows)
    assert local.tobytes() == want
    # And back, 8 bytes further on in region 9, through a lease granted for writing.
    moved = _descs([(9, 72 + 16 * k, 8) for k in range(2500)])
    tail = local[116:]
    assert (
        impl.leased_copy(pid, True, _u64([tail.ctypes.data]), _u64([len(tail)]), moved, regions, lease, WRITE)
        == -1
    )
    conn.send("dump")
    after = np.frombuffer(conn.recv(), np.uint8)
    for k in range(2500):
        at = LEASE_BYTES + 72 + 16 * k
        assert after[at : at + 8].tobytes() == tail[8 * k : 8 * k + 8].tobytes()


HOSTILE = [
    pytest.param([(3, LEASE_BYTES - 8, 16)], 0, id="past-the-lease-end"),
    pytest.param([(3, 0, 8), (9, LEASE_BYTES + 1, 0)], 1, id="empty-but-past-the-end"),
    pytest.param([(3, 0, 8), (3, 8, (1 << 64) - 1)], 1, id="negative-length"),
    pytest.param([(3, 1, (1 << 64) - 1)], 0, id="offset-plus-length-overflows"),
    pytest.param([(3, (1 << 64) - 8, 8)], 0, id="negative-offset"),
    pytest.param([(3, 0, 8), (5, 0, 8)], 1, id="region-not-leased"),
    pytest.param([(9, 0, 8)] * 2000 + [(3, LEASE_BYTES, 8)], 2000, id="bad-one-after-iov-max-good-ones"),
]


@pytest.mark.parametrize("rows,bad", HOSTILE)
@pytest.mark.parametrize("impl", IMPLS)
def test_leased_copy_refuses_ranges_the_lease_does_not_cover(impl, holder, rows, bad):
    pid, base, _ = holder
    regions, lease = _lease(base)
    descs = _descs(rows)
    total = sum(n for _, _, n in rows) % (1 << 64)
    local = np.full(min(total, 1 << 20) or 1, 0xEE, np.uint8)
    addrs, lens = _u64([local.ctypes.data]), _u64([total])
    assert impl.leased_copy(pid, False, addrs, lens, descs, regions, lease, READ) == bad
    assert (local == 0xEE).all(), "a refused list moved bytes"


@pytest.mark.parametrize("impl", IMPLS)
def test_leased_copy_refuses_what_the_lease_does_not_grant(impl, holder):
    pid, base, conn = holder
    conn.send("dump")
    before = conn.recv()
    regions, lease = _lease(base)
    src = np.full(64, 0xAB, np.uint8)
    one = (_u64([src.ctypes.data]), _u64([64]))
    # Writing into a lease granted for reading, and reading one granted for writing.
    assert impl.leased_copy(pid, True, *one, _descs([(3, 0, 64)]), regions, lease, READ) == 0
    assert impl.leased_copy(pid, False, *one, _descs([(3, 0, 64)]), regions, lease, WRITE) == 0
    conn.send("dump")
    assert conn.recv() == before, "a write went through a read-only lease"
    assert (src == 0xAB).all()
    # A lease whose base and size run past the top of the address space.
    top = _u64([(1 << 64) - 32, 64])
    assert impl.leased_copy(pid, False, *one, _descs([(3, 0, 64)]), regions[:1], top, READ) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_leased_copy_refuses_malformed_lists(impl, holder):
    pid, base, _ = holder
    regions, lease = _lease(base)
    buf = np.zeros(64, np.uint8)
    one = (_u64([buf.ctypes.data]), _u64([64]))
    descs = _descs([(3, 0, 64)])
    with pytest.raises(ValueError, match="same number of bytes"):
        impl.leased_copy(pid, False, *one, _descs([(3, 0, 63)]), regions, lease, READ)
    with pytest.raises(ValueError, match="same number of bytes"):  # local lengths that wrap around
        impl.leased_copy(
            pid, False, _u64([buf.ctypes.data] * 2), _u64([1 << 63] * 2), descs, regions, lease, READ
        )
    with pytest.raises(ValueError, match="sorted"):
        impl.leased_copy(pid, False, *one, descs, regions[::-1].copy(), lease, READ)
    with pytest.raises(ValueError, match="malformed"):
        impl.leased_copy(pid, False, *one, descs, regions, lease[:3], READ)  # a pair short
    with pytest.raises(ValueError, match="malformed"):
        impl.leased_copy(pid, False, *one, descs.view(np.uint8)[:20], regions, lease, READ)
    with pytest.raises(ValueError, match="malformed"):
        impl.leased_copy(pid, False, one[0], _u64([64, 0]), descs, regions, lease, READ)
    assert not buf.any()
    # A range the lease covers but the target's process does not map: the kernel's EFAULT.
    with pytest.raises(OSError) as info:
        impl.leased_copy(pid, False, *one, descs, regions, _u64([4096, LEASE_BYTES, 0, 0]), READ)
    assert info.value.errno == 14


# A local region table as kvx.memory.RegionTable keeps it: index = region id.
VALID, LOCAL_WRITE, DEVICE = 1, 8, 16  # kvx.memory's flag bits


def _table(local, flags=(VALID | LOCAL_WRITE,) * 2):
    """Region 1: the first half of ``local``, region 2: the second half."""
    half = len(local) // 2
    bases = _u64([0, local.ctypes.data, local.ctypes.data + half])
    return bases, _u64([0, half, half]), np.array((0, *flags), np.uint8)


LOCAL_HOSTILE = [
    pytest.param([(1, 4096 - 8, 16)], id="past-the-region-end"),
    pytest.param([(1, 4000, 200)], id="spans-two-regions"),
    pytest.param([(1, 1, (1 << 64) - 1)], id="offset-plus-length-overflows"),
    pytest.param([(1, (1 << 64) - 8, 8)], id="negative-offset"),
    pytest.param([(3, 0, 8)], id="unknown-region"),
    pytest.param([(0, 0, 8)], id="region-zero"),
    pytest.param([(1 << 31, 0, 8)], id="huge-region-id"),
]


@pytest.mark.parametrize("rows", LOCAL_HOSTILE)
@pytest.mark.parametrize("impl", IMPLS)
def test_leased_post_refuses_local_ranges_outside_the_regions(impl, holder, rows):
    pid, base, _ = holder
    regions, lease = _lease(base)
    local = np.full(8192 + 4096, 0xEE, np.uint8)  # 4096 bytes past region 2: must stay untouched
    bases, sizes, flags = _table(local[:8192])
    total = sum(n for _, _, n in rows) % (1 << 64)
    remote = _descs([(3, 0, min(total, LEASE_BYTES))])
    need = VALID | LOCAL_WRITE
    got = impl.leased_post(
        pid,
        False,
        _descs(rows),
        bases,
        sizes,
        flags,
        need,
        need | DEVICE,
        remote,
        regions,
        lease,
        READ,
        1 << 30,
    )
    assert got == (0, len(rows) - 1)
    assert (local == 0xEE).all(), "a refused list moved bytes"


@pytest.mark.parametrize("impl", IMPLS)
def test_leased_post_resolves_both_sides_and_copies(impl, holder):
    pid, base, conn = holder
    conn.send("dump")
    expected = np.frombuffer(conn.recv(), np.uint8)
    regions, lease = _lease(base)
    local = np.zeros(8192, np.uint8)
    bases, sizes, flags = _table(local)
    need = VALID | LOCAL_WRITE
    rows = [(1, 0, 100), (1, 100, 28), (2, 10, 128)]
    remote = _descs([(3, 64, 128), (9, 0, 128)])
    args = (bases, sizes, flags, need, need | DEVICE, remote, regions, lease, READ)
    assert impl.leased_post(pid, False, _descs(rows), *args, 1 << 30) == 256
    assert local[:128].tobytes() == expected[64:192].tobytes()
    assert local[4096 + 10 : 4096 + 138].tobytes() == expected[LEASE_BYTES : LEASE_BYTES + 128].tobytes()
    # Totals that differ, are 0 or exceed max_bytes: nothing moves.
    local[:] = 0xEE
    assert impl.leased_post(pid, False, _descs(rows[:2]), *args, 1 << 30) == (2, -1)
    assert impl.leased_post(pid, False, _descs(rows), *args, 255) == (2, -1)
    assert (local == 0xEE).all()
    # A region without the needed flags (read only here, or GPU memory), a remote one not leased.
    for bad_flags in ((VALID, VALID | LOCAL_WRITE), (VALID | LOCAL_WRITE | DEVICE, VALID | LOCAL_WRITE)):
        b, z, f = _table(local, bad_flags)
        got = impl.leased_post(
            pid, False, _descs(rows), b, z, f, need, need | DEVICE, remote, regions, lease, READ, 1 << 30
        )
        assert got == (0, 0)
    unleased = _descs([(3, 64, 128), (5, 0, 128)])
    got = impl.leased_post(
        pid,
        False,
        _descs(rows),
        bases,
        sizes,
        flags,
        need,
        need | DEVICE,
        unleased,
        regions,
        lease,
        READ,
        1 << 30,
    )
    assert got == (1, 1)
    assert (local == 0xEE).all()
    with pytest.raises(ValueError):
        impl.leased_post(
            pid, False, _descs(rows), bases, sizes[:2], flags, need, need, remote, regions, lease, READ, 9
        )
