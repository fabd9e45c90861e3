"""The rdma backend's own cases: when it is offered and chosen, and what a
peer holding a key can and cannot do. The transfer, fault and chaos suites
(test_transfer.py, test_faults.py, test_chaos.py) run over rdma as well,
through libfabric's tcp provider, which does real one-sided READ and WRITE.

The attacks speak the wire and the fabric directly: a raw authenticated
control connection, and an endpoint of this process's own.
"""

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import kvx
from kvx.agent import parse_metadata
from kvx.backends import rdma
from kvx.backends import shm as shm_backend
from kvx.backends.control import wire as _wire
from kvx.backends.control.serve import Fatal
from kvx.backends.control.wire import MsgType
from kvx.v1 import agent_pb2
from tests import conftest
from tests.conftest import RDMA_PROVIDER, native_pass_only, wait_until
from tests.integration.test_faults import _expect_error_then_close, _read_message, _session

# kvx._fabric moves the bytes whatever KVX_NATIVE says: one pass is enough.
pytestmark = native_pass_only
BLOCK = 4096


def _fabric():
    fabric, why = rdma.load_fabric()
    if why is not None:
        pytest.skip(f"the rdma backend needs kvx._fabric: {why}")
    if conftest.NATIVE == "0":
        pytest.skip("rdma moves bytes through kvx._fabric: it runs in the KVX_NATIVE=1 pass")
    return fabric


@pytest.fixture
def fabric(monkeypatch):
    module = _fabric()
    monkeypatch.setenv(rdma.PROVIDER_ENV, RDMA_PROVIDER)
    return module


def _offers_rdma(metadata: bytes) -> list[str]:
    return [e.address for e in parse_metadata(metadata).endpoints if e.backend == agent_pb2.BACKEND_RDMA]


# Without a fabric, and which provider: a stand-in module for kvx/backends/rdma/fabric.py.


class _FakeFabric:
    def __init__(self, providers):
        self._providers = providers
        self.opened = []

    def available(self):
        return None

    def providers(self, node=None):
        return [types.SimpleNamespace(provider=p, fabric="f", domain="d") for p in self._providers]

    def Endpoint(self, provider=None, node=None, domain=None, hmem=False):  # noqa: N802 - as the module names it
        self.opened.append(provider)
        raise RuntimeError(f"no {provider} device in this test")


def test_forcing_rdma_without_libfabric_fails_naming_what_is_missing(monkeypatch, caplog):
    monkeypatch.setattr(rdma, "rdma_hardware", lambda: True)  # as where sysfs lists a device
    monkeypatch.setattr(rdma, "load_verbs", lambda: (None, "no RDMA device in this test"))
    why = "kvx was built without libfabric (apt-get install libfabric-dev, then reinstall kvx)"
    monkeypatch.setattr(rdma, "load_fabric", lambda: (None, why))
    with pytest.raises(kvx.ConfigError, match=r"backend='rdma' needs libfabric: .*libfabric-dev"):
        kvx.Agent("forced", backend="rdma")
    with caplog.at_level(logging.WARNING), kvx.Agent("auto") as agent:
        assert "rdma" in agent._backends and not _offers_rdma(agent.metadata())
    assert not [r for r in caplog.records if "rdma" in r.getMessage()]  # auto skips it quietly


def test_auto_loads_no_libfabric_where_sysfs_lists_no_rdma_device(monkeypatch, tmp_path):
    monkeypatch.delenv(rdma.PROVIDER_ENV, raising=False)
    monkeypatch.delenv("KVX_IBVERBS_LIB", raising=False)
    (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)
    monkeypatch.setenv(rdma.SYSFS_ROOT_ENV, str(tmp_path))
    loaded = []
    monkeypatch.setattr(rdma, "load_fabric", lambda: loaded.append("fabric") or (None, "not built"))
    monkeypatch.setattr(rdma, "load_verbs", lambda: loaded.append("verbs") or (None, "not built"))
    with kvx.Agent("auto") as agent:
        assert "no RDMA device is listed" in agent._backends["rdma"].why_not
    assert loaded == []
    # One device listed: auto looks for its providers.
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir()
    kvx.Agent("auto-device").close()
    assert loaded[:2] == ["fabric", "verbs"]


