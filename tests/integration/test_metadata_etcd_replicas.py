"""EtcdStore as several service replicas on one real etcd: the read mirror, and
kvx leases enforced by the replicas over long-lived etcd leases (the backstop).

Two EtcdStore instances on one prefix stand for two replicas. Short kvx ttls
(2-3 s, the service's minimum is 2) and small backstops keep the tests short;
every wait is bounded well past what the behaviour needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import pytest

from kvx.metadata.etcd import EXPIRY_GRACE_S, TAKEOVER_S, EtcdStore
from kvx.metadata.store import AgentRecord
from tests.conftest import native_pass_only

pytestmark = [pytest.mark.slow, native_pass_only]

DEADLINE_S = 60.0
_prefixes = itertools.count()


def run(body, deadline_s: float = DEADLINE_S):
    return asyncio.run(asyncio.wait_for(body, deadline_s))


def record(name: str, **labels: str) -> AgentRecord:
    rec = AgentRecord(name=name, epoch=0x77, registered_unix_ms=1_700_000_000_000)
    rec.labels.update(labels)
    return rec


@contextlib.asynccontextmanager
async def replicas(server, count: int = 2, slow_mirror_s: float = 0.0, **kwargs):
    """``count`` started stores on one prefix; the last one's mirror sees every
    change ``slow_mirror_s`` late."""
    prefix = f"/kvx-replicas/{next(_prefixes)}/"
    stores = [EtcdStore(server.url, prefix=prefix, timeout_s=3.0, **kwargs) for _ in range(count)]
    if slow_mirror_s:
        _slow_watch(stores[-1], slow_mirror_s)
    try:
        for store in stores:
            await store.start()
        await until(lambda: all(s.mirror_synced for s in stores), 10, "the mirrors to sync")
        yield stores
    finally:
        for store in stores:
            await store.close()


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _slow_watch(store: EtcdStore, delay_s: float):
    """Makes ``store``'s mirror see every change ``delay_s`` late."""
    watch = store.watch

    async def slow(queue_size: int = 1000):
        async for event in watch(queue_size):
            if event.record is not None:
                await asyncio.sleep(delay_s)
            yield event

    store.watch = slow  # type: ignore[method-assign]


# The read mirror.


def test_mirror_answers_gets_and_follows_other_replicas(etcd_server):
    async def body():
        async with replicas(etcd_server, slow_mirror_s=0.5) as (a, b):
            lease = await a.grant_lease(30)
            rev = await a.put_if(record("n1", v="1"), lease, 0)
            # Not in b's mirror yet (it lags): a miss is confirmed with etcd, never reported.
            assert "n1" not in b._mirror
            got = await b.get("n1")
            assert got is not None and got.revision == rev
            await until(lambda: "n1" in b._mirror, 5, "b's mirror to see n1")
            reads = b.etcd_reads
            for _ in range(50):
                got = await b.get("n1")
                assert got.revision == rev and got.labels["v"] == "1" and got.lease_id == lease
            assert b.etcd_reads == reads  # all from the mirror
            assert await b.count() == 1

            got.labels["v"] = "changed"  # a copy: the mirror is not touched
            assert (await b.get("n1")).labels["v"] == "1"

            rev2 = await a.put_if(record("n1", v="2"), lease, rev)
            await until(lambda: _revision(b, "n1") == rev2, 5, "b to see a's update")
            assert await a.delete_if("n1", rev2)
            await until(lambda: "n1" not in b._mirror, 5, "b to see a's delete")
            assert await b.get("n1") is None and await b.count() == 0

    run(body())


def _revision(store: EtcdStore, name: str) -> int:
    record = store._mirror.get(name)
    return record.revision if record is not None else 0


def test_a_get_right_after_our_own_write_sees_it(etcd_server):
    async def body():
        async with replicas(etcd_server) as (a, b):
            lease = await a.grant_lease(30)
            rev = await b.put_if(record("w", v="0"), lease, 0)
            await until(lambda: _revision(a, "w") == rev, 5, "a's mirror to see w")
            await a.close()
            _slow_watch(a, 0.5)  # a's mirror lags every change by half a second
            await a.start()
            await until(lambda: a.mirror_synced, 10, "a's mirror to sync again")
            for i in range(1, 6):
                rev = await a.put_if(record("w", v=str(i)), lease, rev)
                got = await a.get("w")
                assert got.revision == rev and got.labels["v"] == str(i)
            assert await a.delete_if("w", rev)
            assert await a.get("w") is None
            rev = await a.put_if(record("w", v="again"), lease, 0)
            assert (await a.get("w")).revision == rev
            await until(lambda: not a._pending, 10, "a's mirror to catch up")
            reads = a.etcd_reads
            assert (await a.get("w")).revision == rev and a.etcd_reads == reads

    run(body())


# Leases: enforced by the replica that renews them, etcd renewed seldom.


