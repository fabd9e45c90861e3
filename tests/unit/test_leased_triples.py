"""leased_triples, C and twin alike: the checks of a cuda_ipc copy through a
lease, and the (dst, src, len) triples it writes for the copy kernel. No
byte moves in it, so the addresses here are plain numbers: the triples are
compared with what kvx's numpy pairing (staging.pair, staging.pieces)
makes of the same ranges."""

import numpy as np
import pytest

from kvx._datapath import cma_py as _cma_py
from kvx._datapath import staging as _staging
from kvx.descs import DESC_DTYPE

try:
    from kvx._datapath import _cma
except ImportError:  # only allowed when the twin was asked for
    _cma = None

IMPLS = [pytest.param(_cma_py, id="python")] + ([pytest.param(_cma, id="native")] if _cma else [])

VALID, LOCAL_WRITE, DEVICE = 1, 8, 16  # kvx.memory's flag bits
READ, WRITE = 2, 4  # kvx.memory.REMOTE_READ, REMOTE_WRITE
NEED = VALID | LOCAL_WRITE | DEVICE  # a READ into GPU memory
REGION = 1 << 20
LEASED = 1 << 20
PIECE = 64 * 1024


def _descs(rows):
    out = np.zeros(len(rows), DESC_DTYPE)
    for i, (region, offset, length) in enumerate(rows):
        out[i] = (region, offset, length)
    return out


def _table(devices=(0, 0), flags=(NEED, NEED)):
    """Regions 1 and 2 of this process, 1 MiB each, on ``devices``."""
    bases = np.array([0, 0x7000_0000_0000, 0x7000_1000_0000], np.uint64)
    sizes = np.array([0, REGION, REGION], np.uint64)
    return bases, sizes, np.array((0, *flags), np.uint8), np.array((-1, *devices), np.int32)


# The peer's regions 3 and 9 as this process maps them (IPC), 1 MiB each.
REGIONS = np.array([3, 9], "<u4")
LEASE = np.array([0x9000_0000_0000, LEASED, 0x9000_4000_0000, LEASED], np.uint64)


def _call(impl, writing, local_rows, remote_rows, *, table=None, device=0, granted=READ | WRITE, **kw):
    bases, sizes, flags, devices = table or _table()
    out = np.full(kw.pop("words", 3 * 4096), 0xAB, np.uint64)
    got = impl.leased_triples(
        writing,
        _descs(local_rows),
        bases,
        sizes,
        flags,
        devices,
        device,
        kw.pop("need", NEED),
        kw.pop("mask", NEED),
        _descs(remote_rows),
        kw.pop("regions", REGIONS),
        kw.pop("lease", LEASE),
        granted,
        kw.pop("max_bytes", 1 << 40),
        kw.pop("piece", PIECE),
        out.ctypes.data,
        len(out),
    )
    return got, out


def _expected(writing, local_rows, remote_rows, piece=PIECE):
    bases, _, _, _ = _table()
    where = {3: int(LEASE[0]), 9: int(LEASE[2])}
    la = np.array([int(bases[r]) + o for r, o, _ in local_rows], np.uint64)
    ll = np.array([n for _, _, n in local_rows], np.uint64)
    ra = np.array([where[r] + o for r, o, _ in remote_rows], np.uint64)
    rl = np.array([n for _, _, n in remote_rows], np.uint64)
    if writing:
        d, s, n = _staging.pair(ra, rl, la, ll)
    else:
        d, s, n = _staging.pair(la, ll, ra, rl)
    d, s, n = _staging.pieces(d, s, n, piece)
    keep = n > 0
    return d[keep], s[keep], n[keep]


def _rows(rng, regions, count, size):
    """``count`` ranges in ``regions`` (each ``size`` bytes), some empty."""
    rows = []
    for _ in range(count):
        length = int(rng.choice([0, 1, 4096, 16384, 100_000, int(rng.integers(1, 70_000))]))
        offset = int(rng.integers(0, size - length + 1))
        rows.append((int(rng.choice(regions)), offset, length))
    return rows


def _split_like(rng, rows_total, regions, size):
    """Remote ranges covering exactly ``rows_total`` bytes."""
    rows, left = [], rows_total
    while left:
        length = min(left, int(rng.choice([1, 4096, 16384, 90_000, int(rng.integers(1, 50_000))])))
        rows.append((int(rng.choice(regions)), int(rng.integers(0, size - length + 1)), length))
        left -= length
    return rows


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("writing", [False, True])
def test_the_triples_pair_both_lists_as_numpy_does(impl, writing):
    rng = np.random.default_rng(11 + writing)
    for _ in range(40):
        local_rows = _rows(rng, [1, 2], int(rng.integers(1, 60)), REGION)
        total = sum(n for _, _, n in local_rows)
        if not total:
            continue
        remote_rows = _split_like(rng, total, [3, 9], LEASED)
        piece = int(rng.choice([1 << 10, PIECE, 1 << 30]))
        got, out = _call(impl, writing, local_rows, remote_rows, piece=piece)
        d, s, n = _expected(writing, local_rows, remote_rows, piece)
        assert got == len(n)
        assert out[:got].tolist() == s.tolist()
        assert out[got : 2 * got].tolist() == d.tolist()
        assert out[2 * got : 3 * got].tolist() == n.tolist()
        assert (out[3 * got :] == 0xAB).all(), "wrote past its triples"


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_blocks_make_one_triple_each(impl):
    local_rows = [(1, 2 * k * 16384, 16384) for k in range(8)]
    remote_rows = [(3, k * 16384, 16384) for k in range(8)]
    got, out = _call(impl, False, local_rows, remote_rows)
    assert got == 8
    assert out[16:24].tolist() == [16384] * 8
    assert out[8:16].tolist() == [0x7000_0000_0000 + 2 * k * 16384 for k in range(8)]  # dst: ours
    assert out[:8].tolist() == [0x9000_0000_0000 + k * 16384 for k in range(8)]  # src: theirs