def test_auto_never_opens_the_tcp_provider_by_itself(monkeypatch):
    monkeypatch.delenv(rdma.PROVIDER_ENV, raising=False)
    # As where sysfs lists an RDMA device, but no ibverbs device here (and loading libibverbs
    # would keep the verbs double out of this process).
    monkeypatch.setattr(rdma, "rdma_hardware", lambda: True)
    monkeypatch.setattr(rdma, "load_verbs", lambda: (None, "no RDMA device in this test"))
    fake = _FakeFabric(["tcp;ofi_rxm", "udp;ofi_rxd"])
    monkeypatch.setattr(rdma, "load_fabric", lambda: (fake, None))
    with kvx.Agent("auto") as agent:
        assert not _offers_rdma(agent.metadata()) and fake.opened == []
        assert "no RDMA hardware provider" in agent._backends["rdma"].why_not
    with pytest.raises(kvx.ConfigError, match=r"tcp;ofi_rxm: no tcp;ofi_rxm device"):
        kvx.Agent("forced", backend="rdma")  # configured by name: the software provider will do
    assert fake.opened == ["tcp;ofi_rxm"]
    fake = _FakeFabric(["tcp;ofi_rxm", "verbs;ofi_rxm", "efa"])
    monkeypatch.setattr(rdma, "load_fabric", lambda: (fake, None))
    kvx.Agent("auto-hw").close()  # both fail here; auto warns and goes on without rdma
    assert fake.opened == ["efa", "efa", "verbs;ofi_rxm", "verbs;ofi_rxm"]  # with GPU memory, then without
    monkeypatch.setenv(rdma.PROVIDER_ENV, "sockets")
    with pytest.raises(kvx.ConfigError, match=rdma.PROVIDER_ENV):
        kvx.Agent("explicit", backend="rdma")  # a provider asked for by name must open
    assert fake.opened[-1] == "sockets"
    with kvx.Agent("explicit-auto") as agent:  # under auto: left out, saying why
        assert "rdma" not in agent._backends


# Over the real fabric (libfabric's tcp provider between processes).


def test_rdma_is_chosen_by_name_and_auto_keeps_shm_on_one_host(make_worker, make_agent, fabric):
    worker = make_worker()
    assert _offers_rdma(worker.metadata) == [RDMA_PROVIDER]  # KVX_RDMA_PROVIDER set: offered under auto
    peer = make_agent("forced", backend="rdma").add_peer(worker.metadata)
    assert peer.backend == "rdma" and RDMA_PROVIDER in peer.backend_reason
    assert make_agent("auto").add_peer(worker.metadata).backend == "shm"
    elsewhere = parse_metadata(worker.metadata)
    elsewhere.host_name, elsewhere.boot_id = "another-host", "0" * 36
    # Another host: rdma, since both offer it (the bytes still reach the worker over loopback).
    far = make_agent("far").add_peer(elsewhere.SerializeToString())
    assert far.backend == "rdma" and "another host" in far.backend_reason
    pool = np.zeros(4 * BLOCK, np.uint8)
    region = far.agent.register(pool)
    far.read(region.descs(0, 4 * BLOCK), far.regions[0].descs(BLOCK, 4 * BLOCK)).wait(10)
    assert pool.tobytes() == worker.expected(BLOCK, 4 * BLOCK).tobytes()


def test_a_provider_mismatch_says_what_to_set(make_worker, make_agent, fabric, monkeypatch):
    worker = make_worker()
    md = parse_metadata(worker.metadata)
    next(e for e in md.endpoints if e.backend == agent_pb2.BACKEND_RDMA).address = "efa"
    with pytest.raises(kvx.ConnectError, match=rf"offers rdma over efa.*set {rdma.PROVIDER_ENV} alike"):
        make_agent(backend="rdma").add_peer(md.SerializeToString())


