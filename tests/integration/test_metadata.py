"""The metadata service (memory store) with real gRPC calls, real agents and
agents in other processes."""

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvx
from kvx.metadata import store as store_module
from kvx.metadata.client import MetadataClient, NameHeldError, Watcher
from kvx.metadata.service import MetadataServer, ServiceLimits, ThreadedServer, TlsConfig
from kvx.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

_record, _stub = agent_record, stub

Event = metadata_pb2.WatchAgentsResponse


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _until(predicate, timeout_s=10.0):
    return wait_until(predicate, timeout_s, (kvx.ConnectError,))


def test_bad_registrations_get_clear_codes_and_change_nothing(service):
    stub = _stub(service.address)
    big = _record("big")
    big.engine_info["blob"] = "x" * 300_000
    many = _record("many")
    for i in range(5000):
        many.metadata.regions.add(id=i + 1, size_bytes=1)
    mismatched = _record("mismatch")
    mismatched.metadata.epoch = 99
    cases = {
        "invalid agent name": _record("bad name!"),
        "epoch must be set": _record("zero", epoch=0),
        "started_unix_ms": _record("nostart", started=0),
        "must equal": mismatched,
        "regions; at most": many,
    }
    for message, rec in cases.items():
        code, details = _code(
            lambda rec=rec: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=rec))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    code, _ = _code(lambda: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=big)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    code, details = _code(
        lambda: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("t"), ttl_s=1))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in details
    assert not stub.ListAgents(metadata_pb2.ListAgentsRequest()).records


def _refused(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_live_name_cannot_be_taken_without_its_lease(service):
    """The hijack: a later start time, another epoch, the same epoch or a guessed lease
    id cannot replace a live record; only the registration holding its lease can."""
    stub = _stub(service.address)
    lease = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=2, started=2000), ttl_s=10)
    ).lease_id
    far_future = _record("p", epoch=666, started=2**62)
    far_future.metadata.endpoints.add(backend=1, address="10.6.6.6:666")
    same_epoch = _record("p", epoch=2, started=2000, evil="1")
    attacks = [
        metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=1, started=1000)),
        metadata_pb2.RegisterAgentRequest(record=far_future, ttl_s=2),
        metadata_pb2.RegisterAgentRequest(record=same_epoch),
        metadata_pb2.RegisterAgentRequest(record=far_future, lease_id=lease ^ 2),
    ]
    for attack in attacks:
        error = _refused(lambda attack=attack: stub.RegisterAgent(attack))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
        assert "held by a live registration" in error.details() and "DELETE /v1/agents/p" in error.details()
        retry_after_ms = int(dict(error.trailing_metadata())["kvx-retry-after-ms"])
        assert 0 < retry_after_ms <= 10_000
    record = stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record
    assert (record.epoch, dict(record.labels), list(record.metadata.endpoints)) == (2, {}, [])
    assert record.lease_id == 0  # nobody but the registrant learns the lease
    # Unregistering is the registrant's too.
    for lease_id in (0, lease ^ 2):
        error = _refused(
            lambda lease_id=lease_id: stub.UnregisterAgent(
                metadata_pb2.UnregisterAgentRequest(name="p", epoch=2, lease_id=lease_id)
            )
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "admin API" in error.details()
    # The holder refreshes (same epoch), and may re-register as another epoch, with its lease.
    reply = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(
            record=_record("p", epoch=2, started=2000, zone="a"), lease_id=lease
        )
    )
    assert reply.lease_id != lease
    old = next(_stub(service.address).KeepAlive(iter([metadata_pb2.KeepAliveRequest(lease_id=lease)])))
    assert old.ttl_s == 0 or _until(
        lambda: (
            next(
                _stub(service.address).KeepAlive(iter([metadata_pb2.KeepAliveRequest(lease_id=lease)]))
            ).ttl_s
            == 0
        ),
        5,
    ), "the replaced lease is revoked"
    rec = stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record
    assert rec.epoch == 2 and rec.labels["zone"] == "a"
    assert stub.UnregisterAgent(
        metadata_pb2.UnregisterAgentRequest(name="p", epoch=2, lease_id=reply.lease_id)
    ).existed


def test_a_hijack_with_the_shared_token_leaves_the_real_agent_alone():
    """The review's attack end to end: with the shared gRPC token, register a live agent's
    name with a far-future start and a short lease. Decode keeps its connection, and the
    name still resolves to the real agent after the attacker's lease would have lapsed."""
    token = "grpc-token-0123456789"
    opts = kvx.MetadataOptions(token=token)
    auth = (("authorization", f"Bearer {token}"),)
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", token=token)) as srv,
        kvx.Agent("prefill-0", metadata=srv.address, metadata_options=opts, role="prefill") as prefill,
        kvx.Agent("decode-0", metadata=srv.address, metadata_options=opts, role="decode") as decode,
    ):
        pool = np.full(4096, 7, np.uint8)
        prefill.register(pool)
        local = np.zeros(4096, np.uint8)
        region = decode.register(local)
        peer = decode.connect("prefill-0")
        fake = _record("prefill-0", epoch=0xBAD, started=2**62)
        fake.metadata.endpoints.add(backend=1, address="127.0.0.1:9")
        error = _refused(
            lambda: _stub(srv.address).RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=fake, ttl_s=2), metadata=auth
            )
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        time.sleep(3)  # longer than the attacker's lease, and enough for any watch event to land
        assert peer.alive and decode.connect("prefill-0") is peer
        assert MetadataClient(srv.address, opts).get("prefill-0").epoch == prefill.epoch
        peer.read(region.descs(0, 4096), peer.regions[0].descs(0, 4096)).wait(5)
        assert (local == 7).all()


