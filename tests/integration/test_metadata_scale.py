"""The memory store at scale: what a busy or large registry must not do to
its agents (leases lost to a stalled service) or to its lookups (a /metrics
scrape that copies every record on the event loop)."""

from __future__ import annotations

import asyncio
import gc
import time

from kvx.metadata.metrics import ServiceMetrics
from kvx.metadata.mirror import MirrorStore
from kvx.metadata.store import STALL_S, MemoryStore
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only
from tests.integration.metadata_util import agent_record

pytestmark = native_pass_only


def _record(name, role=metadata_pb2.ROLE_PREFILL):
    return agent_record(name, 1, role=role, started=1)


def test_a_stall_of_the_service_does_not_cost_a_lease():
    """The event loop blocked longer than a lease's ttl (as a registration storm or
    a long collection of garbage does): the renewal that was queued meanwhile still
    finds its lease, and a lease nobody renews still runs out after its ttl."""

    async def main():
        store = MemoryStore(expiry_interval_s=0.05)
        await store.start()
        try:
            renewed, abandoned = await store.grant_lease(2), await store.grant_lease(2)
            await store.put_if(_record("renewed"), renewed, 0)
            await store.put_if(_record("abandoned"), abandoned, 0)
            await asyncio.sleep(0.2)
            time.sleep(3.0)  # the whole loop stalls: no renewal can be read, no lease checked
            await asyncio.sleep(0.2)  # the expiry loop runs again
            assert store.stalled_s > STALL_S
            assert await store.keep_alive(renewed) == 2, "a lease ran out while the service stalled"
            assert await store.get("renewed") is not None
            deadline = time.monotonic() + 10
            while await store.get("abandoned") is not None:
                assert time.monotonic() < deadline, "an unrenewed lease must still expire"
                await store.keep_alive(renewed)
                await asyncio.sleep(0.1)
            assert await store.get("renewed") is not None
            assert store.expired_leases == 1
        finally:
            await store.close()

    asyncio.run(main())


def test_a_short_hiccup_is_not_counted_as_a_stall():
    async def main():
        store = MemoryStore(expiry_interval_s=0.05)
        await store.start()
        try:
            await asyncio.sleep(0.1)
            time.sleep(STALL_S / 4)
            await asyncio.sleep(0.2)
            assert store.stalled_s == 0.0
        finally:
            await store.close()

    asyncio.run(main())


def _tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_a_large_registry_gives_the_cycle_collector_nothing_to_walk():
    """A full collection walks every object the cycle collector tracks, on the
    event loop that answers lookups: at 100,000 agents a message and a lease
    object each took it 200-500 ms. Records, leases and their names are kept in
    untracked containers, on the primary and on a read replica, and are still
    what they were (revision, lease, role counts, the lease's names)."""

    async def main():
        agents = 2000
        primary = MemoryStore()
        before = _tracked_objects()
        leases = [await primary.grant_lease(30) for _ in range(agents)]
        for i, lease in enumerate(leases):
            role = metadata_pb2.ROLE_PREFILL if i % 2 else metadata_pb2.ROLE_DECODE
            assert await primary.put_if(_record(f"a{i:05d}", role), lease, 0) == i + 1
        # Written again under the same lease, and one under another lease and role.
        assert await primary.put_if(_record("a00007"), leases[7], 8) == agents + 1
        assert await primary.put_if(_record("a00008"), leases[9], 9) == agents + 2
        grown = _tracked_objects() - before
        assert grown < 50, f"{grown} more objects for the collector to walk with {agents} agents"
        record = await primary.get("a00008")
        assert record.revision == agents + 2 and record.lease_id == leases[9]
        assert await primary.count_by_role() == {
            metadata_pb2.ROLE_PREFILL: agents // 2 + 1,
            metadata_pb2.ROLE_DECODE: agents // 2 - 1,
        }
        await primary.revoke_lease(leases[8])  # holds no name now
        assert await primary.get("a00008") is not None
        await primary.revoke_lease(leases[9])  # takes both of its names, and only those
        assert await primary.get("a00008") is None and await primary.get("a00009") is None
        assert await primary.count() == agents - 2
        assert not await primary.delete_if("a00007", 8)  # an old revision
        assert await primary.delete_if("a00007", agents + 1)

        replica = MirrorStore("127.0.0.1:1")
        replica._following = replica._synced_once = True  # as after a first snapshot
        before = _tracked_objects()
        for record in await primary.list():
            replica._put(record)
        grown = _tracked_objects() - before
        assert grown < 50, f"{grown} more objects for the collector to walk with {agents} agents"
        assert await replica.count() == agents - 3
        copy = await replica.get("a00010")
        assert copy.lease_id == 0 and copy.epoch == 1

    asyncio.run(main())