def _raw_rdma_peer(sock, fabric):
    """This process's own endpoint, connected to the target over the raw
    authenticated connection ``sock``: (endpoint, fabric peer)."""
    ep = fabric.Endpoint(provider=RDMA_PROVIDER)
    half, info = ep.prepare()
    payload = rdma.pack_connect(0, 1, [info])
    sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=len(payload)) + payload)
    (msg_type, _), body = _read_message(sock)
    assert msg_type == MsgType.RDMA_CONNECT_OK, body
    answer = rdma.parse_connect(body, "target")
    assert answer.rails == 1 and len(answer.infos) == 1
    return ep, ep.complete(half, answer.infos[0])


def _pin_key(sock, request_id, region_id, aux):
    ids = np.array([region_id], "<u4").tobytes()
    sock.sendall(
        _wire.pack(MsgType.SHM_PIN, request_id, payload_len=len(ids), aux=aux | _wire.PIN_RDMA) + ids
    )
    (msg_type, _), body = _read_message(sock)
    assert msg_type == MsgType.SHM_PIN_OK, body
    base, size, key = np.frombuffer(body, np.uint64).tolist()
    return base, size, key


def _post(ep, fabric_peer, op, local, remote_addr, key, timeout_ms=5000):
    u64 = lambda *v: np.array(v, np.uint64)  # noqa: E731
    ep.post(
        op,
        fabric_peer,
        u64(local.ctypes.data),
        u64(local.nbytes),
        u64(remote_addr),
        u64(local.nbytes),
        u64(key),
        timeout_ms,
    )


_REFUSED = (Exception,)  # a FabricError (an error completion) or a timeout: never success


def test_a_read_key_does_not_let_a_peer_write(fabric):
    """The attack: pin a region that allows no remote write for reading, then
    WRITE through the key the pin answered."""
    with kvx.Agent("target", backend="rdma") as target:
        data = np.arange(8 * BLOCK, dtype=np.uint8)
        data.flags.writeable = False  # remote read only
        region = target.register(data)
        assert region.remote_read and not region.remote_write
        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
        ep, peer = _raw_rdma_peer(sock, fabric)
        try:
            local = np.zeros(BLOCK, np.uint8)
            mr = ep.register(local.ctypes.data, local.nbytes, remote_read=False, remote_write=False)
            base, size, key = _pin_key(sock, 2, region.id, _wire.PIN_READ)
            assert size == data.nbytes
            at = base if ep.virt_addr else 0
            _post(ep, peer, 0, local, at + BLOCK, key)  # reading is what the pin allows
            assert local.tobytes() == data[BLOCK : 2 * BLOCK].tobytes()
            local[:] = 0xEE
            with pytest.raises(_REFUSED):
                _post(ep, peer, 1, local, at + BLOCK, key)
            assert data.tobytes() == np.arange(8 * BLOCK, dtype=np.uint8).tobytes()
            # And the pin itself refuses to pin it for writing.
            ids = np.array([region.id], "<u4").tobytes()
            aux = _wire.PIN_WRITE | _wire.PIN_RDMA
            sock.sendall(_wire.pack(MsgType.SHM_PIN, 3, payload_len=len(ids), aux=aux) + ids)
            (msg_type, code), text = _read_message(sock)
            assert (msg_type, code) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"does not allow" in text
            mr.close()
        finally:
            ep.close()
            sock.close()


def test_a_key_dies_with_its_region(fabric):
    """The attack: keep the key of a region after unpinning it, and use it
    once the target deregistered the region."""
    with kvx.Agent("target", backend="rdma") as target:
        data = np.full(4 * BLOCK, 7, np.uint8)
        region = target.register(data)
        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
        ep, peer = _raw_rdma_peer(sock, fabric)
        try:
            local = np.zeros(BLOCK, np.uint8)
            mr = ep.register(local.ctypes.data, local.nbytes, remote_read=False, remote_write=False)
            base, _, key = _pin_key(sock, 2, region.id, _wire.PIN_WRITE)
            at = base if ep.virt_addr else 0
            _post(ep, peer, 0, local, at, key)
            assert (local == 7).all()
            sock.sendall(_wire.pack(MsgType.SHM_UNPIN, 2))
            target.deregister(region, timeout_s=10)  # returns only once the registration is closed
            local[:] = 0xEE
            with pytest.raises(_REFUSED):
                _post(ep, peer, 1, local, at, key)
            with pytest.raises(_REFUSED):
                _post(ep, peer, 0, local, at, key)
            assert (data == 7).all() and (local == 0xEE).all()
            mr.close()
        finally:
            ep.close()
            sock.close()