def test_an_agent_whose_name_was_taken_gets_it_back():
    """Evicted, and its name registered by someone else before it came back: the agent
    keeps asking (it never stops for good) and holds its name again once that lease lapses."""
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        opts = kvx.MetadataOptions(lease_ttl_s=3)
        with kvx.Agent("victim", metadata=srv.address, metadata_options=opts) as agent:
            client = MetadataClient(srv.address)
            assert srv.call(srv.server.servicer.unregister("victim", evict=True)).existed
            squatter = client.register(_record("victim", epoch=0xBAD, started=2**62), ttl_s=2)
            assert client.get("victim").epoch == 0xBAD
            assert _until(lambda: (r := client.get("victim")) is not None and r.epoch == agent.epoch, 10)
            assert _until(lambda: agent._directory.registration.lease_id is not None, 5)
            # And the squatter's old lease no longer names the record.
            assert not client.unregister("victim", 0xBAD, squatter.lease_id)


def test_a_restarted_agent_gets_its_name_back_within_the_old_lease(service, make_worker):
    """The legitimate restart: the old process dies without unregistering, its lease still
    runs; the new instance (new epoch) waits for it, at most the old lease's ttl."""
    worker = make_worker("restarting", metadata=service.address, role="prefill", lease_ttl_s=3)
    client = MetadataClient(service.address)
    old_epoch = client.get("restarting").epoch
    worker.kill()
    start = time.monotonic()
    opts = kvx.MetadataOptions(lease_ttl_s=3)
    with kvx.Agent("restarting", metadata=service.address, metadata_options=opts) as reborn:
        waited_s = time.monotonic() - start
        record = client.get("restarting")
        assert record.epoch == reborn.epoch != old_epoch
        assert waited_s < 3 + 5, waited_s  # the old lease's ttl, and slack for a busy machine


def test_a_second_live_agent_with_the_same_name_is_refused(service):
    opts = kvx.MetadataOptions(lease_ttl_s=2)
    with kvx.Agent("twin", metadata=service.address, metadata_options=opts) as first:
        start = time.monotonic()
        with pytest.raises(kvx.MetadataError, match="another live agent uses this name \\(") as info:
            kvx.Agent("twin", metadata=service.address, metadata_options=opts)
        assert time.monotonic() - start < 2 + 10  # about the lease's ttl: bounded, not forever
        assert "does not renew" not in str(info.value)  # the memory store renews every lease itself
        assert MetadataClient(service.address).get("twin").epoch == first.epoch


class _RenewedElsewhere(store_module.MemoryStore):
    """Leases as an etcd replica sees those another replica renews: their time comes
    with the etcd term it was read in (here always 7)."""

    async def held_ttl(self, lease_id: int) -> tuple[int, int]:
        return await self.lease_ttl(lease_id), 7


def test_a_lease_renewed_elsewhere_is_marked_and_named_a_live_duplicate(caplog):
    """The refusal says the service does not renew the holder's lease; a starting agent
    watches that lease's time, sees it rise again and again (renewed), and refuses
    the name within one wait."""
    with ThreadedServer(MetadataServer("127.0.0.1:0", _RenewedElsewhere())) as srv:
        client = MetadataClient(srv.address)
        channel = grpc.insecure_channel(srv.address)
        # Renewed every 5 s: each renewal puts back 5 s, well over what the rounding of the
        # answers to whole seconds (under 1 s), the agent's threshold (1.5 s) and the calls'
        # time in flight hide.
        opts = kvx.MetadataOptions(lease_ttl_s=15)
        with kvx.Agent("twin", metadata=srv.address, metadata_options=opts) as first:
            request = metadata_pb2.RegisterAgentRequest(record=_record("twin", epoch=99))
            with pytest.raises(grpc.RpcError) as info:
                metadata_pb2_grpc.MetadataServiceStub(channel).RegisterAgent(request, timeout=5)
            assert dict(info.value.trailing_metadata())["kvx-lease-etcd-term"] == "7"
            assert "this service replica does not renew it" in info.value.details()
            [held] = client.register_many([request])
            assert isinstance(held, NameHeldError) and held.etcd_term == 7
            start = time.monotonic()
            with (
                caplog.at_level(logging.WARNING),
                pytest.raises(kvx.MetadataError, match="another live agent uses this name, renewing at"),
            ):
                kvx.Agent("twin", metadata=srv.address, metadata_options=opts)
            assert time.monotonic() - start < 15 + 1 + 15  # one wait, and slack for a busy machine
            assert "still held past its time" not in caplog.text
            assert client.get("twin").epoch == first.epoch
        channel.close()
        client.close()