def test_renewals_reach_etcd_a_few_times_per_backstop(etcd_server):
    async def body():
        async with replicas(etcd_server, count=1, backstop_s=9) as (a,):
            leases = [await a.grant_lease(3) for _ in range(20)]
            for i, lease in enumerate(leases):
                await a.put_if(record(f"agent-{i}"), lease, 0)
            forwarded = a.forwarded_keep_alives
            renewals = 0
            started = time.monotonic()
            while time.monotonic() - started < 7:  # past the etcd ttl of 9 s less its third
                assert await a.keep_alive_many(leases) == [3] * len(leases)
                assert await a.keep_alive(leases[0]) == 3
                renewals += len(leases) + 1
                await asyncio.sleep(0.5)
            forwards = a.forwarded_keep_alives - forwarded
            # One forward per lease every 3 s at most (9 s / 3): about 2 each in 7 s.
            assert renewals >= 200 and 0 < forwards <= renewals / 5, (forwards, renewals)
            for lease in leases:  # etcd's lease lives on, with its long ttl
                assert 0 < await a.lease_ttl(lease) <= 3
            assert len(await a.list()) == 20 and a.expired_leases == 0

    run(body())


def test_keep_alive_many_answers_gone_and_duplicate_leases(etcd_server):
    async def body():
        async with replicas(etcd_server, count=2, backstop_s=20) as (a, b):
            live, gone = await a.grant_lease(6), await a.grant_lease(6)
            await a.revoke_lease(gone)
            forwarded = b.forwarded_keep_alives
            # b tracks neither: one etcd round trip for each distinct lease, none for repeats.
            assert await b.keep_alive_many([live, gone, live, 0x7777_0000_0001]) == [6, 0, 6, 0]
            assert b.forwarded_keep_alives - forwarded == 3
            await asyncio.sleep(
                TAKEOVER_S + 0.2
            )  # b forwards every renewal of a lease it took over for a while
            assert await b.keep_alive_many([live, live]) == [6, 6]
            assert b.forwarded_keep_alives - forwarded == 3  # tracked now, answered here
            assert 0 < await b.lease_ttl(live) <= 6 and await b.lease_ttl(gone) == 0

    run(body())


def test_unrenewed_lease_expires_at_its_replica_long_before_the_backstop(etcd_server):
    async def body():
        async with replicas(etcd_server, backstop_s=60) as (a, b):
            kept, dying = await a.grant_lease(2), await a.grant_lease(2)
            await a.put_if(record("kept"), kept, 0)
            await a.put_if(record("dying"), dying, 0)
            started = time.monotonic()

            async def dying_gone():
                assert await a.keep_alive(kept) == 2
                return await b.get("dying") is None

            await until(dying_gone, 2 + EXPIRY_GRACE_S + 6, "the unrenewed lease to expire")
            assert time.monotonic() - started >= 2 - 0.5
            assert a.expired_leases == 1
            assert await a.keep_alive(dying) == 0 and await b.keep_alive(dying) == 0
            assert await a.lease_ttl(dying) == 0 and await b.lease_ttl(dying) == 0
            assert [r.name for r in await b.list()] == ["kept"]

    run(body())


def test_lease_renewed_only_at_another_replica_is_not_revoked(etcd_server):
    async def body():
        async with replicas(etcd_server, backstop_s=6) as (a, b):
            lease = await a.grant_lease(2)  # a tracks it from the grant
            await a.put_if(record("mover"), lease, 0)
            started = time.monotonic()
            while time.monotonic() - started < 10:  # past the kvx ttl, past the backstop
                assert await b.keep_alive(lease) == 2, "the lease was lost"
                assert await b.get("mover") is not None
                await asyncio.sleep(0.6)  # the agent's pace: a third of its ttl
            assert a.expired_leases == 0 and lease not in a._leases  # a let it go
            assert await a.get("mover") is not None
            # And back to a: b lets it go in turn, a keeps it alive.
            started = time.monotonic()
            while time.monotonic() - started < 6:
                assert await a.keep_alive(lease) == 2, "the lease was lost moving back"
                await asyncio.sleep(0.6)
            assert lease not in b._leases and b.expired_leases == 0
            assert await b.get("mover") is not None

    run(body())


def test_replica_restart_loses_no_renewed_record(etcd_server):
    async def body():
        prefix = f"/kvx-replicas/{next(_prefixes)}/"

        def make():
            return EtcdStore(etcd_server.url, prefix=prefix, timeout_s=3.0, backstop_s=6)

        store = make()
        await store.start()
        leases = [await store.grant_lease(2) for _ in range(10)]
        for i, lease in enumerate(leases):
            await store.put_if(record(f"agent-{i}"), lease, 0)
        current = [store]
        stop = asyncio.Event()
        lost: list[int] = []

        async def agents():  # renew every 0.6 s through whichever replica is up
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    ttls = await current[0].keep_alive_many(leases)
                    lost.extend(lease for lease, ttl in zip(leases, ttls, strict=True) if ttl == 0)
                await asyncio.sleep(0.6)

        renewing = asyncio.create_task(agents())
        try:
            await asyncio.sleep(2)
            await store.close()  # the replica goes; a new one comes up on the same etcd
            store = make()
            await store.start()
            current[0] = store
            await asyncio.sleep(9)  # past the kvx ttl and the old etcd backstop
            assert not lost
            assert len(await store.list()) == 10 and store.expired_leases == 0
        finally:
            stop.set()
            await renewing
            await store.close()

    run(body())
