"""The rdma backend over its ibverbs provider (kvx._verbs), end to end through
the libibverbs double (tests/rdma_double): two agents in this process, the
real pin/key path, the connect exchange, rails, failover and fallback.

The double moves bytes with memcpy between the QPs of this process, so both
agents live here. kvx._verbs loads one libibverbs per process: where another
test loaded the system's first, this module runs again in a process of its
own and each test reports that run's outcome.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import types

import numpy as np
import pytest

import kvx
from kvx.backends import rdma
from kvx.backends.rdma import channel as rdma_channel
from kvx.backends.rdma import topology
from tests import rdma_double
from tests.conftest import native_pass_only

pytestmark = native_pass_only

PIECE = 32 * 1024
COUNT = 1000
MIB = 1 << 20
_apart: dict[str, tuple[str, str]] | None = None  # this module's outcomes in a process of its own


@pytest.fixture(scope="module")
def loaded():
    try:
        _, lib, _ = rdma_double.load()
    except rdma_double.Unavailable as why:
        if not why.loaded_other or os.environ.get(rdma_double.APART_ENV):
            pytest.skip(str(why))
        return None
    lib.fake_qp_bytes.restype = ctypes.c_longlong
    return lib


@pytest.fixture
def double(loaded, request, monkeypatch):
    global _apart
    if loaded is None:
        if _apart is None:
            _apart = rdma_double.run_apart(__file__)
        outcome, message = _apart.get(request.node.name, _apart.get("", ("failed", "not run")))
        if outcome == "failed":
            pytest.fail(f"failed in a process of its own: {message}")
        pytest.skip(f"{outcome} in a process of its own (another libibverbs was loaded here first)")
    monkeypatch.setenv(rdma.PROVIDER_ENV, rdma_channel.VERBS)
    monkeypatch.delenv(topology.DEVICES_ENV, raising=False)
    rdma_double.use_double(monkeypatch, rdma_double.built_path())
    loaded.fake_set_dead(0, 0)
    yield loaded
    loaded.fake_set_dead(0, 0)


def _violations(lib) -> str:
    buf = ctypes.create_string_buffer(16384)
    lib.fake_violations(buf, len(buf))
    return buf.value.decode()


def _pair(make_agent, size: int):
    target = make_agent("target", backend="rdma")
    data = np.frombuffer(os.urandom(size), np.uint8).copy()
    target_region = target.register(data)
    agent = make_agent("initiator", backend="rdma")
    peer = agent.add_peer(target.metadata())
    pool = np.zeros(size, np.uint8)
    region = agent.register(pool)
    return types.SimpleNamespace(
        target=target,
        target_region=target_region,
        data=data,
        agent=agent,
        peer=peer,
        pool=pool,
        region=region,
    )


def _qpns(p) -> tuple[list[int], list[int]]:
    """The initiator's QP numbers per rail, and the target's."""
    mine = p.agent._backends["rdma"]
    theirs = p.target._backends["rdma"]
    ours = [mine.eps[pair.rail].peer_state(pair.fabric_peer)[1] for pair in p.peer._channel.pairs]
    (inbound,) = theirs._inbound.values()
    return ours, [theirs.eps[rail].peer_state(fp)[1] for rail, fp in inbound]


def test_agents_choose_rdma_over_verbs_and_move_1000_pieces_byte_exact(double, make_agent):
    _violations(double)
    p = _pair(make_agent, COUNT * PIECE)
    assert p.peer.backend == "rdma" and "rdma over verbs" in p.peer.backend_reason
    assert p.agent._backends["rdma"].ep.domain == "fake_roce0"
    order = np.random.default_rng(11).permutation(COUNT)  # remote pieces scattered
    local = np.arange(COUNT) * PIECE
    remote = order * PIECE
    p.peer.read(p.region.descs(local, PIECE), p.peer.regions[0].descs(remote, PIECE)).wait(30)
    expected = p.data.reshape(COUNT, PIECE)[order].reshape(-1)
    assert np.array_equal(p.pool, expected)
    ours, theirs = _qpns(p)
    assert double.fake_qp_bytes(ours[0]) == COUNT * PIECE  # through the QP, not over tcp
    p.pool[:] = np.frombuffer(os.urandom(COUNT * PIECE), np.uint8)
    p.peer.write(p.region.descs(local, PIECE), p.peer.regions[0].descs(remote, PIECE)).wait(30)
    assert np.array_equal(p.data.reshape(COUNT, PIECE)[order].reshape(-1), p.pool)
    assert double.fake_qp_bytes(ours[0]) == 2 * COUNT * PIECE
    assert _violations(double) == ""


class _Fabric:
    """libfabric listing these providers."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def providers(self):
        return [types.SimpleNamespace(provider=n, domain="d") for n in self.names]


