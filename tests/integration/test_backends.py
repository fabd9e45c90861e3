"""The transport seam: the selector, registration, and what a failed
connect leaves behind."""

from __future__ import annotations

import types
from typing import ClassVar

import numpy as np
import pytest

import kvx
import kvx.backends
from kvx.backends.base import Backend
from kvx.backends.control import wire as _wire
from kvx.backends.control.serve import merge_handlers
from kvx.backends.control.sock import recv_exact
from kvx.backends.control.wire import MsgType
from kvx.backends.tcp import TcpChannel
from kvx.memory import MAX_REGION_ID
from kvx.v1 import agent_pb2
from tests.conftest import kvx_threads, open_fds, wait_until
from tests.integration.test_faults import _expect_error_then_close, _read_message, _session


def _tampered(metadata: bytes, edit) -> bytes:
    md = agent_pb2.AgentMetadata.FromString(metadata)
    edit(md)
    return md.SerializeToString()


def test_auto_never_picks_a_backend_that_is_configured_only(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent("auto-only")
    assert "procmem" in agent._backends  # loaded (tests/conftest.py registers it) ...
    assert agent.add_peer(worker.metadata).backend == "shm"  # ... but not chosen
    forced = make_agent("forced").add_peer(worker.metadata, backend="procmem")
    assert forced.backend == "procmem" and f"/proc/{worker.pid}/mem" in forced.backend_reason


def test_a_forced_backend_that_cannot_reach_says_why(make_worker, make_agent):
    worker = make_worker(backend="tcp")  # serves no pins
    with pytest.raises(kvx.ConnectError, match="backend=procmem was configured.*serves no pins"):
        make_agent().add_peer(worker.metadata, backend="procmem")


def test_a_backend_registered_after_the_agent_started_is_refused_clearly(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent("early")
    kvx.backends.register("procmem_late", "tests.backends.procmem:ProcMemBackend")
    try:
        with pytest.raises(kvx.ConfigError, match="registered after the agent started"):
            agent.add_peer(worker.metadata, backend="procmem_late")
        late = make_agent("late").add_peer(worker.metadata, backend="procmem_late")
        assert late.backend == "procmem_late"  # the name it was registered under
    finally:
        kvx.backends._REGISTRY.pop("procmem_late")


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_peer_refused_after_the_handshake_leaves_no_connection(make_worker, make_agent, backend):
    """Metadata the handshake accepts but the peer table refuses (a region id
    out of range): add_peer fails, and the dialled connections are closed."""
    worker = make_worker()
    agent = make_agent("careful", backend=backend)
    agent.register(np.zeros(4096, np.uint8))
    agent.add_peer(worker.metadata).close()  # warm up: lazily created threads and fds
    wait_until(lambda: not [t for t in kvx_threads() if t.startswith("kvx-read-")])
    fds, threads = open_fds(), kvx_threads()
    bad = _tampered(
        worker.metadata, lambda md: md.regions.add(id=MAX_REGION_ID, size_bytes=4096, remote_read=True)
    )
    with pytest.raises(kvx.ProtocolError, match="region id"):
        agent.add_peer(bad)
    assert agent.peers == []
    assert wait_until(lambda: open_fds() <= fds and kvx_threads() == threads), (
        open_fds(),
        fds,
        kvx_threads(),
    )


class EchoBackend(Backend):
    """A test backend that sets its channel up with a control request of its
    own (type 64, answered with 65) before moving bytes the tcp way."""

    auto = False

    def handlers(self):
        return {64: self._on_hello}

    def _on_hello(self, conn, request_id, payload_len, aux, data_len):
        body = bytes(recv_exact(conn.sock, payload_len))
        conn.sock.sendall(_wire.pack(65, request_id, payload_len=4 + len(body)) + b"echo" + body)

    def reach(self, md):
        return None, "echo was configured"

    def connect(self, md, link):
        answer = link.request(64, 65, b"ping")
        return TcpChannel(link), f"; the peer answered {answer!r}"


@pytest.fixture
def echo_backend():
    kvx.backends.register("echo", "tests.integration.test_backends:EchoBackend")
    try:
        yield
    finally:
        kvx.backends._REGISTRY.pop("echo")


def test_a_backend_sets_up_its_channel_with_a_control_request_of_its_own(echo_backend):
    with kvx.Agent("echo-target") as target, kvx.Agent("echo-initiator") as initiator:
        pool = np.arange(1 << 16, dtype=np.uint8)
        target.register(pool)
        local = np.zeros(1 << 16, np.uint8)
        region = initiator.register(local)
        peer = initiator.add_peer(target.metadata(), backend="echo")
        assert peer.backend == "echo" and "answered b'echoping'" in peer.backend_reason
        peer.read(
            kvx.Descs.from_blocks(region, [0], 4096), kvx.Descs.from_blocks(peer.regions[0], [3], 4096)
        ).wait(10)
        assert np.array_equal(local[:4096], pool[3 * 4096 : 4 * 4096])


def test_a_backend_request_is_small_and_carries_no_data(echo_backend):
    """The attack: an authenticated peer sends a backend's message type with a
    huge payload, hoping its handler reads it all."""
    with kvx.Agent("echo-target") as target:
        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
        sock.sendall(_wire.pack(64, 7, payload_len=_wire.MAX_HANDSHAKE_BYTES + 1))
        assert "at most 4096" in _expect_error_then_close(sock, _wire.ErrorCode.LIMIT)
        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
        sock.sendall(_wire.pack(64, 8, payload_len=4, data_len=1 << 30) + b"ping")
        _expect_error_then_close(sock, _wire.ErrorCode.LIMIT)
        sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))  # the agent still serves
        sock.sendall(_wire.pack(64, 9, payload_len=4) + b"ping")
        (msg_type, _), body = _read_message(sock)
        assert (msg_type, body) == (65, b"echoping")
        sock.close()


