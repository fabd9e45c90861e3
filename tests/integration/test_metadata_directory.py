"""The agent's Directory and watches of names against a real metadata service
(memory store) on loopback: the largest valid watch, a service that refuses
watches of names, the cost of many peers, and what the logs may show."""

import logging
import threading
import types

import numpy as np
import pytest

import kvx
from kvx.metadata import service as service_module
from kvx.metadata.client import MetadataClient, MetadataOptions, Registration, Watcher
from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.metadata.store import StoreError
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

_record, _stub = agent_record, stub

Event = metadata_pb2.WatchAgentsResponse


def _until(predicate, timeout_s=10.0):
    return wait_until(predicate, timeout_s, (kvx.ConnectError,))


def _long_name(i):
    return f"p{i:05d}" + "x" * 122  # 128 characters: the longest valid name


def test_a_watch_of_4096_of_the_longest_names_is_accepted(service):
    stub = _stub(service.address)
    names = [_long_name(i) for i in range(4096)]
    request = metadata_pb2.WatchAgentsRequest(names=names, labels={"k" * 256: "v" * 256})
    assert request.ByteSize() > 256 * 1024 + 64 * 1024  # past the old receive limit
    stream = stub.WatchAgents(request, timeout=30)
    assert next(stream).type == Event.EVENT_TYPE_SYNCED
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(names[-1])))
    stream.cancel()
    # A record near the largest valid one still goes through too.
    big = _record("big")
    for i in range(60):
        big.engine_info[f"blob{i}"] = "x" * 4000
    assert big.ByteSize() > 240_000
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=big))


def test_a_watcher_whose_names_are_too_large_for_the_service_watches_everything(monkeypatch, caplog):
    """A service with a smaller receive limit (an older kvx) refuses the watch of
    names with RESOURCE_EXHAUSTED: the watcher watches every agent instead."""
    monkeypatch.setattr(service_module, "max_receive_bytes", lambda limits: 2048)
    events = []
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        client = MetadataClient(srv.address)
        names = [_long_name(i) for i in range(30)]  # about 4 KB
        watcher = Watcher(client, events.append, names=names)
        try:
            assert watcher.synced.wait(20), "the watch never synced"
            assert watcher.names_refused and not watcher.request.names
            assert "refused a watch of 30 names (StatusCode.RESOURCE_EXHAUSTED" in caplog.text
            _stub(srv.address).RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(names[0])))
            assert _until(lambda: any(e.record.name == names[0] for e in events))
            watcher.watch_names(names[:2])  # still everything: no second refusal
            assert watcher.synced.wait(20) and not watcher.request.names
        finally:
            watcher.stop()
            client.close()


def _prefill(name, address):
    agent = kvx.Agent(name, metadata=address, role="prefill")
    agent.register(np.full(4096, 3, np.uint8))
    return agent


def test_an_agent_whose_names_watch_is_refused_still_sees_a_peer_restart(monkeypatch, caplog):
    """The service takes no names in a watch: decode-0 must not wait for a watch
    that never syncs, and must still learn that prefill-0 restarted."""
    monkeypatch.setattr(service_module, "MAX_WATCH_NAMES", 0)
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        store = srv.server.store
        p0 = _prefill("prefill-0", srv.address)
        with p0, kvx.Agent("decode-0", metadata=srv.address, role="decode") as decode:
            old = decode.connect("prefill-0")
            assert old.epoch == p0.epoch
            watcher = decode._directory._watcher
            assert watcher.synced.is_set() and watcher.names_refused
            assert "refused a watch of 1 names (StatusCode.INVALID_ARGUMENT" in caplog.text
            # prefill-0's record goes and a new epoch registers the name; the old process
            # lives on, so only the watch can tell decode-0.
            lease_id = srv.call(store.get("prefill-0")).lease_id
            srv.call(store.revoke_lease(lease_id))
            with _prefill("prefill-0", srv.address) as reborn:
                assert _until(lambda: not old.alive, 10), "the old peer should be closed"
                assert decode.connect("prefill-0").epoch == reborn.epoch != old.epoch