def test_lease_expiry_deletes_the_record_and_watchers_see_it(service):
    stub = _stub(service.address)
    events = []
    client = MetadataClient(service.address)
    watcher = Watcher(client, events.append)
    assert watcher.synced.wait(5)
    start = time.monotonic()
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("short"), ttl_s=2))
    assert _until(lambda: any(e.type == Event.EVENT_TYPE_DELETE for e in events), 5)
    assert time.monotonic() - start < 3.5
    deleted = [e for e in events if e.type == Event.EVENT_TYPE_DELETE][0]
    assert deleted.record.name == "short" and deleted.record.epoch == 7
    code, _ = _code(lambda: stub.GetAgent(metadata_pb2.GetAgentRequest(name="short")))
    assert code == grpc.StatusCode.NOT_FOUND
    watcher.stop()
    client.close()


def test_watch_sends_the_snapshot_then_changes(service):
    stub = _stub(service.address)
    lease = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("a", role=metadata_pb2.ROLE_PREFILL))
    ).lease_id
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("b", role=metadata_pb2.ROLE_DECODE)))
    stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(role=metadata_pb2.ROLE_PREFILL), timeout=10)
    first = [next(stream), next(stream)]
    assert [(e.type, e.record.name) for e in first] == [
        (Event.EVENT_TYPE_PUT, "a"),
        (Event.EVENT_TYPE_SYNCED, ""),
    ]
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("c", role=metadata_pb2.ROLE_DECODE)))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("d", role=metadata_pb2.ROLE_PREFILL)))
    stub.UnregisterAgent(metadata_pb2.UnregisterAgentRequest(name="a", lease_id=lease))
    later = [next(stream), next(stream)]
    assert [(e.type, e.record.name) for e in later] == [
        (Event.EVENT_TYPE_PUT, "d"),
        (Event.EVENT_TYPE_DELETE, "a"),
    ]
    stream.cancel()