def test_backends_cannot_take_over_core_or_each_others_message_types():
    def handler(*args):
        raise AssertionError("never called")

    assert merge_handlers({"a": {64: handler}, "b": {65: handler}})[65] is handler
    for claimed, match in (
        ({"a": {MsgType.SHM_PIN: handler}}, "kvx serves it"),
        ({"a": {MsgType.NOTIFY: handler}}, "kvx serves it"),
        ({"a": {200: handler}}, "a backend's own types are 64-127"),
        ({"a": {64: handler}, "b": {64: handler}}, "both serve message type 64"),
    ):
        with pytest.raises(kvx.ConfigError, match=match):
            merge_handlers(claimed)


def test_a_backend_that_fails_to_load_is_left_out_unless_configured(make_worker):
    kvx.backends.register("broken", "tests.backends.no_such_module:Nothing")
    try:
        with kvx.Agent("tolerant") as agent:
            assert "broken" not in agent._backends and "tcp" in agent._backends
        with pytest.raises(kvx.ConfigError, match="backend 'broken' failed to load"):
            kvx.Agent("strict", backend="broken")
    finally:
        kvx.backends._REGISTRY.pop("broken")


class RegistrationBackend(Backend):
    """A test backend that stands for a NIC's registration: it records, when
    told a region is gone, whether the region still held its memory."""

    auto = False
    seen: ClassVar[list[tuple[int, bool]]] = []

    def deregistered(self, region):
        RegistrationBackend.seen.append((region.id, region.owner is not None))

    def reach(self, md):
        return "registration only", ""

    def connect(self, md, link):
        raise AssertionError("never connects")


def test_memory_is_held_until_every_backend_closed_its_registration():
    """A NIC's registration still reaches the memory until the backend closes
    it: the agent must not let the memory go (its last reference may be the
    region's) before every backend was told."""
    kvx.backends.register("registration", "tests.integration.test_backends:RegistrationBackend")
    RegistrationBackend.seen.clear()
    try:
        with kvx.Agent("registrar") as agent:
            region = agent.register(np.zeros(4096, np.uint8))  # the region holds the only reference
            agent.deregister(region)
            assert RegistrationBackend.seen == [(region.id, True)]
            assert region.owner is None  # and then let go
    finally:
        kvx.backends._REGISTRY.pop("registration")
