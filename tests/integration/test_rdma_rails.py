"""Rails: several endpoints per agent, transfers striped across them, a
failed rail's slices moved to the others, tcp once every rail failed.

Two rails over libfabric's tcp provider on loopback (KVX_RDMA_DEVICES=lo,lo:
two endpoints on domain "lo"), with real one-sided READ and WRITE.
"""

import logging
import threading

import numpy as np
import pytest

import kvx
from kvx.backends import rdma
from kvx.backends.rdma import channel as rdma_channel
from kvx.backends.rdma import rails, topology
from tests.conftest import RDMA_PROVIDER, native_pass_only
from tests.integration.test_rdma import _fabric

# kvx._fabric moves the bytes whatever KVX_NATIVE says: one pass is enough.
pytestmark = native_pass_only
MIB = 1 << 20


@pytest.fixture
def two_rails(monkeypatch):
    _fabric()
    monkeypatch.setenv(rdma.PROVIDER_ENV, RDMA_PROVIDER)
    monkeypatch.setenv(topology.DEVICES_ENV, "lo,lo")


def _moved(backend):
    return [ep.counters()["work_requests"] for ep in backend.eps]


def test_a_64_mib_transfer_is_striped_over_both_rails(two_rails, make_worker, make_agent):
    worker = make_worker(pool_bytes=64 * MIB)  # another process, with two rails too
    agent = make_agent(backend="rdma")
    backend = agent._backends["rdma"]
    # Two endpoints (libfabric's tcp provider binds its first interface, whatever domain is asked).
    assert len(backend.eps) == 2 and backend.eps[0] is not backend.eps[1]
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "rdma" and "2 rail(s) to its 2" in peer.backend_reason
    pool = np.zeros(64 * MIB, np.uint8)
    region = agent.register(pool)
    before = _moved(backend)
    peer.read(region.descs(0, 64 * MIB), peer.regions[0].descs(0, 64 * MIB)).wait(120)
    after = _moved(backend)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert pool.tobytes() == worker.expected(0, 64 * MIB).tobytes()
    # WRITE back, striped too, and read it again through the other way round.
    pool[:] = np.frombuffer(np.random.default_rng(3).bytes(64 * MIB), np.uint8)
    peer.write(region.descs(0, 64 * MIB), peer.regions[0].descs(0, 64 * MIB)).wait(120)
    check = np.zeros(64 * MIB, np.uint8)
    peer.read(agent.register(check).descs(0, 64 * MIB), peer.regions[0].descs(0, 64 * MIB)).wait(120)
    assert check.tobytes() == pool.tobytes()
    assert all(a > b for a, b in zip(_moved(backend), after, strict=True))


class _FailingRail:
    """A rail whose NIC went down: every post ends in an error completion.
    (Closing the target's endpoint instead makes tcp;ofi_rxm hang until
    Timeouts.io_s, which ends the whole link, as a hung peer must.)"""

    def __init__(self, ep):
        self._ep = ep

    def post(self, op, peer, *args):
        from kvx.backends.rdma import fabric

        raise fabric.FabricError("FI_EIO", "the NIC's link went down (test)", peer)

    def __getattr__(self, name):
        return getattr(self._ep, name)


def _pair(make_agent, **kwargs):
    """A target and an initiator agent, two rails each, and a connected peer."""
    target = make_agent("target", backend="rdma")
    data = np.frombuffer(np.random.default_rng(5).bytes(16 * MIB), np.uint8).copy()
    target.register(data)
    agent = make_agent("initiator", backend="rdma", **kwargs)
    peer = agent.add_peer(target.metadata())
    pool = np.zeros(16 * MIB, np.uint8)
    region = agent.register(pool)
    return target, data, agent, peer, pool, region


def test_a_failed_rail_moves_its_slices_to_the_other(two_rails, make_agent, caplog):
    target, data, agent, peer, pool, region = _pair(make_agent)
    peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB)).wait(60)
    assert pool.tobytes() == data.tobytes()
    backend = agent._backends["rdma"]
    backend.eps[1] = _FailingRail(backend.eps[1])  # the second NIC dies
    before = _moved(backend)
    with caplog.at_level(logging.WARNING):
        peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB)).wait(60)
    assert pool.tobytes() == data.tobytes()
    assert _moved(backend)[0] > before[0]
    down = [r.getMessage() for r in caplog.records if "rdma rail 1" in r.getMessage()]
    assert down and "is down" in down[0] and "move to rail(s) 0" in down[0], down
    # Later transfers keep using the rail that is up.
    pool[:] = 0
    peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB)).wait(60)
    assert pool.tobytes() == data.tobytes()


