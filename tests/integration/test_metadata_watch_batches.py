"""WatchAgents with several events per message (WatchAgentsRequest.batch_bytes):
on the real service over loopback gRPC, the same events as one per message,
in fewer messages, each within its bound; and what the Watcher and a read
replica do with a service that sends a batch inside a batch."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvx.metadata.client import WATCH_BATCH_BYTES, WATCH_BATCH_EVENTS_MAX, MetadataClient, Watcher
from kvx.metadata.mirror import MirrorStore
from kvx.metadata.service import SERVICE_NAME, WATCH_BATCH_BYTES_MAX, MetadataServer, ThreadedServer
from kvx.metadata.store import MemoryStore
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

Response = metadata_pb2.WatchAgentsResponse
SYNCED = Response.EVENT_TYPE_SYNCED


def _register(address: str, names: list[str], regions: int = 1) -> None:
    for start in range(0, len(names), 50):
        answer = stub(address).RegisterAgents(
            metadata_pb2.RegisterAgentsRequest(
                requests=[
                    metadata_pb2.RegisterAgentRequest(
                        record=agent_record(name, 7, *range(1, regions + 1)), ttl_s=60
                    )
                    for name in names[start : start + 50]
                ]
            ),
            timeout=30,
        )
        assert [r.code for r in answer.results] == [0] * len(answer.results), answer.results[0].message


def _read(call, until, events: list | None = None) -> list[Response]:
    """Messages of ``call`` until ``until(events so far)``; their events go to ``events``."""
    events = [] if events is None else events
    messages = []
    for message in call:
        messages.append(message)
        events.extend(message.events or [message])
        if until(events):
            return messages
    raise AssertionError("the watch ended")


def _synced(events) -> bool:
    return bool(events) and events[-1].type == SYNCED


def _seen(events) -> list[tuple[int, str, int]]:
    return [(e.type, e.record.name, e.revision) for e in events]


def test_a_watch_that_asks_gets_the_same_events_in_fewer_messages(service):
    _register(service.address, [f"agent-{i:03d}" for i in range(300)])
    plain = stub(service.address).WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30)
    batched = stub(service.address).WatchAgents(
        metadata_pb2.WatchAgentsRequest(batch_bytes=WATCH_BATCH_BYTES), timeout=30
    )
    try:
        one, many = [], []
        one_messages = _read(plain, _synced, one)
        many_messages = _read(batched, _synced, many)
        assert len(one) == len(many) == 301 and _seen(one) == _seen(many)
        assert len(one_messages) == 301 and not any(m.events for m in one_messages)  # as ever
        assert len(many_messages) <= 3, len(many_messages)  # pages of the snapshot, together
        assert all(not e.events for e in many)  # never a batch in a batch
        # Changes made faster than the watch sends them come together too: the service
        # makes 8 registrations of a call per turn of its event loop.
        _register(service.address, [f"late-{i:03d}" for i in range(200)])
        one, many = [], []
        one_messages = _read(plain, lambda e: len(e) == 200, one)
        many_messages = _read(batched, lambda e: len(e) == 200, many)
        assert _seen(one) == _seen(many) and [e.record.name for e in many] == [
            f"late-{i:03d}" for i in range(200)
        ]
        assert len(one_messages) == 200 and len(many_messages) <= 100, len(many_messages)
    finally:
        plain.cancel()
        batched.cancel()


def test_each_message_holds_what_the_watch_asked_for_at_most(service):
    names = [f"agent-{i:03d}" for i in range(60)]
    _register(service.address, names)
    _register(service.address, ["big"], regions=800)  # an event of about 8 KiB
    call = stub(service.address).WatchAgents(metadata_pb2.WatchAgentsRequest(batch_bytes=2000), timeout=30)
    try:
        events: list[Response] = []
        messages = _read(call, _synced, events)
        assert sorted(e.record.name for e in events[:-1]) == sorted([*names, "big"])
        for message in messages:
            if message.events:
                assert message.ByteSize() <= 2000 and len(message.events) > 1
            else:  # one event alone: the big one may be past the bound
                assert message.record.name == "big" or message.ByteSize() <= 2000
        big = next(
            m for m in messages if m.record.name == "big" or any(e.record.name == "big" for e in m.events)
        )
        assert big.record.name == "big" and big.ByteSize() > 2000  # it came alone
        assert len(messages) < len(events) / 4
    finally:
        call.cancel()


def test_the_service_caps_what_a_watch_asks_for(service):
    """A watcher cannot make the service build messages of any size it likes."""
    _register(service.address, [f"agent-{i:03d}" for i in range(300)], regions=800)  # about 1.6 MB
    call = stub(service.address).WatchAgents(
        metadata_pb2.WatchAgentsRequest(batch_bytes=2**32 - 1), timeout=30
    )
    try:
        events: list[Response] = []
        messages = _read(call, _synced, events)
        assert len(events) == 301 and sum(m.ByteSize() for m in messages) > WATCH_BATCH_BYTES_MAX
        assert max(m.ByteSize() for m in messages) <= WATCH_BATCH_BYTES_MAX
    finally:
        call.cancel()


def test_a_watcher_passes_on_each_event_of_a_batch(service):
    client = MetadataClient(service.address)
    got: list[Response] = []
    _register(service.address, [f"agent-{i:03d}" for i in range(150)])
    watcher = Watcher(client, got.append)
    try:
        assert watcher.request.batch_bytes == WATCH_BATCH_BYTES
        assert watcher.synced.wait(10)
        assert len(got) == 151 and watcher.snapshot_names == {f"agent-{i:03d}" for i in range(150)}
        _register(service.address, [f"late-{i:03d}" for i in range(100)])
        wait_until(lambda: len(got) == 251, 10, "the changes")
        assert [e.record.name for e in got[151:]] == [f"late-{i:03d}" for i in range(100)]
        assert all(not e.events for e in got)
    finally:
        watcher.stop()
        client.close()


class _Crafted:
    """A MetadataService whose WatchAgents first sends a batch no kvx service sends
    (``bad``: a batch inside a batch, or more events than a batch holds), then (on
    the next call) a good snapshot: what a watcher makes of a broken primary."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        self.requests: list[metadata_pb2.WatchAgentsRequest] = []
        self.times: list[float] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handler = grpc.unary_stream_rpc_method_handler(
            self._watch,
            request_deserializer=metadata_pb2.WatchAgentsRequest.FromString,
            response_serializer=Response.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE_NAME, {"WatchAgents": handler})]
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.done = threading.Event()
        self.server.start()

    def _watch(self, request, context):
        self.requests.append(request)
        self.times.append(time.monotonic())
        put = Response(type=Response.EVENT_TYPE_PUT, record=agent_record("good", 7, 1), revision=3)
        if len(self.requests) == 1:
            if self.bad == "nested":
                bad = Response(
                    type=Response.EVENT_TYPE_PUT, record=agent_record("smuggled", 7, 1), revision=2
                )
                bad.events.append(Response(type=Response.EVENT_TYPE_PUT, record=agent_record("inner", 7, 1)))
                yield Response(events=[bad, Response(type=SYNCED, revision=2)])
            else:  # 513 events: 512 of them empty, 3 bytes each
                yield Response(events=[Response(type=SYNCED, revision=2)] * WATCH_BATCH_EVENTS_MAX + [put])
            self.done.wait(10)
            return
        yield Response(events=[put, Response(type=SYNCED, revision=3)])
        self.done.wait(10)

    def stop(self) -> None:
        self.done.set()
        self.server.stop(0)