def test_malformed_connect_exchanges_drop_the_connection_only(fabric, make_worker, make_agent):
    worker = make_worker()
    info = rdma.pack_connect(0, 1, [b"\x02\x00" + b"\x01" * 14])  # an address libfabric refuses
    sock, _ = _session(worker)  # oversized: refused before it is read
    sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=1 << 20))
    assert "at most" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)  # carries data
    sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=len(info), data_len=1 << 30) + info)
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    # Version, lengths, rail counts (none, over the bound, pairs not matching rails), a reserved byte.
    bad_rails = (info[:2] + b"\x00" + info[3:], info[:2] + b"\x11" + info[3:], info[:2] + b"\x02" + info[3:])
    for payload in (
        b"\x01" + info[1:],
        info[:-1],
        info + b"x",
        b"\x02",
        *bad_rails,
        info[:5] + b"\x01" + info[6:],
    ):
        sock, _ = _session(worker)
        sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=len(payload)) + payload)
        _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)  # well framed, but no endpoint's info
    sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=len(info)) + info)
    assert "malformed rdma endpoint info" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)  # twice on one connection
    ep, _ = _raw_rdma_peer(sock, fabric)
    try:
        _, again = ep.prepare()
        payload = rdma.pack_connect(0, 1, [again])
        sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 2, payload_len=len(payload)) + payload)
        assert "second RDMA_CONNECT" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    finally:
        ep.close()
    # The agent serves on, over rdma.
    peer = make_agent(backend="rdma").add_peer(worker.metadata)
    pool = np.zeros(BLOCK, np.uint8)
    region = peer.agent.register(pool)
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(BLOCK, BLOCK)).wait(10)
    assert peer.backend == "rdma" and pool.tobytes() == worker.expected(BLOCK, BLOCK).tobytes()


def test_the_target_forgets_a_peer_with_its_connection(fabric):
    with kvx.Agent("target", backend="rdma") as target:
        target.register(np.zeros(BLOCK, np.uint8))
        backend = target._backends["rdma"]
        with kvx.Agent("initiator", backend="rdma") as initiator:
            peer = initiator.add_peer(target.metadata())
            assert peer.backend == "rdma" and len(backend._inbound) == 1
        assert wait_until(lambda: not backend._inbound, 10)


class _RefusingEndpoint:
    """The target's endpoint, whose connect side fails (a broken fabric)."""

    def __init__(self, ep):
        self._ep = ep

    def prepare(self):
        raise RuntimeError("FI_ENODEV: the NIC went away")

    def __getattr__(self, name):
        return getattr(self._ep, name)


def test_a_refused_connect_exchange_falls_back_to_tcp_saying_why(fabric, monkeypatch, caplog):
    monkeypatch.setattr(shm_backend, "probe", lambda md: "cross-memory attach refused for this test")
    with kvx.Agent("target") as target, kvx.Agent("initiator") as initiator:
        data = np.arange(BLOCK, dtype=np.uint8)
        target.register(data)
        backend = target._backends["rdma"]
        backend.ep = _RefusingEndpoint(backend.ep)
        with caplog.at_level(logging.WARNING):
            peer = initiator.add_peer(target.metadata())
        assert peer.backend == "tcp" and "FI_ENODEV" in peer.backend_reason
        assert any("rdma connect exchange" in r.getMessage() for r in caplog.records)
        with (
            kvx.Agent("forced") as forced,
            pytest.raises(kvx.ConnectError, match="backend=rdma was configured.*FI_ENODEV"),
        ):
            forced.add_peer(target.metadata(), backend="rdma")
        local = np.zeros(BLOCK, np.uint8)
        region = initiator.register(local)
        peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK)).wait(10)
        assert local.tobytes() == data.tobytes()