def test_auto_prefers_verbs_unless_libfabric_lists_efa(double, monkeypatch, make_agent):
    monkeypatch.delenv(rdma.PROVIDER_ENV)
    # The choice, best first: kvx._verbs finds fake_roce0; libfabric's verbs comes after it.
    assert rdma._candidates(False, "", _Fabric("tcp;ofi_rxm", "verbs;ofi_rxm")) == ["verbs", "verbs;ofi_rxm"]
    assert rdma._candidates(False, "", _Fabric("efa", "tcp;ofi_rxm")) == ["efa", "verbs"]
    assert rdma._candidates(False, "", None) == ["verbs"]
    assert rdma._candidates(True, "", _Fabric("tcp")) == ["verbs", "tcp;ofi_rxm"]
    # And an agent under auto opens it: its metadata offers rdma over verbs.
    fab, _ = rdma.load_fabric()
    if fab is not None and "efa" in {info.provider.split(";")[0] for info in fab.providers()}:
        pytest.skip("this host's libfabric lists efa, which auto prefers")
    agent = make_agent("auto")
    backend = agent._backends["rdma"]
    assert backend.provider == "verbs" and backend.ep.domain == "fake_roce0"


def _break_and_heal(p, double, threads: int) -> list[BaseException | None]:
    """``threads`` READs at once while the target's QP answers nothing (each
    fails with retry exceeded once the delay passed); then the peer is back."""
    _, theirs = _qpns(p)
    double.fake_set_dead(theirs[0], 2000)  # generous: every thread posts within it
    outcomes: list[BaseException | None] = [None] * threads

    def one(i: int) -> None:
        try:
            p.peer.read(p.region.descs(i * PIECE, PIECE), p.peer.regions[0].descs(i * PIECE, PIECE)).wait(20)
        except kvx.KvxError as error:
            outcomes[i] = error

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers)
    double.fake_set_dead(0, 0)
    return outcomes


def test_an_error_completion_fails_the_transfer_and_the_next_reconnects(double, make_agent, caplog):
    p = _pair(make_agent, 8 * PIECE)
    p.peer.read(p.region.descs(0, 8 * PIECE), p.peer.regions[0].descs(0, 8 * PIECE)).wait(10)
    ours, theirs = _qpns(p)
    (error,) = _break_and_heal(p, double, 1)
    assert isinstance(error, kvx.TransferError)
    assert "transport retry counter exceeded" in str(error) and "peer 'target'" in str(error)
    backend = p.agent._backends["rdma"]
    pair = p.peer._channel.pairs[0]
    assert backend.eps[0].peer_state(pair.fabric_peer)[0] in ("broken", "free")
    p.pool[:] = 0
    with caplog.at_level(logging.INFO):
        p.peer.read(p.region.descs(0, 8 * PIECE), p.peer.regions[0].descs(0, 8 * PIECE)).wait(10)
    assert np.array_equal(p.pool, p.data)
    assert any("connecting rdma rail 0 again" in r.getMessage() for r in caplog.records)
    new_ours, new_theirs = _qpns(p)  # a new RDMA_CONNECT: new QPs on both sides
    assert new_ours[0] not in ours and new_theirs[0] not in theirs
    assert double.fake_qp_bytes(new_ours[0]) == 8 * PIECE
    assert p.peer._channel.fallback is None