@pytest.fixture(params=["nested", "too many"])
def crafted(request):
    service = _Crafted(request.param)
    yield service
    service.stop()


def test_a_watcher_drops_a_stream_that_nests_batches(crafted, caplog):
    client = MetadataClient(crafted.address)
    got: list[Response] = []
    watcher = Watcher(client, got.append)
    try:
        assert watcher.synced.wait(15)  # on the second stream
        assert [(e.type, e.record.name) for e in got] == [(Response.EVENT_TYPE_PUT, "good"), (SYNCED, "")]
        assert len(crafted.requests) == 2 and crafted.requests[0].batch_bytes == WATCH_BATCH_BYTES
        assert ("a watch batch inside a batch" if crafted.bad == "nested" else "513 events") in caplog.text
        assert crafted.times[1] - crafted.times[0] >= 1.5  # a broken service gets the longest backoff
    finally:
        watcher.stop()
        client.close()


def test_a_read_replica_resyncs_from_a_stream_that_nests_batches(crafted):
    async def body():
        store = MirrorStore(crafted.address)
        await store.start()
        try:
            for _ in range(100):
                if store._following:
                    break
                await asyncio.sleep(0.05)
            assert store._following and set(store._records) == {"good"}  # nothing of the first stream
            assert len(crafted.requests) == 2 and crafted.requests[0].batch_bytes == WATCH_BATCH_BYTES
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_read_replica_follows_in_batches_and_serves_them():
    """A replica asks its primary for batches, and serves its own watchers batches."""
    with ThreadedServer(MetadataServer("127.0.0.1:0", MemoryStore())) as primary:
        _register(primary.address, [f"agent-{i:03d}" for i in range(200)])
        with ThreadedServer(MetadataServer("127.0.0.1:0", MirrorStore(primary.address))) as replica:
            client = MetadataClient(replica.address)

            def copied() -> bool:
                try:
                    return client.get("agent-199") is not None
                except Exception:
                    return False

            wait_until(copied, 10, "the replica's copy")
            call = stub(replica.address).WatchAgents(
                metadata_pb2.WatchAgentsRequest(batch_bytes=WATCH_BATCH_BYTES), timeout=30
            )
            try:
                events: list[Response] = []
                messages = _read(call, _synced, events)
                assert len(events) == 201 and len(messages) <= 3
            finally:
                call.cancel()
                client.close()