class _FabricError(Exception):
    status = "FI_EIO"


def test_error_completions_name_the_status_and_the_peer_then_tcp_takes_over(
    make_worker, make_agent, fabric, caplog
):
    worker = make_worker()
    agent = make_agent(backend="rdma")
    pool = np.zeros(BLOCK, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    backend = agent._backends["rdma"]

    def failing_post(*args, **kwargs):
        raise _FabricError("remote access error")

    backend.run_post = failing_post
    with caplog.at_level(logging.WARNING):
        for _ in range(rdma.FAILURES_BEFORE_FALLBACK):
            t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
            with pytest.raises(kvx.TransferError, match=r"rdma READ with peer 'target' failed: FI_EIO"):
                t.wait(10)
    assert any("go over tcp from now on" in r.getMessage() for r in caplog.records)
    t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(2 * BLOCK, BLOCK))
    t.wait(10)
    assert pool.tobytes() == worker.expected(2 * BLOCK, BLOCK).tobytes()
    assert peer.alive and peer.backend == "rdma"


def test_an_address_of_an_unknown_family_does_not_break_the_endpoint_for_others(
    fabric, make_worker, make_agent
):
    worker = make_worker()
    info = rdma.pack_connect(0, 1, [b"\x01" * 16])
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.RDMA_CONNECT, 1, payload_len=len(info)) + info)
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    peer = make_agent(backend="rdma").add_peer(worker.metadata)
    assert peer.backend == "rdma"


def _listening_ports() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in mine:  # LISTEN, ours
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints the address as 32-bit words in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def test_an_agent_on_loopback_opens_no_rdma_port_on_the_network(fabric, make_agent):
    """The attack: an agent without an auth_secret listens on loopback only,
    but libfabric's tcp provider opened its own port on the first network
    interface, where any host could connect to it (and hold its file
    descriptors). The software provider now listens where the agent does."""
    before = _listening_ports()
    agent = make_agent("loopback-only", backend="rdma", listen="127.0.0.1:0")
    opened = _listening_ports() - before
    assert len(opened) >= 2, opened  # the control port and the endpoint's
    assert {address for address, _ in opened} == {"127.0.0.1"}, opened
    assert agent.metadata()


# Software providers: closing a registration does not stop an access already moving.


def _resets(agent):
    return agent._backends["rdma"].ep.counters()["resets"]