def test_list_filters_and_pages(service):
    stub = _stub(service.address)
    for i in range(7):
        role = metadata_pb2.ROLE_DECODE if i % 2 else metadata_pb2.ROLE_PREFILL
        stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(
                record=_record(f"agent-{i}", role=role, model="m" if i < 5 else "n")
            )
        )
    names, token = [], ""
    while True:
        page = stub.ListAgents(
            metadata_pb2.ListAgentsRequest(
                role=metadata_pb2.ROLE_PREFILL, labels={"model": "m"}, page_size=1, page_token=token
            )
        )
        names += [r.name for r in page.records]
        token = page.next_page_token
        if not token:
            break
    assert names == ["agent-0", "agent-2", "agent-4"]
    code, _ = _code(lambda: stub.ListAgents(metadata_pb2.ListAgentsRequest(page_token="%%%")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(MetadataClient(service.address).list()) == 7


def test_health_and_reflection_are_on(service):
    channel = grpc.insecure_channel(service.address)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "kvx.v1.MetadataService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(
        reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    assert "kvx.v1.MetadataService" in [s.name for s in reply.list_services_response.service]


def test_health_watches_are_bounded_for_clients_without_the_token():
    """gRPC health needs no token (probes have none). Its Watch streams were
    unbounded, each keyed by a service name up to the message limit: now at
    most 64 at once, names of at most 256 characters, and a watch still
    sees the status change."""
    from kvx.metadata.service import MAX_HEALTH_WATCHES

    with ThreadedServer(MetadataServer("127.0.0.1:0", token="s3cret-token-for-the-test")) as srv:
        _bounded_health_watches(srv, MAX_HEALTH_WATCHES)


def _bounded_health_watches(srv: ThreadedServer, most: int) -> None:
    channel = grpc.insecure_channel(srv.address)
    health = health_pb2_grpc.HealthStub(channel)
    long_name = health.Watch(health_pb2.HealthCheckRequest(service="x" * 200_000), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        next(long_name)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    watches = [health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30) for _ in range(most)]
    try:
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        one_more = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            next(one_more)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watches.pop().cancel()  # a slot comes back when a watch ends
        assert wait_until(lambda: _watch_status(health) == health_pb2.HealthCheckResponse.SERVING, 10)

        # The others still hear of a change (gRPC's own Watch forgot them once one left).
        async def not_ready() -> bool:
            return False

        srv.server.store.ready = not_ready  # type: ignore[method-assign]
        assert next(watches[0]).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()


def test_reflection_streams_are_bounded_for_clients_without_the_token(monkeypatch):
    """Reflection needs no token (grpcurl has none), and its streams were
    unbounded: a stranger could open any number and keep them for good. Now
    at most 64 at once, and one that asks nothing for REFLECTION_IDLE_S ends."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kvx.metadata import service as service_module

    monkeypatch.setattr(service_module, "REFLECTION_IDLE_S", 2.0)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    quiet, release = threading.Event(), threading.Event()

    def chatty_then_silent():
        yield ask
        while not quiet.wait(0.3):  # asks again and again: never idle ...
            yield ask
        release.wait(30)  # ... until quiet, then asks nothing and keeps the stream open

    with ThreadedServer(MetadataServer("127.0.0.1:0", token="s3cret-token-for-the-test")) as srv:
        channel = grpc.insecure_channel(srv.address)
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        most = service_module.MAX_REFLECTION_STREAMS
        streams = [reflect.ServerReflectionInfo(chatty_then_silent(), timeout=60) for _ in range(most)]
        try:
            for stream in streams:
                assert next(stream).list_services_response.service
            one_more = reflect.ServerReflectionInfo(iter([ask]), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                next(one_more)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            quiet.set()
            for stream in streams:  # each ends by itself, OK, once it has been idle for 2 s
                for _ in stream:
                    pass
                assert stream.code() == grpc.StatusCode.OK
            fresh = reflect.ServerReflectionInfo(iter([ask]), timeout=10)
            assert "kvx.v1.MetadataService" in [s.name for s in next(fresh).list_services_response.service]
        finally:
            quiet.set()
            release.set()
            for stream in streams:
                stream.cancel()
            channel.close()


def test_a_reflection_stream_whose_client_takes_no_answer_keeps_only_its_slot(monkeypatch):
    """A client that asks and asks but reads nothing: gRPC's servicer waits on
    a write that flow control holds back, so the idle bound does not end it.
    What it holds is its slot (and what gRPC buffers for it, at most its
    flow-control window) until its call ends; then the slot comes back."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kvx.metadata import service as service_module

    monkeypatch.setattr(service_module, "REFLECTION_IDLE_S", 1.0)
    monkeypatch.setattr(service_module, "MAX_REFLECTION_STREAMS", 1)
    big = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvx.v1.MetadataService")
    ask = reflection_pb2.ServerReflectionRequest(list_services="")

    def fresh_stream_code(reflect) -> grpc.StatusCode:
        call = reflect.ServerReflectionInfo(iter([ask]), timeout=10)
        try:
            next(call)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()
        finally:
            call.cancel()  # its slot back at once

    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        flood_channel, channel = grpc.insecure_channel(srv.address), grpc.insecure_channel(srv.address)
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            # Megabytes of answers that are never read: the server's writes stall.
            flood = reflection_pb2_grpc.ServerReflectionStub(flood_channel).ServerReflectionInfo(
                iter([big] * 5000), timeout=60
            )
            next(flood)  # it holds the slot; it reads nothing more
            assert wait_until(lambda: fresh_stream_code(reflect) == grpc.StatusCode.RESOURCE_EXHAUSTED, 10)
            time.sleep(2.5)  # past REFLECTION_IDLE_S: it lives on, and holds its slot
            assert fresh_stream_code(reflect) == grpc.StatusCode.RESOURCE_EXHAUSTED
            flood.cancel()  # the call ends: its slot comes back
            assert wait_until(lambda: fresh_stream_code(reflect) == grpc.StatusCode.OK, 10)
        finally:
            flood_channel.close()
            channel.close()


def _watch_status(health) -> int | None:
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    try:
        return next(watch).status
    except grpc.RpcError:
        return None
    finally:
        watch.cancel()


def test_agents_register_resolve_and_follow_restarts(service):
    with (
        kvx.Agent("prefill-0", metadata=service.address, role="prefill", labels={"model": "tiny"}) as prefill,
        kvx.Agent("decode-0", metadata=service.address, role="decode") as decode,
    ):
        pool = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
        prefill.register(pool)
        local = np.zeros(4096, np.uint8)
        region = decode.register(local)
        peer = decode.connect("prefill-0")
        peer.read(region.descs(0, 4096), peer.regions[0].descs(0, 4096)).wait(5)
        assert local.tobytes() == pool[:4096].tobytes()
        assert decode.connect("prefill-0") is peer  # cached
        extra = prefill.register(np.full(4096, 9, np.uint8))  # a new region: resolved again, same peer
        assert _until(lambda: len(decode.connect("prefill-0").regions) == 2, 5)
        assert decode.connect("prefill-0") is peer and peer.region(extra.id)
        rec = MetadataClient(service.address).get("prefill-0")
        assert (
            rec.role == metadata_pb2.ROLE_PREFILL
            and rec.labels["model"] == "tiny"
            and rec.started_unix_ms > 0
        )
        with pytest.raises(kvx.ConnectError, match="no agent named 'nobody'"):
            decode.connect("nobody")

        prefill.close()  # unregisters
        assert MetadataClient(service.address).get("prefill-0") is None
        with kvx.Agent("prefill-0", metadata=service.address, role="prefill") as reborn:
            reborn.register(np.full(4096, 5, np.uint8))
            assert _until(lambda: not peer.alive, 5), "the old peer should be closed by the watch"
            peer2 = decode.connect("prefill-0")
            assert peer2.epoch == reborn.epoch != peer.epoch
            peer2.read(region.descs(0, 4096), peer2.regions[0].descs(0, 4096)).wait(5)
            assert (local == 5).all()


def test_agents_come_back_after_the_service_restarts():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    opts = kvx.MetadataOptions(lease_ttl_s=3)
    agents = [kvx.Agent(f"a{i}", metadata=address, metadata_options=opts) for i in range(3)]
    try:
        server.stop()
        time.sleep(0.5)
        server = ThreadedServer(MetadataServer(address))  # same port, empty memory store
        client = MetadataClient(address)
        start = time.monotonic()
        assert _until(lambda: len(client.list()) == 3, 10)
        assert time.monotonic() - start < 5
        assert agents[0].connect("a1").epoch == agents[1].epoch
    finally:
        for agent in agents:
            agent.close()
        server.stop()


def test_a_dead_agent_process_disappears_when_its_lease_expires(service, make_worker):
    worker = make_worker("prefill-w", metadata=service.address, role="prefill", lease_ttl_s=2)
    client = MetadataClient(service.address)
    assert client.get("prefill-w") is not None
    worker.kill()
    assert _until(lambda: client.get("prefill-w") is None, 6)


def test_unreachable_service_is_a_clear_error():
    with pytest.raises(kvx.ConnectError, match="unavailable"):
        kvx.Agent("lonely", metadata="127.0.0.1:9", metadata_options=kvx.MetadataOptions(timeout_s=1))


def test_token_is_required_when_configured():
    with ThreadedServer(MetadataServer("127.0.0.1:0", token="grpc-token-0123456789")) as srv:
        code, details = _code(lambda: _stub(srv.address).ListAgents(metadata_pb2.ListAgentsRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        with pytest.raises(kvx.MetadataError, match="token"):
            kvx.Agent("no-token", metadata=srv.address)
        opts = kvx.MetadataOptions(token="grpc-token-0123456789")
        with kvx.Agent("with-token", metadata=srv.address, metadata_options=opts):
            assert [r.name for r in MetadataClient(srv.address, opts).list()] == ["with-token"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvx-test-ca",
    )
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return d


def test_tls_with_client_certificates(pki):
    tls = TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), client_ca=str(pki / "ca.pem"))
    with ThreadedServer(MetadataServer("127.0.0.1:0", tls=tls)) as srv:
        address = srv.address.replace("127.0.0.1", "localhost")
        good = kvx.MetadataOptions(
            tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key")
        )
        with kvx.Agent("secure", metadata=address, metadata_options=good):
            assert [r.name for r in MetadataClient(address, good).list()] == ["secure"]
        no_cert = kvx.MetadataOptions(tls_ca=str(pki / "ca.pem"), timeout_s=2)
        with pytest.raises((kvx.ConnectError, kvx.MetadataError)):
            MetadataClient(address, no_cert).list()
        with pytest.raises(kvx.ConnectError):  # plaintext against TLS
            MetadataClient(srv.address, kvx.MetadataOptions(timeout_s=2)).list()


def test_concurrent_registrations_of_one_name_leave_one_winner(service):
    stub = _stub(service.address)
    results = []

    def register(epoch):
        try:
            stub.RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=_record("race", epoch=epoch, started=epoch))
            )
            results.append(epoch)
        except grpc.RpcError as exc:
            results.append(exc.code())

    threads = [threading.Thread(target=register, args=(e,)) for e in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 8, "a registration did not return"
    # Whatever the order, the first write holds the name and every other registration is
    # refused as one without the live lease: a later start time wins nothing (that rule
    # let anyone take a live name). None runs out of retries: a lost race is a refusal.
    winners = [r for r in results if not isinstance(r, grpc.StatusCode)]
    assert len(winners) == 1, results
    assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="race")).record.epoch == winners[0]
    refused = [r for r in results if isinstance(r, grpc.StatusCode)]
    assert set(refused) == {grpc.StatusCode.FAILED_PRECONDITION}, results  # held, never ABORTED
    assert len(stub.ListAgents(metadata_pb2.ListAgentsRequest()).records) == 1


