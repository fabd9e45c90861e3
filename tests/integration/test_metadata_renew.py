"""Lease renewals at scale: batched KeepAlive requests on the real service over
loopback gRPC, the registrations of one process sharing one stream, and
MemoryStore expiry that does not scan every lease."""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import types

import grpc
import pytest

from kvx.metadata import store as store_module
from kvx.metadata.client import MetadataClient, MetadataOptions, Registration, _Renewer
from kvx.metadata.service import MAX_KEEP_ALIVE_LEASES, MetadataServer, ServiceLimits, ThreadedServer
from kvx.metadata.store import MemoryStore
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

_record = functools.partial(agent_record, role=metadata_pb2.ROLE_DECODE)
_stub = stub

TOKEN = "renew-token-0123456789"
UNKNOWN = 0x1234_5678_9ABC_DEF1  # odd and 62-bit like real ids, but granted to nobody


def _metric(srv, name):
    return srv.server.metrics.registry.get_sample_value(f"kvx_metadata_{name}_total") or 0


def _register(srv, name, ttl_s=10, metadata=None):
    request = metadata_pb2.RegisterAgentRequest(record=_record(name), ttl_s=ttl_s)
    return _stub(srv.address).RegisterAgent(request, timeout=10, metadata=metadata).lease_id


def _keep_alive(srv, lease_id=0, lease_ids=(), metadata=None):
    request = metadata_pb2.KeepAliveRequest(lease_id=lease_id, lease_ids=list(lease_ids))
    return next(_stub(srv.address).KeepAlive(iter([request]), timeout=10, metadata=metadata))


class _Stream:
    """A KeepAlive stream fed one request at a time (every wait bounded)."""

    def __init__(self, address):
        self._requests: queue.Queue = queue.Queue(maxsize=16)
        self._closed = threading.Event()
        self._call = _stub(address).KeepAlive(self._feed(), timeout=60)

    def _feed(self):
        while not self._closed.is_set():
            try:
                yield self._requests.get(timeout=0.5)
            except queue.Empty:
                continue

    def ask(self, **fields):
        self._requests.put(metadata_pb2.KeepAliveRequest(**fields), timeout=5)
        return next(self._call)

    def close(self):
        self._closed.set()
        self._call.cancel()