LOCAL_HOSTILE = [
    pytest.param([(1, REGION - 8, 16)], id="past-the-region-end"),
    pytest.param([(1, 1, (1 << 64) - 1)], id="offset-plus-length-overflows"),
    pytest.param([(1, (1 << 64) - 8, 8)], id="negative-offset"),
    pytest.param([(3, 0, 8)], id="unknown-region"),
    pytest.param([(0, 0, 8)], id="region-zero"),
    pytest.param([(1 << 31, 0, 8)], id="huge-region-id"),
]


@pytest.mark.parametrize("rows", LOCAL_HOSTILE)
@pytest.mark.parametrize("impl", IMPLS)
def test_local_ranges_outside_the_regions_are_refused(impl, rows):
    rows = [(1, 0, 16), *rows]
    total = sum(n for _, _, n in rows) % (1 << 64)
    got, out = _call(impl, False, rows, [(3, 0, min(total, LEASED))])
    assert got == (0, 1)
    assert (out == 0xAB).all()


REMOTE_HOSTILE = [
    pytest.param([(3, LEASED - 8, 16)], id="past-the-lease"),
    pytest.param([(3, 1, (1 << 64) - 1)], id="offset-plus-length-overflows"),
    pytest.param([(3, (1 << 64) - 8, 8)], id="negative-offset"),
    pytest.param([(5, 0, 16)], id="not-leased"),
    pytest.param([(1, 0, 16)], id="one-of-ours"),
]


@pytest.mark.parametrize("rows", REMOTE_HOSTILE)
@pytest.mark.parametrize("impl", IMPLS)
def test_remote_ranges_outside_the_lease_are_refused(impl, rows):
    rows = [(9, 0, 16), *rows]
    total = sum(n for _, _, n in rows) % (1 << 64)
    got, out = _call(impl, False, [(1, 0, min(total, REGION))], rows)
    assert got == (1, 1)
    assert (out == 0xAB).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_what_is_refused_writes_nothing(impl):
    local, remote = [(1, 0, 4096), (2, 0, 4096)], [(3, 0, 8192)]
    # A local region on another GPU, or host memory, or without LOCAL_WRITE for a READ.
    for table in (
        _table(devices=(0, 1)),
        _table(flags=(NEED, VALID | LOCAL_WRITE)),
        _table(flags=(NEED, VALID | DEVICE)),
    ):
        got, out = _call(impl, False, local, remote, table=table)
        assert got == (0, 1)
        assert (out == 0xAB).all()
    got, _ = _call(impl, False, local, remote, device=1)
    assert got == (0, 0)
    # The lease does not grant the access asked for.
    assert _call(impl, False, local, remote, granted=WRITE)[0] == (1, 0)
    assert _call(impl, True, local, remote, granted=READ)[0] == (1, 0)
    # Totals that differ, are 0 or exceed max_bytes.
    assert _call(impl, False, local, [(3, 0, 8191)])[0] == (2, -1)
    assert _call(impl, False, [(1, 0, 0)], [(3, 0, 0)])[0] == (2, -1)
    assert _call(impl, False, local, remote, max_bytes=8191)[0] == (2, -1)
    assert _call(impl, False, local, remote, max_bytes=8192)[0] == 2
    # Room for fewer triples than the copy needs: how many it needs, nothing written.
    got, out = _call(impl, False, local, remote, piece=1024, words=3 * 7)
    assert got == (3, 8)
    assert (out == 0xAB).all()
    assert _call(impl, False, local, remote, piece=1024, words=3 * 8)[0] == 8


@pytest.mark.parametrize("impl", IMPLS)
def test_malformed_buffers_raise(impl):
    local, remote = [(1, 0, 4096)], [(3, 0, 4096)]
    bases, sizes, flags, devices = _table()
    for table in (
        (bases, sizes, flags, devices[:2]),  # a device per region
        (bases, sizes[:2], flags, devices),
        (bases, sizes, flags, devices.astype(np.int64)),
    ):
        with pytest.raises(ValueError, match="leased_triples"):
            _call(impl, False, local, remote, table=table)
    with pytest.raises(ValueError, match="leased_triples"):
        _call(impl, False, local, remote, piece=0)
    with pytest.raises(ValueError, match="sorted"):
        _call(impl, False, local, remote, regions=np.array([9, 3], "<u4"))
    with pytest.raises(ValueError, match="leased_triples"):
        _call(impl, False, local, remote, lease=LEASE[:3])
    bases, sizes, flags, devices = _table()
    with pytest.raises(ValueError, match="leased_triples"):  # words, and nowhere to write them
        impl.leased_triples(
            False, _descs(local), bases, sizes, flags, devices, 0, NEED, NEED, _descs(remote),
            REGIONS, LEASE, READ, 1 << 30, PIECE, 0, 3,
        )  # fmt: skip