def test_a_metrics_scrape_counts_roles_without_reading_the_records():
    async def main():
        store = MemoryStore()
        pages = 0
        list_page = store.list_page

        async def counting_list_page(after, limit):
            nonlocal pages
            pages += 1
            return await list_page(after, limit)

        store.list_page = counting_list_page
        lease = await store.grant_lease(60)
        for i in range(300):
            await store.put_if(_record(f"p{i:03d}"), lease, 0)
        for i in range(200):
            await store.put_if(_record(f"d{i:03d}", metadata_pb2.ROLE_DECODE), lease, 0)
        # A record that changes role, and records that go.
        current = await store.get("p000")
        await store.put_if(_record("p000", metadata_pb2.ROLE_OTHER), lease, current.revision)
        for name in ("p001", "d000"):
            assert await store.delete_if(name, (await store.get(name)).revision)
        metrics = ServiceMetrics(store)
        await metrics.store_collector.refresh()
        assert metrics.store_collector.by_role == {
            "prefill": 298,
            "decode": 199,
            "other": 1,
            "unspecified": 0,
        }
        assert pages == 0, "a scrape paged through the registry"
        await store.revoke_lease(lease)
        await metrics.store_collector.refresh()
        assert metrics.store_collector.by_role == {"prefill": 0, "decode": 0, "other": 0, "unspecified": 0}

    asyncio.run(main())


def _big_record(name, regions):
    rec = _record(name)
    for r in range(regions):
        rec.metadata.regions.add(id=r + 1, size_bytes=1 << 30, address=0x7F0000000000 + r, remote_read=True)
    return rec


def test_big_records_cannot_fill_the_memory_of_the_service():
    """An unauthenticated registrant sends the largest records it may: the registry
    stops at max_registry_bytes, not at max_agents x max_record_bytes, and an agent
    already registered still refreshes its record and is found."""
    import grpc

    from kvx.metadata.service import MetadataServer, ServiceLimits, ThreadedServer
    from kvx.v1 import metadata_pb2_grpc

    limits = ServiceLimits(max_registry_bytes=2 * 1024 * 1024)
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        honest = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("honest")), timeout=10)
        refused = None
        for i in range(40):  # 40 x ~100 KiB: twice the bound
            try:
                stub.RegisterAgent(
                    metadata_pb2.RegisterAgentRequest(record=_big_record(f"big-{i}", 3000)), timeout=10
                )
            except grpc.RpcError as exc:
                refused = exc
                break
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-registry-bytes" in refused.details()
        assert srv.call(srv.server.store.record_bytes()) <= limits.max_registry_bytes
        # The honest agent refreshes (same size) and is still found.
        again = stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_record("honest"), lease_id=honest.lease_id), timeout=10
        )
        assert again.lease_id
        assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="honest"), timeout=10).record.name == "honest"
        # Room comes back as records go.
        for i in range(3):
            srv.call(srv.server.store.revoke_lease(srv.call(srv.server.store.get(f"big-{i}")).lease_id))
        stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_big_record("big-late", 3000)), timeout=10
        )