def test_a_batch_renews_every_lease_and_answers_unknown_ids_with_zero(service):
    leases = [_register(service, f"b{i}") for i in range(3)]
    renewals_before = _metric(service, "lease_renewals")
    answer = _keep_alive(service, leases[0], [leases[1], UNKNOWN, leases[2]])
    assert answer.lease_id == leases[0] and answer.ttl_s == 10
    assert list(answer.ttls_s) == [10, 0, 10]
    only_batch = _keep_alive(service, 0, [UNKNOWN, leases[2]])
    assert (only_batch.lease_id, only_batch.ttl_s, list(only_batch.ttls_s)) == (0, 0, [0, 10])
    assert _metric(service, "lease_renewals") - renewals_before == 4
    # The single-lease form answers as before, without ttls_s.
    single = _keep_alive(service, leases[1])
    assert (single.ttl_s, list(single.ttls_s)) == (10, [])


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"lease_ids": [3] * (MAX_KEEP_ALIVE_LEASES + 1)}, "at most 1024"),
        ({"lease_id": 3, "lease_ids": [3] * MAX_KEEP_ALIVE_LEASES}, "at most 1024"),
        ({"lease_ids": [3, 0, 5]}, "<= 0"),
        ({"lease_id": 3, "lease_ids": [-7]}, "<= 0"),
    ],
)
def test_oversized_and_malformed_batches_are_refused_alone(service, fields, words):
    lease = _register(service, "steady")
    steady = _Stream(service.address)
    try:
        assert steady.ask(lease_id=lease).ttl_s == 10
        renewals = _metric(service, "lease_renewals")
        with pytest.raises(grpc.RpcError) as info:
            _keep_alive(service, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details()
        assert _metric(service, "lease_renewals") == renewals  # the refused batch renewed nothing
        # The other stream goes on, and a full batch of 1,024 is still served.
        assert steady.ask(lease_id=lease, lease_ids=[lease]).ttls_s == [10]
        full = _keep_alive(service, lease, [UNKNOWN] * (MAX_KEEP_ALIVE_LEASES - 1))
        assert full.ttl_s == 10 and len(full.ttls_s) == MAX_KEEP_ALIVE_LEASES - 1
    finally:
        steady.close()


def test_an_unauthenticated_stream_renews_nothing():
    limits = ServiceLimits(min_ttl_s=2)
    with ThreadedServer(MetadataServer("127.0.0.1:0", token=TOKEN, limits=limits)) as srv:
        auth = [("authorization", f"Bearer {TOKEN}")]
        lease = _register(srv, "guarded", ttl_s=2, metadata=auth)
        for metadata in (None, [("authorization", "Bearer wrong-token-0123456789")]):
            with pytest.raises(grpc.RpcError) as info:
                _keep_alive(srv, lease, [lease] * 8, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _metric(srv, "lease_renewals") == 0 and _metric(srv, "keep_alive_messages") == 0
        # Nobody renewed it: the lease runs out.
        assert wait_until(lambda: srv.call(srv.server.store.lease_ttl(lease)) == 0, 15)
        assert _keep_alive(srv, 0, [lease], metadata=auth).ttls_s == [0]


def test_a_batch_tells_no_more_about_other_leases_than_single_renewals(service):
    """Per id a batch answers what a single renewal of that id answers (its ttl, or
    0): lease ids are 62 random bits, so 1,024 guesses a message learn nothing."""
    theirs = _register(service, "someone-else")
    guesses = [theirs, UNKNOWN, UNKNOWN + 2, 1, 2**62 + 1]
    batched = list(_keep_alive(service, 0, guesses).ttls_s)
    assert batched == [_keep_alive(service, guess).ttl_s for guess in guesses] == [10, 0, 0, 0, 0]


def _registrations(srv, names, ttl_s):
    opts = MetadataOptions(lease_ttl_s=ttl_s)
    # A client each, as each agent's Directory makes its own; same target and options.
    regs = [Registration(MetadataClient(srv.address, opts), lambda n=name: _record(n)) for name in names]
    for reg in regs:
        reg.start()
    return regs


def _stop_all(regs):
    for reg in regs:
        reg.stop()
        reg.client.close()


def _limits():
    return ServiceLimits(min_ttl_s=2, default_ttl_s=3)


def test_registrations_of_one_process_share_one_stream_and_one_message():
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=_limits())) as srv:
        regs = _registrations(srv, ["share-a", "share-b", "share-c"], ttl_s=3)
        assert wait_until(lambda: all(reg._renewer is not None for reg in regs), 10)
        renewer = regs[0]._renewer
        assert all(reg._renewer is renewer for reg in regs)
        try:
            assert wait_until(lambda: _metric(srv, "lease_renewals") >= 12, 20)
            renewals, messages = _metric(srv, "lease_renewals"), _metric(srv, "keep_alive_messages")
            assert _metric(srv, "keep_alive_streams") == 1
            # Each message carries every lease but those of the first rounds (the
            # registrations joined one after another): about a third as many messages.
            assert messages <= renewals / 3 + 2, (messages, renewals)
        finally:
            _stop_all(regs)
        # The last stop() ends the shared renewer: no thread or stream is left behind.
        assert not any(target == srv.address for target, _ in _Renewer._registry)
        renewer._thread.join(10)
        assert not renewer._thread.is_alive()


def test_a_lost_lease_makes_only_its_registration_register_again():
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=_limits())) as srv:
        a, b = regs = _registrations(srv, ["lost-a", "kept-b"], ttl_s=3)
        try:
            lease_a, lease_b = a.lease_id, b.lease_id
            assert _metric(srv, "registrations") == 2
            srv.call(srv.server.store.revoke_lease(lease_a))  # as an eviction does
            assert wait_until(lambda: a.lease_id not in (None, lease_a), 20), "a did not register again"
            assert wait_until(lambda: MetadataClient(srv.address).get("lost-a") is not None, 10)
            assert b.lease_id == lease_b and _metric(srv, "registrations") == 3
            # stop() of one leaves the other renewing on the same stream.
            a.stop()
            renewals = _metric(srv, "lease_renewals")
            assert wait_until(lambda: _metric(srv, "lease_renewals") >= renewals + 3, 20)
            assert b.lease_id == lease_b and srv.call(srv.server.store.lease_ttl(lease_b)) > 0
            assert MetadataClient(srv.address).get("lost-a") is None  # a unregistered
            assert _metric(srv, "keep_alive_streams") == 1
        finally:
            _stop_all(regs)