def test_every_rail_failed_falls_back_to_tcp_saying_why(two_rails, make_agent, caplog, monkeypatch):
    target, data, agent, peer, pool, region = _pair(make_agent)
    for ep in target._backends["rdma"].eps:
        ep.close()  # connecting the rails again is refused
    backend = agent._backends["rdma"]
    backend.eps[:] = [_FailingRail(ep) for ep in backend.eps]
    with caplog.at_level(logging.WARNING):
        first = peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB))
        with pytest.raises(kvx.KvxError):
            first.wait(60)  # its slices had nowhere left to go
        pool[:] = 0
        peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB)).wait(60)
    assert pool.tobytes() == data.tobytes()  # over tcp
    fallback = [r.getMessage() for r in caplog.records if "go over tcp" in r.getMessage()]
    assert fallback and "every rdma rail failed" in fallback[0]
    assert "rail 0:" in fallback[0] and "rail 1:" in fallback[0]
    assert peer.alive and peer.backend == "rdma"


def test_the_rails_of_a_gpu_agent_are_its_nearest_nics(tmp_path, monkeypatch):
    from tests.unit import sysfs_trees

    sysfs_trees.dgx_h100(tmp_path)
    root = tmp_path
    gpu3 = topology.gpus(str(root))[3]
    nearest = topology.affinity(str(root), {})[3].endpoints
    choice = rails.choose(str(root), {}, gpu3.place.address)
    assert choice.devices == tuple(str(e) for e in nearest) and "nearest GPU" in choice.reason
    host = rails.choose(str(root), {}, None)  # a host-memory agent: every active NIC
    assert len(host.devices) == len(topology.usable(topology.rdma_devices(str(root))))
    pinned = rails.choose(str(root), {topology.DEVICES_ENV: "mlx5_5,mlx5_0"}, gpu3.place.address)
    assert pinned.devices == ("mlx5_5", "mlx5_0")
    # libfabric's verbs;ofi_rxm names domains after the devices.
    listed = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert rails.libfabric_domains(choice, listed, False) == [e.device for e in nearest]
    with pytest.raises(kvx.ConfigError, match="does not list"):
        rails.libfabric_domains(rails.Choice(("mlx9_9",), ""), listed, True)


def test_slices_cover_every_byte_once():
    lens = np.array([3 * MIB, 1, 5 * MIB - 1, 2 * MIB], np.uint64)
    addrs = np.array([0, 10 * MIB, 20 * MIB, 40 * MIB], np.uint64)
    keys = np.arange(8, dtype=np.uint64).reshape(4, 2)
    bounds = rails.slice_bounds(int(lens.sum()), 3)
    assert len(bounds) == 3 and bounds[-1] == int(lens.sum())
    parts = rails.cut(addrs, lens, bounds, keys)
    assert sum(int(p[1].sum()) for p in parts) == int(lens.sum())
    spans = sorted((int(a), int(a + n)) for p in parts for a, n in zip(p[0], p[1], strict=True))
    merged = []
    for lo, hi in spans:
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    assert merged == [(int(a), int(a + n)) for a, n in zip(addrs, lens, strict=True)]
    assert rails.slice_bounds(MIB, 4) == [MIB]  # small: one rail
    assert rails_retry_is_bounded()


def rails_retry_is_bounded() -> bool:
    return 0 < rdma_channel.RAIL_RETRY_S <= 60


class _TimingOutRail:
    """A rail whose post gives up: the peer did not answer in time."""

    def __init__(self, ep):
        self._ep = ep

    def post(self, op, peer, *args):
        raise kvx.TimeoutError("the peer did not answer in time (test)")

    def __getattr__(self, name):
        return getattr(self._ep, name)


class _HungRail:
    """A rail whose post hangs until its endpoint is reset, then ends with
    status RESET, as a real post does; it counts its posts and those still
    running."""

    def __init__(self, ep):
        self._ep = ep
        self.released = threading.Event()
        self.posts = 0
        self.running = 0

    def post(self, op, peer, *args):
        from kvx.backends.rdma import fabric

        self.posts += 1
        self.running += 1
        try:
            self.released.wait(30)
            raise fabric.FabricError(fabric.RESET, "the endpoint was reset (test)", peer)
        finally:
            self.running -= 1

    def reset(self, reason="", drop=()):
        self.released.set()
        return self._ep.reset(reason, drop)

    def __getattr__(self, name):
        return getattr(self._ep, name)


def test_a_timeout_ends_every_slice_before_the_caller_hears_of_it(two_rails, make_agent):
    """A striped READ whose slice on one rail times out while the other
    rail's slice still hangs: the error must not reach the caller (who may
    reuse the buffer) while a slice is still posting, and no slice may be
    posted again after it. Every rail the transfer used is reset first."""
    target, data, agent, peer, pool, region = _pair(make_agent, timeouts=kvx.Timeouts(io_s=1, close_s=1))
    backend = agent._backends["rdma"]
    backend.eps[0] = _TimingOutRail(backend.eps[0])
    hung = backend.eps[1] = _HungRail(backend.eps[1])
    with pytest.raises(kvx.TimeoutError):
        peer.read(region.descs(0, 16 * MIB), peer.regions[0].descs(0, 16 * MIB)).wait(60)
    assert hung.released.is_set()  # its rail was reset too
    assert hung.running == 0 and hung.posts == 1