def test_transfers_failing_with_one_broken_qp_do_not_fall_back_to_tcp(double, make_agent, caplog):
    """FAILURES_BEFORE_FALLBACK + 1 transfers in a row fail on one QP that
    broke; the reconnect heals it, and the peer stays on rdma. (Counted per
    transfer, they sent the peer to tcp for good.)"""
    n = rdma_channel.FAILURES_BEFORE_FALLBACK + 1
    p = _pair(make_agent, n * PIECE)
    p.peer.read(p.region.descs(0, n * PIECE), p.peer.regions[0].descs(0, n * PIECE)).wait(10)
    with caplog.at_level(logging.WARNING):
        outcomes = _break_and_heal(p, double, n)
        assert all(isinstance(o, kvx.TransferError) for o in outcomes), outcomes
        p.pool[:] = 0
        p.peer.read(p.region.descs(0, n * PIECE), p.peer.regions[0].descs(0, n * PIECE)).wait(10)
    assert np.array_equal(p.pool, p.data)
    assert p.peer._channel.fallback is None
    assert not any("go over tcp" in r.getMessage() for r in caplog.records)
    ours, _ = _qpns(p)
    assert double.fake_qp_bytes(ours[0]) == n * PIECE  # over the new QP
    # A path that breaks every new QP still goes to tcp after FAILURES_BEFORE_FALLBACK.
    double.fake_set_dead(-1, 10)
    try:
        for _ in range(rdma_channel.FAILURES_BEFORE_FALLBACK):
            with pytest.raises(kvx.TransferError):
                p.peer.read(p.region.descs(0, PIECE), p.peer.regions[0].descs(0, PIECE)).wait(20)
    finally:
        double.fake_set_dead(0, 0)
    assert p.peer._channel.fallback is not None


def test_two_rails_on_one_device_stripe_a_64_mib_transfer(double, monkeypatch, make_agent):
    monkeypatch.setenv(topology.DEVICES_ENV, "fake_roce0,fake_roce0")
    p = _pair(make_agent, 64 * MIB)
    backend = p.agent._backends["rdma"]
    assert len(backend.eps) == 2 and "2 rail(s) to its 2" in p.peer.backend_reason
    p.peer.read(p.region.descs(0, 64 * MIB), p.peer.regions[0].descs(0, 64 * MIB)).wait(60)
    assert np.array_equal(p.pool, p.data)
    ours, _ = _qpns(p)
    moved = [double.fake_qp_bytes(q) for q in ours]
    assert sum(moved) == 64 * MIB and min(moved) >= 16 * MIB, moved  # both rails carried slices
    p.pool[:] = np.frombuffer(os.urandom(64 * MIB), np.uint8)
    p.peer.write(p.region.descs(0, 64 * MIB), p.peer.regions[0].descs(0, 64 * MIB)).wait(60)
    assert np.array_equal(p.pool, p.data)
    assert all(double.fake_qp_bytes(q) > m for q, m in zip(ours, moved, strict=True))
    assert _violations(double) == ""


def test_a_key_is_refused_once_deregister_returned(double, make_agent):
    from kvx.backends.rdma import verbs

    p = _pair(make_agent, 4 * PIECE)
    p.peer.read(p.region.descs(0, PIECE), p.peer.regions[0].descs(0, PIECE)).wait(10)
    theirs = p.target._backends["rdma"]
    key = theirs._mrs[p.target_region.id][0].key
    mine = p.agent._backends["rdma"]
    pair = p.peer._channel.pairs[0]
    local = p.pool.ctypes.data
    remote = p.data.ctypes.data

    def post(op: int) -> None:
        mine.eps[0].post(op, pair.fabric_peer, [local], [PIECE], [remote], [PIECE], [key], 5000)

    post(verbs.READ)  # the key works while the region is registered
    p.target.deregister(p.target_region, timeout_s=10)
    with pytest.raises(verbs.VerbsError) as raised:
        post(verbs.READ)
    assert raised.value.status == "remote access error"  # IBV_WC_REM_ACCESS_ERR