def test_an_older_service_without_batches_gets_one_lease_per_message():
    server = MetadataServer("127.0.0.1:0", limits=_limits())
    servicer = server.servicer

    async def single_only(request):  # what a service older than lease_ids answers
        ttl = await servicer.store.keep_alive(request.lease_id)
        servicer.metrics.lease_renewals.inc(ttl > 0)
        return metadata_pb2.KeepAliveResponse(lease_id=request.lease_id, ttl_s=ttl)

    servicer.keep_alive = single_only
    with ThreadedServer(server) as srv:
        regs = _registrations(srv, ["old-a", "old-b", "old-c"], ttl_s=2)
        try:
            leases = [reg.lease_id for reg in regs]
            assert wait_until(lambda: _metric(srv, "lease_renewals") >= 15, 25)
            # Nothing was lost (no registration again) and every lease still lives.
            assert [reg.lease_id for reg in regs] == leases and _metric(srv, "registrations") == 3
            assert all(srv.call(srv.server.store.lease_ttl(lease)) > 0 for lease in leases)
        finally:
            _stop_all(regs)


def test_more_leases_than_one_message_takes_are_split(service):
    count = MAX_KEEP_ALIVE_LEASES + 76
    stub = _stub(service.address)
    # 30 s at the service: registering them takes seconds on a loaded host, and a lease of
    # 2 s could expire before its first renewal. The renewer is told 2 s below, so it renews
    # every 2/3 s all the same. A hundred registrations are in flight at a time.
    leases = []
    for first in range(0, count, 100):
        calls = [
            stub.RegisterAgent.future(
                metadata_pb2.RegisterAgentRequest(record=_record(f"m{i}"), ttl_s=30), timeout=30
            )
            for i in range(first, min(first + 100, count))
        ]
        leases += [call.result().lease_id for call in calls]
    client = MetadataClient(service.address, MetadataOptions(lease_ttl_s=2))
    lost: list[int] = []

    class Fake:  # Registration's side of the renewer, without a thread or channel per lease
        def __init__(self, name):
            self.name, self.client, self._stop, self._renewer = name, client, threading.Event(), None

        def _lease_lost(self, lease_id):
            lost.append(lease_id)

    fakes = [Fake(f"m{i}") for i in range(count)]

    try:
        for fake, lease in zip(fakes, leases, strict=True):
            _Renewer.renew(fake, lease, 2)
        assert wait_until(lambda: _metric(service, "lease_renewals") >= 3 * count, 30)
        assert not lost
        messages, renewals = _metric(service, "keep_alive_messages"), _metric(service, "lease_renewals")
        assert messages <= 2 * renewals / count + 2  # two messages a round, not one per lease
        assert all(srv_ttl > 0 for srv_ttl in service.call(service.server.store.keep_alive_many(leases)))
    finally:
        for fake in fakes:
            fake._stop.set()
            _Renewer.leave(fake)
        client.close()


# MemoryStore expiry at scale.


def test_memory_expiry_looks_only_at_due_leases(monkeypatch):
    """50,000 leases renewed, five not: only those five expire, and the expiry
    passes look at each renewed lease once per ttl, not at every lease each pass."""
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(store_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))

    async def body():
        store = MemoryStore()  # not started: the test drives the expiry passes itself
        kept = [await store.grant_lease(10) for _ in range(50_000)]
        dropped = [await store.grant_lease(10) for _ in range(5)]
        for lease in kept + dropped:
            assert await store.put_if(_record(f"n{lease:x}"), lease, 0)
        for step in range(1, 100):  # 0.1 s passes up to t+9.9: nothing falls due
            clock.now = 1000.0 + step / 10
            await store._expire_due(clock.now)
            if step == 50:
                assert all(await store.keep_alive_many(kept))
        assert store.expiry_checks == 0
        clock.now = 1010.05
        await store._expire_due(clock.now)
        assert store.expired_leases == 5 and await store.count() == 50_000
        assert [await store.lease_ttl(lease) for lease in dropped] == [0] * 5
        assert store.expiry_checks == 50_005  # each once: the renewed ones pushed back
        for step in range(1, 40):  # four more seconds of passes: nothing due, nothing looked at
            clock.now = 1010.05 + step / 10
            await store._expire_due(clock.now)
        assert store.expiry_checks == 50_005 and await store.count() == 50_000

    asyncio.run(asyncio.wait_for(body(), 60))


def test_memory_expiry_loop_expires_unrenewed_leases_without_a_scan():
    async def body():
        store = MemoryStore(expiry_interval_s=0.05)
        await store.start()
        try:
            long = [await store.grant_lease(120) for _ in range(50_000)]
            short = [await store.grant_lease(1) for _ in range(3)]
            for lease in short:
                assert await store.put_if(_record(f"s{lease:x}"), lease, 0)
            for _ in range(200):  # up to 10 s
                if store.expired_leases == 3:
                    break
                await asyncio.sleep(0.05)
            assert store.expired_leases == 3 and await store.count() == 0
            # Dozens of passes ran over 50,003 leases; they looked at the three due ones.
            assert store.expiry_checks == 3
            assert all(await store.keep_alive_many(long))
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(body(), 60))
