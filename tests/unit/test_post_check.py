"""post_check, C and twin alike: what a small tcp transfer checks before it
is posted (kvx.agent Peer._post_small). The local descriptors resolve
against this process's region table into addresses and lengths; the remote
ones are checked against the peer's published table; anything refused gives
None, so that the full path checks again and names it. No byte moves, so
the addresses are plain numbers."""

import array

import numpy as np
import pytest

from kvx._datapath import cma_py as _cma_py
from kvx.descs import DESC_DTYPE
from kvx.memory import DEVICE, LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, VALID

try:
    from kvx._datapath import _cma
except ImportError:  # only allowed when the twin was asked for
    _cma = None

IMPLS = [pytest.param(_cma_py, id="python")] + ([pytest.param(_cma, id="native")] if _cma else [])

NEED = VALID | LOCAL_WRITE  # a READ into host memory
MASK = NEED | DEVICE
PEER_NEED = VALID | REMOTE_READ
SIZE = 1 << 20
BASE1, BASE2 = 0x7000_0000_0000, 0x7000_1000_0000
U64_MAX = (1 << 64) - 1


def _descs(rows):
    out = np.zeros(len(rows), DESC_DTYPE)
    for i, row in enumerate(rows):
        out[i] = row
    return out


def _table(flags=(NEED, NEED), bases=(BASE1, BASE2), sizes=(SIZE, SIZE)):
    """This process's regions 1 and 2 (region 0 unregistered)."""
    return (
        np.array((0, *bases), np.uint64),
        np.array((0, *sizes), np.uint64),
        np.array((0, *flags), np.uint8),
    )