def test_a_write_in_flight_stops_landing_once_deregister_returns(fabric, make_agent):
    """The attack: pin a region for writing, keep its key, unpin, and start a
    256 MiB WRITE; the target deregisters the region meanwhile. With
    tcp;ofi_rxm the WRITE would keep landing after the registration closed;
    the target resets its endpoint before deregister returns. An honest peer
    connected to it goes on over rdma, byte-exact."""
    import threading
    import time

    size = 256 << 20
    with kvx.Agent("target", backend="rdma") as target:
        assert not target._backends["rdma"].ep.mr_close_is_final
        victim = np.zeros(size, np.uint8)
        region = target.register(victim)
        served = np.arange(4 * BLOCK, dtype=np.uint8)
        target.register(served)
        honest = make_agent("honest", backend="rdma")
        peer = honest.add_peer(target.metadata())
        assert peer.backend == "rdma"
        local = np.zeros(4 * BLOCK, np.uint8)
        mine = honest.register(local)
        peer.read(mine.descs(0, 4 * BLOCK), peer.regions[1].descs(0, 4 * BLOCK)).wait(10)
        assert local.tobytes() == served.tobytes()

        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
        ep, fabric_peer = _raw_rdma_peer(sock, fabric)
        source = np.full(size, 0xAB, np.uint8)
        mr = ep.register(source.ctypes.data, size, remote_read=False, remote_write=False)
        outcome: list[BaseException | None] = []
        writer = None
        try:
            base, _, key = _pin_key(sock, 2, region.id, _wire.PIN_WRITE)
            sock.sendall(_wire.pack(MsgType.SHM_UNPIN, 2))
            at = base if ep.virt_addr else 0

            def write():
                try:
                    _post(ep, fabric_peer, 1, source, at, key, timeout_ms=15_000)
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001 - the test reads it
                    outcome.append(exc)

            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            assert wait_until(lambda: victim[: 1 << 20].any(), 10), "the WRITE did not start"
            target.deregister(region, timeout_s=10)
            landed = int(np.count_nonzero(victim))
            assert landed < size, "the WRITE finished before the deregister; the test proves nothing"
            time.sleep(2)
            assert int(np.count_nonzero(victim)) == landed, "bytes landed after deregister returned"
            writer.join(20)
            assert outcome and outcome[0] is not None, "the WRITE should have failed"
            assert _resets(target) == 1
        finally:
            if writer is not None:
                writer.join(20)
            mr.close()
            ep.close()
            sock.close()

        # The honest peer heard of the reset and connects again: still rdma, byte-exact.
        channel = peer._channel
        assert wait_until(lambda: channel.pairs[0].stale, 10)
        for round_ in range(3):
            local[:] = 0
            peer.read(mine.descs(0, 4 * BLOCK), peer.regions[1].descs(0, 4 * BLOCK)).wait(10)
            assert local.tobytes() == served.tobytes(), round_
        assert peer.backend == "rdma" and channel.fallback is None and not channel._failures
        assert not channel.pairs[0].stale and channel.pairs[0].down is None


def test_a_region_never_pinned_for_rdma_is_deregistered_without_a_reset(fabric, make_agent):
    with kvx.Agent("target", backend="rdma") as target:
        region = target.register(np.zeros(4 * BLOCK, np.uint8))
        kept = target.register(np.arange(4 * BLOCK, dtype=np.uint8))
        honest = make_agent("honest", backend="rdma")
        peer = honest.add_peer(target.metadata())
        local = np.zeros(4 * BLOCK, np.uint8)
        peer.read(honest.register(local).descs(0, 4 * BLOCK), peer.regions[1].descs(0, 4 * BLOCK)).wait(10)
        target.deregister(region, timeout_s=10)
        assert _resets(target) == 0
        target.deregister(kept, timeout_s=10)  # its key went out in a lease
        assert _resets(target) == 1


def test_a_timed_out_read_does_not_land_after_the_error(fabric, make_worker, make_agent):
    """The attack: the target stalls (SIGSTOP) during a READ until it times
    out, then resumes; with tcp;ofi_rxm its bytes would land in the buffer
    the initiator reuses after the error. The initiator resets its endpoint
    before the error reaches the caller."""
    import time

    worker = make_worker(pool_bytes=1 << 20)
    agent = make_agent("initiator", backend="rdma", timeouts=kvx.Timeouts(io_s=1))
    local = np.zeros(1 << 20, np.uint8)
    region = agent.register(local)
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "rdma"
    peer.read(region.descs(0, 1 << 20), peer.regions[0].descs(0, 1 << 20)).wait(10)  # leased now
    assert local.tobytes() == worker.expected(0, 1 << 20).tobytes()
    local[:] = 0
    worker.freeze()
    try:
        t = peer.read(region.descs(0, 1 << 20), peer.regions[0].descs(0, 1 << 20))
        with pytest.raises(kvx.TimeoutError):
            t.wait(10)
        local[:] = 0x11  # the memory is reused
    finally:
        worker.thaw()
    time.sleep(2)
    assert int(np.count_nonzero(local != 0x11)) == 0, "a READ that timed out landed later"
    assert _resets(agent) == 1