def test_service_limits_are_configurable():
    limits = ServiceLimits(max_regions=2)
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        rec = _record("r")
        for i in range(3):
            rec.metadata.regions.add(id=i + 1, size_bytes=1)
        code, _ = _code(
            lambda: _stub(srv.address).RegisterAgent(metadata_pb2.RegisterAgentRequest(record=rec))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT


# Regressions from review.


def test_filtered_watch_sees_a_record_leave_its_view(service):
    stub = _stub(service.address)
    lease = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("a", epoch=1, started=1, model="x"))
    ).lease_id
    stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(labels={"model": "x"}), timeout=10)
    assert [next(stream).type, next(stream).type] == [Event.EVENT_TYPE_PUT, Event.EVENT_TYPE_SYNCED]
    # "a" registers again (its lease in hand) with another model: for this watcher it is gone.
    stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("a", epoch=2, started=2, model="y"), lease_id=lease)
    )
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("b", epoch=1, started=1, model="x")))
    event = next(stream)
    assert (event.type, event.record.name) == (Event.EVENT_TYPE_DELETE, "a")
    event = next(stream)
    assert (event.type, event.record.name) == (Event.EVENT_TYPE_PUT, "b")
    stream.cancel()


def test_lease_ids_are_not_reused_after_a_restart():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    old = MetadataClient(address).register(_record("x"), ttl_s=30).lease_id
    server.stop()
    server = ThreadedServer(MetadataServer(address))
    try:
        MetadataClient(address).register(_record("y"), ttl_s=30)
        reply = next(_stub(address).KeepAlive(iter([metadata_pb2.KeepAliveRequest(lease_id=old)]), timeout=5))
        assert reply.ttl_s == 0  # the old id names nothing on the new service
    finally:
        server.stop()