def _fake_peers(directory):
    """add_peer without connecting: these tests count lookups, not transfers."""

    def add_peer(metadata, streams=None):
        return types.SimpleNamespace(alive=True, epoch=7)

    directory.agent.add_peer = add_peer


def test_resolving_many_peers_costs_one_lookup_each(service):
    """Every new peer restarts the watch; the snapshot of the peers already known
    must not send each of them back to the service."""
    store = service.server.store
    stub = _stub(service.address)
    count = 200
    names = [f"prefill-{i}" for i in range(count)]
    for name in names:
        stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record(name), ttl_s=300))
    lookups = []
    get_answer = store.get_answer
    store.get_answer = lambda name: (lookups.append(name), get_answer(name))[1]
    with kvx.Agent("decode-0", metadata=service.address, role="decode") as decode:
        directory = decode._directory
        _fake_peers(directory)
        peers = {}
        for i, name in enumerate(names):
            peers[name] = directory.resolve(name, None, None)
            for known in names[: i + 1]:  # a router touching every peer it has
                peers[known] = directory.resolve(known, peers[known], None)
        assert len(directory._watcher.request.names) == count
        assert len(lookups) <= count + 10, f"{len(lookups)} lookups for {count} peers"


def test_names_that_no_agent_has_leave_the_watch(service):
    stub = _stub(service.address)
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("real"), ttl_s=300))
    watched = []
    watch = service.server.store.watch_batches

    async def spy(queue_size, names=None, max_events=1, max_bytes=None):
        watched.append(frozenset(names or ()))
        async for batch in watch(queue_size, names, max_events, max_bytes):
            yield batch

    service.server.store.watch_batches = spy
    with kvx.Agent("decode-0", metadata=service.address, role="decode") as decode:
        directory = decode._directory
        _fake_peers(directory)
        for i in range(50):
            with pytest.raises(kvx.ConnectError, match="no agent named"):
                directory.resolve(f"ghost-{i}", None, None)
        directory.resolve("real", None, None)
        assert watched[-1] == {"real"}
        assert set(directory._watcher.request.names) == {"real"}
        assert len(directory._watched) == 1 and not directory._stale


def test_logs_never_show_a_lease_id(service, caplog):
    """Register, renew, a lease revoked under a live registration (renewal
    answered 0), a replaced lease whose revocation fails once, and expiry: the
    logs name agents, never a lease id (it proves a name to the service)."""
    caplog.set_level(logging.DEBUG)
    store = service.server.store
    stub = _stub(service.address)
    leases = []
    client = MetadataClient(service.address, MetadataOptions(lease_ttl_s=3))
    registration = Registration(client, lambda: _record("renewer"))
    try:
        registration.start()
        leases.append(registration.lease_id)
        srv_lease = service.call(store.get("renewer")).lease_id
        service.call(store.revoke_lease(srv_lease))  # its next renewal is answered 0
        assert _until(lambda: registration.lease_id not in (None, srv_lease), 20)
        leases.append(registration.lease_id)
    finally:
        registration.stop(unregister=True)
        client.close()
    # A replaced lease whose revocation fails once.
    first = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("replaced"), ttl_s=300))
    revoke, failed = store.revoke_lease, threading.Event()

    async def flaky_revoke(lease_id):
        if lease_id == first.lease_id and not failed.is_set():
            failed.set()
            raise StoreError("the store is briefly unavailable")
        return await revoke(lease_id)

    store.revoke_lease = flaky_revoke
    second = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("replaced", epoch=8), lease_id=first.lease_id)
    )
    assert _until(lambda: failed.is_set() and service.call(store.lease_ttl(first.lease_id)) == 0, 20)
    # Expiry.
    short = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("expiring"), ttl_s=2))
    assert _until(lambda: service.call(store.get("expiring")) is None, 20)
    leases += [srv_lease, first.lease_id, second.lease_id, short.lease_id]
    text = caplog.text.lower()
    for lease_id in leases:
        assert lease_id
        for shown in (f"{lease_id:#x}", f"{lease_id:x}", str(lease_id)):
            assert shown not in text, f"lease id {shown} is in the logs"
    for line in (
        "the lease of agent renewer is gone",
        "could not revoke the replaced lease of replaced yet",
        "the lease of expiring expired",
    ):
        assert line in caplog.text
