"""kvx._fabric's engine through the null provider: how work requests are built and counted.

The null provider moves no data and completes every work request at once, so
these tests check the chain building (one work request per remote piece, split
at max_msg, local gather up to max_sge), the bounds and the argument checks.
Skipped when kvx was built without libfabric.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvx.backends.rdma import fabric
from kvx.errors import ConfigError
from tests.conftest import native_pass_only

# kvx._fabric moves the bytes whatever KVX_NATIVE says: one pass is enough.
pytestmark = [
    pytest.mark.skipif(fabric.available() is not None, reason=str(fabric.available())),
    native_pass_only,
]


def _u64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


@pytest.fixture
def null():
    ep = fabric.Endpoint("null", max_sge=2, max_msg=4096, max_outstanding=8)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=True, remote_write=True)
    half, info = ep.prepare()
    peer = ep.complete(half, info)
    yield ep, buf, mr, peer
    ep.close()


def _expected(local_lens: list[int], remote_lens: list[int], max_sge: int, max_msg: int) -> tuple[int, int]:
    """The chain the engine must build, computed independently: (work requests, gathered pieces)."""
    local = [n for n in local_lens if n]
    li, loff, wrs, sges = 0, 0, 0, 0
    for rlen in remote_lens:
        left = rlen
        while left:
            want, n = min(left, max_msg), 0
            got = 0
            while got < want and n < max_sge:
                take = min(local[li] - loff, want - got)
                got, loff, n = got + take, loff + take, n + 1
                if loff == local[li]:
                    li, loff = li + 1, 0
            left -= got
            wrs, sges = wrs + 1, sges + n
    return wrs, sges


@pytest.mark.parametrize(
    ("local_lens", "remote_lens"),
    [
        ([1000] * 10, [10_000]),  # gather limited by max_sge: 5 requests of 2 pieces
        ([24_576], [8192] * 3),  # each remote piece split at max_msg
        ([100, 0, 5000, 3], [2551, 2552]),  # zero-length pieces are skipped
        ([7] * 300, [300, 1800]),
    ],
)
def test_the_chain_is_built_from_the_descriptors(null, local_lens, remote_lens):
    ep, buf, mr, peer = null
    local_addrs = buf.ctypes.data + np.concatenate([[0], np.cumsum(local_lens)[:-1]])
    remote_addrs = mr.addr + np.concatenate([[0], np.cumsum(remote_lens)[:-1]])
    ep.post(fabric.WRITE, peer, _u64(local_addrs), _u64(local_lens), _u64(remote_addrs), _u64(remote_lens),
            _u64([mr.key] * len(remote_lens)), 5_000)  # fmt: skip
    c = ep.counters()
    assert (c["work_requests"], c["sges"]) == _expected(local_lens, remote_lens, 2, 4096)
    assert c["completions"] == c["work_requests"] and c["inflight"] == 0 and c["posts"] == 1


def test_many_threads_post_on_one_endpoint(null):
    ep, buf, mr, peer = null
    n = 256
    lens = _u64([1024] * n)
    addrs = _u64(buf.ctypes.data + np.arange(n) * 1024)
    keys = _u64([mr.key] * n)

    def run() -> None:
        for _ in range(50):
            ep.post(fabric.READ, peer, addrs, lens, addrs, lens, keys, 10_000)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c = ep.counters()
    assert c["posts"] == 200 and c["work_requests"] == 200 * n == c["completions"] and c["inflight"] == 0


def test_arguments_are_checked(null):
    ep, buf, mr, peer = null
    a = _u64([buf.ctypes.data])
    with pytest.raises(ConfigError, match="same number of bytes"):
        ep.post(fabric.READ, peer, a, _u64([64]), a, _u64([32]), _u64([mr.key]), 1_000)
    with pytest.raises(ConfigError, match="pair up"):
        ep.post(fabric.READ, peer, a, _u64([64, 1]), a, _u64([65]), _u64([mr.key]), 1_000)
    with pytest.raises(ConfigError, match="not connected"):
        ep.post(fabric.READ, peer + 99, a, _u64([64]), a, _u64([64]), _u64([mr.key]), 1_000)
    with pytest.raises(ConfigError, match="timeout_ms"):
        ep.post(fabric.READ, peer, a, _u64([64]), a, _u64([64]), _u64([mr.key]), 0)
    with pytest.raises(ConfigError, match="op must be"):
        ep.post(7, peer, a, _u64([64]), a, _u64([64]), _u64([mr.key]), 1_000)
    outside = buf.ctypes.data + buf.nbytes
    with pytest.raises(ConfigError, match=hex(outside)):
        ep.post(fabric.READ, peer, _u64([outside]), _u64([64]), a, _u64([64]), _u64([mr.key]), 1_000)
    assert ep.counters()["posts"] == 0


def test_keys_are_random_and_closed_regions_leave_the_table(null):
    ep, buf, mr, peer = null
    regions = [
        ep.register(buf.ctypes.data + i * 4096, 4096, remote_read=True, remote_write=False) for i in range(8)
    ]
    keys = {r.key for r in regions} | {mr.key}
    assert len(keys) == 9 and min(keys) >= 1 << 16
    assert ep.counters()["regions"] == 9
    for r in regions:
        r.close()
    assert ep.counters()["regions"] == 1
    mr.close()
    with pytest.raises(ConfigError, match="not inside memory registered"):
        a = _u64([buf.ctypes.data])
        ep.post(fabric.READ, peer, a, _u64([64]), a, _u64([64]), _u64([1]), 1_000)


def test_a_closed_endpoint_refuses_work():
    ep = fabric.Endpoint("null")
    buf = np.zeros(4096, dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=True, remote_write=True)
    ep.close()
    ep.close()
    mr.close()
    with pytest.raises(ConfigError, match="closed"):
        ep.register(buf.ctypes.data, buf.nbytes, remote_read=True, remote_write=True)


def test_reset_forgets_peers_and_keeps_keys(null):
    ep, buf, mr, peer = null
    key, address = mr.key, ep.address
    assert not ep.mr_close_is_final
    closed = ep.register(buf.ctypes.data, 4096, remote_read=True, remote_write=False)
    closed.close()
    ep.reset("test")
    assert mr.key == key and not mr.closed and ep.address != address
    assert ep.counters()["resets"] == 1 and ep.counters()["regions"] == 1
    args = (_u64([buf.ctypes.data]), _u64([64]), _u64([0]), _u64([64]), _u64([key]), 1000)
    with pytest.raises(ConfigError, match="not connected"):
        ep.post(fabric.READ, peer, *args)
    half, info = ep.prepare()
    again = ep.complete(half, info)
    assert again != peer
    ep.post(fabric.READ, again, *args)
    with pytest.raises(ConfigError, match="not connected"):
        ep.post(fabric.READ, peer, *args)  # not even after a new peer was connected
    mr.close()
    assert ep.counters()["regions"] == 0
    with pytest.raises(ConfigError):
        ep.post(fabric.READ, again, *args)  # the local range is no longer registered