def test_a_registration_the_service_refuses_is_rolled_back():
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", limits=ServiceLimits(max_regions=1))) as srv,
        kvx.Agent("small", metadata=srv.address) as agent,
    ):
        agent.register(np.zeros(64, np.uint8))
        with pytest.raises(kvx.MetadataError, match="at most 1"):
            agent.register(np.zeros(64, np.uint8))
        assert len(agent.regions) == 1
        assert len(MetadataClient(srv.address).get("small").metadata.regions) == 1


def test_registering_memory_does_not_block_while_the_service_is_down():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    with kvx.Agent("patient", metadata=address, metadata_options=kvx.MetadataOptions(lease_ttl_s=3)) as agent:
        server.stop()
        assert _until(lambda: agent._directory.registration.unconfirmed, 10)  # its renewals fail
        start = time.monotonic()
        agent.register(np.zeros(64, np.uint8))
        assert time.monotonic() - start < 0.5
        server = ThreadedServer(MetadataServer(address))
        try:

            def published():
                record = MetadataClient(address).get("patient")
                return record is not None and len(record.metadata.regions) == 1

            assert _until(published, 10)
        finally:
            server.stop()


def test_tls_key_without_certificate_is_a_config_error():
    with pytest.raises(kvx.ConfigError, match="go together"):
        MetadataClient("127.0.0.1:1", kvx.MetadataOptions(tls_key="/tmp/key.pem"))


# Bounds: watch streams, agents, list pages; malformed input.