@pytest.mark.parametrize(
    "request_id, payload, aux",
    [(7, b"", 0), (0, b"x" * 16, 0), (0, b"", 99)],
    ids=["request-id", "payload", "rail-out-of-range"],
)
def test_a_malformed_rdma_reset_ends_that_link_only(fabric, request_id, payload, aux):
    """The attack, from a hostile target: RDMA_RESET (a target's notice that
    its endpoint was reset) with a request id, a payload, or a rail pair the
    link does not have. The initiator drops that link with a ProtocolError
    rather than acting on it, and connects to the target again afterwards."""
    with kvx.Agent("target", backend="rdma") as target, kvx.Agent("initiator", backend="rdma") as initiator:
        pool = np.arange(4 * BLOCK, dtype=np.uint32).view(np.uint8)[: 4 * BLOCK].copy()
        target.register(pool)
        local = np.zeros(BLOCK, np.uint8)
        region = initiator.register(local)
        peer = initiator.add_peer(target.metadata())
        assert peer.backend == "rdma"
        (conn,) = list(target._backends["rdma"]._inbound)
        message = _wire.pack(MsgType.RDMA_RESET, request_id, payload_len=len(payload), aux=aux) + payload
        conn.send_oneway(message)
        assert wait_until(lambda: not peer.alive, 10)
        with pytest.raises(kvx.PeerLostError, match="RDMA_RESET|rail pair"):
            peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        again = initiator.add_peer(target.metadata())
        again.read(region.descs(0, BLOCK), again.regions[0].descs(BLOCK, BLOCK)).wait(10)
        assert local.tobytes() == pool[BLOCK : 2 * BLOCK].tobytes()
        assert again.backend == "rdma"


# One address, one peer number: a reconnect that fails must not disconnect it
# for the other users of that address (see test_fabric's shared peer test).


def _bare_backend(ep) -> rdma.RdmaBackend:
    """An RdmaBackend on one given endpoint, without an agent around it."""
    be = rdma.RdmaBackend.__new__(rdma.RdmaBackend)
    be.eps = [ep]
    be._lock = threading.Lock()
    be._idle = threading.Condition(be._lock)
    be._closed = False
    be._posts = 0
    be.generations = [0]
    be._inbound = {}
    be._gpu_registered = 0
    be._gpu_failed = None
    be.ctx = types.SimpleNamespace(agent_name="A", io_ms=5000, timeouts=types.SimpleNamespace(close_s=1))
    return be


class _SharedAddress:
    """Endpoint A with a peer number for endpoint B that a test shares."""

    def __init__(self, fab) -> None:
        self.a = fab.Endpoint(RDMA_PROVIDER, "127.0.0.1")
        self.b = fab.Endpoint(RDMA_PROVIDER, "127.0.0.1")
        self.pool = np.arange(BLOCK, dtype=np.uint8)
        self.local = np.zeros(BLOCK, np.uint8)
        self.mr_b = self.b.register(self.pool.ctypes.data, BLOCK, remote_read=True, remote_write=False)
        self.mr_a = self.a.register(self.local.ctypes.data, BLOCK, remote_read=False, remote_write=False)
        _, self.b_info = self.b.prepare()

    def read(self, peer: int) -> None:
        u = lambda *v: np.array(v, np.uint64)  # noqa: E731
        remote = self.pool.ctypes.data if self.b.virt_addr else 0
        self.a.post(0, peer, u(self.local.ctypes.data), u(64), u(remote), u(64), u(self.mr_b.key), 5000)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_a_failed_reconnect_from_a_peer_leaves_another_users_address(fabric):
    """The attack: peer C connects to agent A presenting honest peer B's
    endpoint info (B sent it to C when B connected to C), so C's connection
    shares A's peer number for B with A's own channel to B; then C asks to
    reconnect with info A refuses. A must still reach B."""
    shared = _SharedAddress(fabric)
    try:
        a_to_b = shared.a.complete(None, shared.b_info)  # A's own channel to B
        backend = _bare_backend(shared.a)
        ours, theirs = socket.socketpair()
        closed: list = []

        class Conn:  # the inbound connection's part the handler uses
            sock = theirs
            peer_name = "C"

            def send_error(self, *args) -> None:
                pass

            def when_closed(self, fn) -> None:
                closed.append(fn)

            def send_oneway(self, message: bytes) -> None:
                pass

        conn = Conn()

        def exchange(payload: bytes) -> None:
            ours.sendall(payload)
            backend._on_connect(conn, 1, len(payload), 0, 0)

        exchange(rdma.rails.pack_connect(0, 1, [shared.b_info]))
        ours.recv(4096)
        foreign = bytes([0xFF, 0xFF]) + shared.b_info[2:]  # an address family A refuses
        with pytest.raises(Fatal):
            exchange(rdma.rails.pack_connect(rdma.rails.FLAG_RECONNECT, 1, [foreign], 0))
        for hook in closed:  # C's connection ends
            hook()
        shared.read(a_to_b)
        assert shared.local[:64].tobytes() == shared.pool[:64].tobytes()
        ours.close()
        theirs.close()
    finally:
        shared.close()


