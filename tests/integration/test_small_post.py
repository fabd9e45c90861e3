"""The tcp latency path of a small transfer (``Peer._post_small``): one call
(``post_check``) checks and resolves both descriptor lists before the
request goes out. These tests check that small READs and WRITEs take it and
move the right bytes, that what it refuses goes the full way and fails with
the full path's error, that what it does not take (a notification,
``verify``, long lists) still works, and that the pin it takes holds a
``deregister`` back until the transfer finishes."""

import numpy as np
import pytest

import kvx
from kvx import Descs
from kvx._datapath import io as _io
from kvx.backends.tcp import TcpChannel
from kvx.memory import RegionTable

BLOCK = 4096


@pytest.fixture
def checks(monkeypatch):
    """What post_check returned, call by call (None: refused). A transfer it
    passed must go out from there: the full path's resolve is never called
    for it (the test fails at the end otherwise)."""
    seen: list = []
    passed = {"now": False, "then resolved": 0}
    real_post, real_check, real_resolve = kvx.Peer._post, _io.post_check, RegionTable.resolve

    def post(self, *args):
        passed["now"] = False
        return real_post(self, *args)

    def record(*args):
        got = real_check(*args)
        seen.append(got)
        passed["now"] = got is not None
        return got

    def resolve(self, *args):
        passed["then resolved"] += passed["now"]
        return real_resolve(self, *args)

    monkeypatch.setattr(kvx.Peer, "_post", post)
    monkeypatch.setattr(_io, "post_check", record)
    monkeypatch.setattr(RegionTable, "resolve", resolve)
    yield seen
    assert passed["then resolved"] == 0, "a transfer post_check passed took the full path"


def _peer(make_worker, make_agent, **agent_kwargs):
    worker = make_worker()
    agent = make_agent(backend="tcp", **agent_kwargs)
    pool = np.zeros(1 << 20, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    return worker, agent, pool, region, peer


def test_small_reads_and_writes_take_it(make_worker, make_agent, checks):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote = peer.regions[0]
    # Four blocks here, from four places there, some adjacent.
    local = Descs.from_blocks(region, np.arange(4), BLOCK)
    there = Descs.from_blocks(remote, np.array([9, 3, 4, 100]), BLOCK)
    peer.read(local, there).wait(10)
    assert len(checks) == 1 and checks[0] is not None and checks[0][2] == 4 * BLOCK
    want = [worker.expected(b * BLOCK, BLOCK) for b in (9, 3, 4, 100)]
    assert pool[: 4 * BLOCK].tobytes() == b"".join(w.tobytes() for w in want)
    # And back: a WRITE of two of them to other places.
    pool[:BLOCK] = 0x5A
    peer.write(region.descs(0, BLOCK), remote.descs(200 * BLOCK, BLOCK)).wait(10)
    assert len(checks) == 2 and checks[1] is not None
    assert worker.call("peek", 200 * BLOCK, BLOCK) == b"\x5a" * BLOCK


def test_what_it_refuses_fails_as_before(make_worker, make_agent, checks):
    _, _, _, region, peer = _peer(make_worker, make_agent)
    remote = peer.regions[0]
    size = remote.size_bytes
    with pytest.raises(kvx.AccessError, match="outside the region"):
        peer.read(region.descs(0, BLOCK), remote.descs(size - 100, BLOCK)).wait(10)
    with pytest.raises(kvx.ConfigError, match="cover"):
        peer.read(region.descs(0, BLOCK), remote.descs(0, 2 * BLOCK)).wait(10)
    assert checks == [None, None]
    # The peer still serves: nothing was left pinned or half sent.
    peer.read(region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(10)
    assert checks[-1] is not None


def test_a_local_region_gone_is_named(make_worker, make_agent, checks):
    _, agent, _, region, peer = _peer(make_worker, make_agent)
    descs = region.descs(0, BLOCK)
    agent.deregister(region)
    with pytest.raises(kvx.AccessError, match="region"):
        peer.read(descs, peer.regions[0].descs(0, BLOCK))
    assert checks == [None]


def test_what_it_does_not_take_goes_the_full_way(make_worker, make_agent, checks):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote = peer.regions[0]
    peer.write(region.descs(0, BLOCK), remote.descs(0, BLOCK), notify=b"hi").wait(10)
    peer.read(region.descs(0, BLOCK), remote.descs(BLOCK, BLOCK), verify=True).wait(10)
    blocks = np.arange(65)
    peer.read(Descs.from_blocks(region, blocks, BLOCK), Descs.from_blocks(remote, blocks * 2, BLOCK)).wait(10)
    assert checks == []
    assert (
        pool[: 65 * BLOCK].reshape(65, BLOCK)[64].tobytes() == worker.expected(128 * BLOCK, BLOCK).tobytes()
    )
    # 64 on each side is still small.
    peer.read(
        Descs.from_blocks(region, blocks[:64], BLOCK), Descs.from_blocks(remote, blocks[:64], BLOCK)
    ).wait(10)
    assert len(checks) == 1 and checks[0] is not None


def test_its_pin_holds_deregister_back(make_worker, make_agent, checks):
    worker, agent, pool, region, peer = _peer(make_worker, make_agent)
    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        assert checks and checks[0] is not None
        with pytest.raises(kvx.RegionBusyError):
            agent.deregister(region, timeout_s=0.2)
    finally:
        worker.thaw()
    agent.deregister(region, timeout_s=10)  # waits for the read, then goes
    assert t.state is kvx.TransferState.DONE
    assert pool[:BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()


def test_a_full_peer_slot_limit_waits_as_before(make_worker, make_agent, checks):
    worker, agent, _, region, peer = _peer(
        make_worker,
        make_agent,
        limits=kvx.Limits(max_inflight_per_peer=2),
        timeouts=kvx.Timeouts(transfer_s=0.3),
    )
    worker.freeze()
    try:
        held = [peer.read(region.descs(i * BLOCK, BLOCK), peer.regions[0].descs(0, BLOCK)) for i in range(2)]
        with pytest.raises(kvx.TimeoutError, match="max_inflight_per_peer"):
            peer.read(region.descs(2 * BLOCK, BLOCK), peer.regions[0].descs(0, BLOCK))
    finally:
        worker.thaw()
    for t in held:
        t.wait(10)
    assert len(checks) == 3
    # The one refused a slot released its pin: the region can go at once.
    agent.deregister(region, timeout_s=0.5)


def test_a_post_that_fails_releases_everything(make_worker, make_agent, checks, monkeypatch):
    _, agent, _, region, peer = _peer(make_worker, make_agent)

    def broken(*args):
        raise kvx.PeerLostError("the link broke as the request went out")

    monkeypatch.setattr(TcpChannel, "post", broken)
    with pytest.raises(kvx.PeerLostError, match="as the request went out"):
        peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
    assert len(checks) == 1 and checks[0] is not None
    assert peer._inflight == 0
    agent.deregister(region, timeout_s=0.5)  # no pin left behind


def test_an_agent_that_verifies_takes_the_full_path(make_worker, make_agent, checks):
    worker, _, pool, region, peer = _peer(make_worker, make_agent, verify=True)
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(BLOCK, BLOCK)).wait(10)
    assert checks == []
    assert pool[:BLOCK].tobytes() == worker.expected(BLOCK, BLOCK).tobytes()