def _rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _big_record(name, epoch, kib=16):
    record = _record(name, epoch=epoch, started=1)
    for i in range(kib // 4):
        record.engine_info[f"k{i}"] = "x" * 4000
    return record


def test_unread_watch_streams_do_not_pin_copies_of_the_registry(tmp_path):
    """The review's attack, smaller: 20 WatchAgents streams that are never read, against
    a registry of about 31 MB. Each used to pin a whole copy (about 800 MB in all); the
    snapshot now goes out a page at a time, so each holds one page and its transport window."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    command = [sys.executable, "-m", "kvx", "--log-level", "WARNING", "metadata", "--listen", address]
    with open(tmp_path / "service.log", "wb") as log:
        proc = subprocess.Popen(command + ["--admin-listen", "off"], stdout=log, stderr=subprocess.STDOUT)
    channels = []
    try:
        stub = _stub(address)
        assert wait_until(
            lambda: stub.ListAgents(metadata_pb2.ListAgentsRequest(), timeout=1) is not None,
            30,
            (grpc.RpcError,),
        ), (tmp_path / "service.log").read_text()
        for i in range(2000):
            stub.RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=_big_record(f"a{i:05d}", i + 1), ttl_s=300),
                timeout=10,
            )
        time.sleep(1)
        before = _rss_bytes(proc.pid)
        for _ in range(20):
            channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            channels.append(channel)
            metadata_pb2_grpc.MetadataServiceStub(channel).WatchAgents(
                metadata_pb2.WatchAgentsRequest(), timeout=60
            )
        time.sleep(5)  # the service sends what the transport takes, then waits
        growth_mib = (_rss_bytes(proc.pid) - before) / 2**20
        assert growth_mib < 250, f"20 unread watches grew the service by {growth_mib:.0f} MiB"
        assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="a00001"), timeout=5).record.epoch == 2
    finally:
        for channel in channels:
            channel.close()
        proc.terminate()
        proc.wait(10)


def test_watch_streams_are_capped():
    limits = ServiceLimits(max_watch_streams=2)
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        stub = _stub(srv.address)
        open_streams = [stub.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30) for _ in range(2)]
        for stream in open_streams:
            assert next(stream).type == Event.EVENT_TYPE_SYNCED
        error = _refused(lambda: next(stub.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=10)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-watch-streams" in error.details()
        open_streams.pop().cancel()
        assert _until(lambda: srv.server.servicer.watch_streams == 1, 5)
        stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30)
        assert next(stream).type == Event.EVENT_TYPE_SYNCED
        stream.cancel()
        open_streams[0].cancel()


def test_a_watcher_that_falls_behind_is_cut_off(monkeypatch):
    """A watcher that stops reading while changes keep coming is closed with
    RESOURCE_EXHAUSTED once its queue is full and the latest changes of its names
    kept past it reach their bound (here 4 MiB of records), instead of buffering
    every change."""
    monkeypatch.setattr(store_module, "COALESCE_BYTES_MAX", 4 << 20)
    limits = ServiceLimits(watch_queue_events=20)
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        stub = _stub(srv.address)
        stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=60)
        assert next(stream).type == Event.EVENT_TYPE_SYNCED
        # About 400 changes of 64 KiB: far more than the transport window and the queue hold.
        for i in range(400):
            stub.RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=_big_record(f"w{i:04d}", i + 1, kib=64)), timeout=10
            )
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "changes behind" in info.value.details() and "cut off" in info.value.details()
        assert _until(lambda: srv.server.servicer.watch_streams == 0, 5)
        # A new watch starts from the current records.
        fresh = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30)
        names = [event.record.name for event in itertools.islice(fresh, 400)]
        assert names == [f"w{i:04d}" for i in range(400)]
        fresh.cancel()


def test_the_number_of_agents_is_capped(service):
    limits = ServiceLimits(max_agents=3)
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        stub = _stub(srv.address)
        leases = [
            stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(f"n{i}"))).lease_id
            for i in range(3)
        ]
        error = _refused(lambda: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("n3"))))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-agents" in error.details()
        # A registered agent still refreshes, and a freed slot is taken.
        stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_record("n0", zone="a"), lease_id=leases[0])
        )
        stub.UnregisterAgent(metadata_pb2.UnregisterAgentRequest(name="n1", lease_id=leases[1]))
        stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("n3")))
        assert [r.name for r in stub.ListAgents(metadata_pb2.ListAgentsRequest()).records] == [
            "n0",
            "n2",
            "n3",
        ]


def test_garbage_bytes_get_invalid_argument(service):
    channel = grpc.insecure_channel(service.address)
    garbage = b"\xff\xff\xff\xff\x0f"
    for method in ("RegisterAgent", "UnregisterAgent", "GetAgent", "ListAgents"):
        call = channel.unary_unary(f"/kvx.v1.MetadataService/{method}")
        error = _refused(lambda call=call: call(garbage, timeout=5))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in error.details(), method
    watch = channel.unary_stream("/kvx.v1.MetadataService/WatchAgents")
    error = _refused(lambda: next(watch(garbage, timeout=5)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    keep_alive = channel.stream_stream("/kvx.v1.MetadataService/KeepAlive")
    error = _refused(lambda: next(keep_alive(iter([garbage]), timeout=5)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not _stub(service.address).ListAgents(metadata_pb2.ListAgentsRequest()).records


def test_names_with_a_newline_or_a_slash_are_refused(service):
    stub = _stub(service.address)
    for name in ("p\n", "p/0", "p\r", "\u0661"):  # the last: an Arabic-Indic digit one
        error = _refused(
            lambda name=name: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(name)))
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid agent name" in error.details()
    with pytest.raises(kvx.ConfigError, match="invalid agent name"):
        kvx.Agent("decode\n")
    # What the connectors build stays valid.
    for name in ("vllm-0b6c2d4e-1f2a-4c3b-9d8e-7f6a5b4c3d2e-tp0", "sglang-prefill-1234-r0"):
        stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(name)))


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "{ca}"], "--tls-cert and --tls-key go together"),
        (["--admin-reads-need-token"], "--admin-reads-need-token needs --admin-token-file"),
        (["--token-file", "{token}", "--admin-token-file", "{token}"], "the same token"),
    ],
)
def test_weak_security_flag_combinations_refuse_to_start(tmp_path, flags, words):
    (tmp_path / "ca.pem").write_text("not used\n")
    (tmp_path / "token").write_text("a-token-of-24-characters\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    flags = [f.format(ca=tmp_path / "ca.pem", token=tmp_path / "token") for f in flags]
    result = subprocess.run(
        [sys.executable, "-m", "kvx", "metadata", "--listen", address, "--admin-listen", "off", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and words in result.stderr, result.stderr
    with pytest.raises(kvx.ConnectError):  # nothing was served, plaintext or not
        MetadataClient(address, kvx.MetadataOptions(timeout_s=1)).list()


def test_tls_config_without_a_certificate_is_refused(pki):
    with pytest.raises(kvx.ConfigError, match="plaintext"):
        TlsConfig("", "", client_ca=str(pki / "ca.pem"))


def test_a_names_watch_sees_only_those_names(service):
    stub = _stub(service.address)
    leases = {}
    for name in ("a", "b", "c"):
        leases[name] = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(name))).lease_id
    request = metadata_pb2.WatchAgentsRequest(names=["a", "c", "later", "a"])
    stream = stub.WatchAgents(request, timeout=30)
    snapshot = [next(stream) for _ in range(3)]
    assert [(e.type, e.record.name) for e in snapshot] == [
        (Event.EVENT_TYPE_PUT, "a"),
        (Event.EVENT_TYPE_PUT, "c"),
        (Event.EVENT_TYPE_SYNCED, ""),
    ]
    assert all(e.record.lease_id == 0 for e in snapshot)
    stub.UnregisterAgent(metadata_pb2.UnregisterAgentRequest(name="b", lease_id=leases["b"]))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("unwatched")))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("later", epoch=9)))
    stub.UnregisterAgent(metadata_pb2.UnregisterAgentRequest(name="a", lease_id=leases["a"]))
    leases["c"] = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("c", epoch=8), lease_id=leases["c"])
    ).lease_id
    later = [next(stream) for _ in range(3)]
    assert [(e.type, e.record.name, e.record.epoch) for e in later] == [
        (Event.EVENT_TYPE_PUT, "later", 9),
        (Event.EVENT_TYPE_DELETE, "a", 7),
        (Event.EVENT_TYPE_PUT, "c", 8),
    ]
    assert all(e.record.lease_id == 0 for e in later)
    stream.cancel()
    # Role and labels filter on top of the names.
    stream = stub.WatchAgents(
        metadata_pb2.WatchAgentsRequest(names=["c", "later"], labels={"zone": "x"}), timeout=30
    )
    assert next(stream).type == Event.EVENT_TYPE_SYNCED
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("d", zone="x")))
    stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("c", epoch=8, zone="x"), lease_id=leases["c"])
    )
    event = next(stream)
    assert (event.type, event.record.name) == (Event.EVENT_TYPE_PUT, "c")
    stream.cancel()


def test_a_watch_of_too_many_or_invalid_names_is_refused(service):
    stub = _stub(service.address)
    for names, words in (
        ([f"n{i}" for i in range(4097)], "4097 names to watch; at most 4096"),
        (["ok", ""], "invalid agent name ''"),
        (["ok", "a/b"], "invalid agent name 'a/b'"),
    ):
        request = metadata_pb2.WatchAgentsRequest(names=names)
        code, details = _code(lambda r=request: next(stub.WatchAgents(r, timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (code, details)
    assert _until(lambda: service.server.servicer.watch_streams == 0, 5)
    stream = stub.WatchAgents(
        metadata_pb2.WatchAgentsRequest(names=[f"n{i}" for i in range(4096)]), timeout=10
    )
    assert next(stream).type == Event.EVENT_TYPE_SYNCED
    stream.cancel()


class _WatchSpy:
    """Records the names of every store watch the service opens; ``hold`` makes the
    next watch naming that agent wait (the old watch already gone) until ``release``."""

    def __init__(self, store):
        self.store, self.watch = store, store.watch_batches
        self.names: list[frozenset[str] | None] = []
        self.hold: str | None = None
        self.held, self.release = threading.Event(), threading.Event()
        store.watch_batches = self._watch

    async def _watch(self, queue_size, names=None, max_events=1, max_bytes=None):
        self.names.append(None if names is None else frozenset(names))
        if self.hold is not None and names is not None and self.hold in names:
            self.hold = None
            self.held.set()
            for _ in range(300):
                if self.release.is_set():
                    break
                await asyncio.sleep(0.1)
        async for batch in self.watch(queue_size, names, max_events, max_bytes):
            yield batch


def _prefill(name, address):
    agent = kvx.Agent(name, metadata=address, role="prefill")
    agent.register(np.full(4096, 3, np.uint8))
    return agent


def test_an_agent_watches_only_the_peers_it_resolved(service):
    spy = _WatchSpy(service.server.store)
    p0, p1 = _prefill("prefill-0", service.address), _prefill("prefill-1", service.address)
    _prefill("bystander", service.address).close()
    with p0, p1, kvx.Agent("decode-0", metadata=service.address, role="decode") as decode:
        assert decode.connect("prefill-0").epoch == p0.epoch
        assert spy.names == [frozenset({"prefill-0"})]
        assert decode.connect("prefill-1").epoch == p1.epoch
        assert decode.connect("prefill-0").epoch == p0.epoch  # already watched: no new watch
        assert spy.names == [frozenset({"prefill-0"}), frozenset({"prefill-0", "prefill-1"})]
        assert _until(lambda: service.server.servicer.watch_streams == 1, 5)  # the first one ended


@pytest.mark.parametrize("change", ["restart", "evicted"])
def test_a_peer_that_changes_while_the_watch_restarts_is_not_served_stale(service, change):
    """prefill-0's record goes (its lease revoked; its process and decode-0's
    connection to it live on) and, for "restart", a new epoch registers the
    name, after decode-0's watch of it has ended and before the new watch (of
    prefill-0 and prefill-1) has read its snapshot. That snapshot must tell
    decode-0, which saw no event of the change."""
    spy = _WatchSpy(service.server.store)
    store = service.server.store
    gets: list[str] = []  # GetAgent lookups that reached the store
    get, get_answer = store.get, store.get_answer
    store.get_answer = lambda name: (gets.append(name), get_answer(name))[1]
    p0, p1 = _prefill("prefill-0", service.address), _prefill("prefill-1", service.address)
    with p0, p1, kvx.Agent("decode-0", metadata=service.address, role="decode") as decode:
        old = decode.connect("prefill-0")
        assert old.epoch == p0.epoch
        spy.hold = "prefill-1"
        resolving = threading.Thread(target=decode.connect, args=("prefill-1",), daemon=True)
        resolving.start()
        assert spy.held.wait(10), "decode-0 should restart its watch for prefill-1"
        lease_id = service.call(get("prefill-0")).lease_id
        service.call(store.revoke_lease(lease_id))  # a DELETE no watch of decode-0 sees
        reborn = _prefill("prefill-0", service.address) if change == "restart" else None
        try:
            spy.release.set()
            resolving.join(20)
            assert not resolving.is_alive()
            if reborn is not None:
                assert _until(lambda: not old.alive, 5), "the old peer should be closed"
                assert decode.connect("prefill-0").epoch == reborn.epoch != old.epoch
            else:
                del gets[:]
                with contextlib.suppress(kvx.ConnectError):  # absent, or back already
                    decode.connect("prefill-0")
                assert gets == ["prefill-0"], "prefill-0 was served from the cache"
        finally:
            if reborn is not None:
                reborn.close()