def test_a_failed_rail_reconnect_leaves_another_users_address(fabric):
    """A rail whose reconnect fails (the peer is slow to answer) keeps its old
    peer number and disconnects it once, with its channel; an inbound user of
    the same address keeps reaching it."""
    from kvx.backends.rdma.channel import RdmaChannel

    shared = _SharedAddress(fabric)
    try:
        inbound = shared.a.complete(None, shared.b_info)
        outbound = shared.a.complete(None, shared.b_info)
        assert inbound == outbound

        class SlowLink:
            peer = "B"
            alive = True

            def ask(self, msg_type, payload):
                raise kvx.TimeoutError("RDMA_CONNECT answer did not come")

        channel = RdmaChannel(
            SlowLink(), _bare_backend(shared.a), [outbound], remote_rails=1, remote_gpu=False
        )
        channel._rail_down(channel.pairs[0], kvx.TransferError("error completion"))
        for _ in range(2):
            channel._revive()
        channel.disconnect()
        shared.read(inbound)
        assert shared.local[:64].tobytes() == shared.pool[:64].tobytes()
    finally:
        shared.close()


def test_a_failed_reset_closes_the_rail_rather_than_leave_it_open(fabric, monkeypatch, caplog):
    """deregister relies on the reset to stop bytes a peer started: when the
    reset fails, the endpoint is closed instead, so that nothing moves
    through it once deregister returns."""
    with kvx.Agent("target", backend="rdma") as target:
        region = target.register(np.zeros(BLOCK, np.uint8))
        backend = target._backends["rdma"]
        ep = backend.eps[0]
        monkeypatch.setattr(target._regions, "take_keys_out", lambda rid: True)  # as if pinned for rdma

        def failing_reset(reason: str = "", drop=()) -> None:
            raise kvx.ConnectError("the provider did not open again")

        monkeypatch.setattr(ep, "reset", failing_reset)
        with caplog.at_level(logging.ERROR, logger="kvx.backends.rdma"):
            target.deregister(region)
        assert "the rail is closed" in caplog.text
        with pytest.raises(Exception, match="closed"):
            ep.prepare()


_SIGTERM_SCRIPT = """
import ctypes, os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
import faulthandler
faulthandler.enable()
libc = ctypes.CDLL(None)
libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
def handlers():
    out = {}
    for sig in range(1, signal.NSIG):
        buf = ctypes.create_string_buffer(256)
        if libc.sigaction(sig, None, buf) == 0:
            out[sig] = buf.raw[: ctypes.sizeof(ctypes.c_void_p)]  # the handler: the first member
    return out
before = handlers()
import kvx
from kvx.backends.rdma import fabric
with kvx.Agent("sigterm", backend="auto"):
    pass
fabric.providers()
after = handlers()
changed = sorted(s for s in before if before[s] != after.get(s))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled" if got else "lost", changed)
"""


def test_loading_libfabric_leaves_the_applications_signal_handlers(fabric):
    """Libraries libfabric links (Debian's libinfinipath, under its PSM
    provider) install signal handlers when they load: a daemon's SIGTERM then
    ended the process with status 1 instead of draining it, and Python's
    faulthandler lost SIGSEGV. Every disposition is as the application set it."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "handled []", done.stdout + done.stderr