def _peer(flags=(VALID | REMOTE_READ | REMOTE_WRITE, VALID | REMOTE_READ), sizes=(SIZE, SIZE // 2)):
    """The peer's published regions 5 and 6 (0-4 unknown)."""
    return np.array((0,) * 5 + tuple(sizes), np.uint64), np.array((0,) * 5 + tuple(flags), np.uint8)


def _call(
    impl,
    local,
    remote,
    *,
    table=None,
    peer=None,
    need=NEED,
    mask=MASK,
    peer_need=PEER_NEED,
    max_bytes=1 << 30,
):
    bases, sizes, flags = table or _table()
    peer_sizes, peer_flags = peer or _peer()
    return impl.post_check(
        _descs(local),
        bases,
        sizes,
        flags,
        need,
        mask,
        _descs(remote),
        peer_sizes,
        peer_flags,
        peer_need,
        max_bytes,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_resolves_the_local_side_and_totals(impl):
    local = [(1, 0, 4096), (2, 100, 8192), (1, SIZE - 4096, 4096)]
    remote = [(5, 0, 10_000), (6, 0, 6384)]
    got = _call(impl, local, remote)
    assert got is not None
    addrs, lens, total = got
    assert type(addrs) is array.array and addrs.typecode == "Q" and type(lens) is array.array
    assert list(addrs) == [BASE1, BASE2 + 100, BASE1 + SIZE - 4096]
    assert list(lens) == [4096, 8192, 4096]
    assert total == 16384


@pytest.mark.parametrize("impl", IMPLS)
def test_a_whole_region_and_the_limit_exactly(impl):
    got = _call(impl, [(2, 0, SIZE)], [(5, 0, SIZE)], max_bytes=SIZE)
    assert got is not None and got[2] == SIZE


REFUSED = {
    # the local side, against this process's table
    "local region unknown": dict(local=[(3, 0, 4096)]),
    "local region 0 (unregistered)": dict(local=[(0, 0, 4096)]),
    "local region without the access asked": dict(table=_table(flags=(VALID, NEED))),
    "local region in GPU memory": dict(table=_table(flags=(NEED | DEVICE, NEED))),
    "local region no longer valid": dict(table=_table(flags=(LOCAL_WRITE, NEED))),
    "local range past its region": dict(local=[(1, SIZE - 4095, 4096)]),
    "local offset past its region": dict(local=[(1, SIZE + 1, 0), (1, 0, 4096)]),
    "local address overflows": dict(table=_table(bases=(U64_MAX - 100, BASE2))),
    # the remote side, against the peer's published table
    "remote region unknown": dict(remote=[(7, 0, 4096)]),
    "remote region never published": dict(remote=[(2, 0, 4096)]),
    "remote region without the access asked": dict(peer_need=VALID | REMOTE_WRITE, remote=[(6, 0, 4096)]),
    "remote range past its region": dict(remote=[(6, SIZE // 2 - 100, 4096)]),
    "remote offset past its region": dict(remote=[(6, SIZE, 0), (5, 0, 4096)]),
    "remote lengths overflow": dict(remote=[(5, 0, 4096), (5, 0, U64_MAX)]),
    # the totals
    "totals differ": dict(remote=[(5, 0, 4097)]),
    "nothing to move": dict(local=[(1, 0, 0)], remote=[(5, 0, 0)]),
    "no descriptors": dict(local=[], remote=[]),
    "over the limit": dict(max_bytes=4095),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("impl", IMPLS)
def test_anything_refused_gives_none(impl, case):
    kw = dict(REFUSED[case])
    local = kw.pop("local", [(1, 0, 4096)])
    remote = kw.pop("remote", [(5, 0, 4096)])
    assert _call(impl, local, remote, **kw) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_many_descriptors_beyond_the_stack_buffer(impl):
    local = [(1 + i % 2, 4096 * i, 4096) for i in range(200)]
    got = _call(impl, local, [(5, 0, 4096 * 200)])
    assert got is not None
    assert list(got[0]) == [(BASE1 if i % 2 == 0 else BASE2) + 4096 * i for i in range(200)]
    assert got[2] == 4096 * 200


@pytest.mark.parametrize("impl", IMPLS)
def test_malformed_buffers_raise(impl):
    bases, sizes, flags = _table()
    peer_sizes, peer_flags = _peer()
    good, remote = _descs([(1, 0, 4096)]), _descs([(5, 0, 4096)])
    calls = [
        (good.tobytes()[:-1], bases, sizes, flags, remote, peer_sizes, peer_flags),
        (good, bases[:-1], sizes, flags, remote, peer_sizes, peer_flags),
        (good, bases, sizes[:-1], flags, remote, peer_sizes, peer_flags),
        (good, bases, sizes, flags, remote.tobytes() + b"x", peer_sizes, peer_flags),
        (good, bases, sizes, flags, remote, peer_sizes[:-1], peer_flags),
    ]
    for local, b, z, f, r, pz, pf in calls:
        with pytest.raises(ValueError, match="post_check"):
            impl.post_check(local, b, z, f, NEED, MASK, r, pz, pf, PEER_NEED, 1 << 30)


def test_native_and_twin_agree_on_random_lists():
    if _cma is None:
        pytest.skip("the C extension is not built (KVX_NATIVE=0 run); the twin's cases run above")
    rng = np.random.default_rng(16)
    edges = [0, 1, SIZE - 1, SIZE, SIZE + 1, U64_MAX - 1, U64_MAX]

    def value(high):
        """Mostly small, one time in four a value at an edge (sizes, 2**64)."""
        return (
            edges[int(rng.integers(0, len(edges)))] if rng.integers(0, 4) == 0 else int(rng.integers(0, high))
        )

    tables = [_table(flags=(NEED, VALID)), _table(bases=(U64_MAX - SIZE, 0), sizes=(SIZE, U64_MAX))]
    peers = [_peer(), _peer(sizes=(U64_MAX, SIZE))]
    for k in range(4000):
        table, peer = tables[k % 2], peers[(k // 2) % 2]
        local = [
            (int(rng.integers(0, 4)), value(SIZE + 2), value(8192)) for _ in range(int(rng.integers(0, 5)))
        ]
        remote = [
            (int(rng.integers(4, 8)), value(SIZE + 2), value(8192)) for _ in range(int(rng.integers(0, 5)))
        ]
        if rng.integers(0, 2) and local:  # often make the totals agree
            remote = [(5, 0, sum(n for _, _, n in local) % (1 << 64))]
        native = _call(_cma, local, remote, table=table, peer=peer)
        twin = _call(_cma_py, local, remote, table=table, peer=peer)
        if native is None or twin is None:
            assert native is None and twin is None, (local, remote, native, twin)
        else:
            assert (list(native[0]), list(native[1]), native[2]) == (list(twin[0]), list(twin[1]), twin[2])
