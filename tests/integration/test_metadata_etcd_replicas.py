"""EtcdStore as several service replicas on one real etcd: the read mirror, and
kvx leases enforced by the replicas over long-lived etcd leases (the backstop).

Two EtcdStore instances on one prefix stand for two replicas. Short kvx ttls
(2-3 s, the service's minimum is 2) and small backstops keep the tests short;
every wait is bounded well past what the behaviour needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import secrets
import time

import pytest

from kvx.metadata.etcd import EXPIRY_GRACE_S, FORWARDS_MAX, GET_ANSWERS_AT_ONCE, TAKEOVER_EXTRA_S, EtcdStore
from kvx.metadata.store import AgentRecord, EventType, StoreError, WatchLagError
from kvx.v1.metadata_pb2 import GetAgentResponse
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


def test_get_answers_reads_what_the_mirror_lacks_from_etcd_at_once(etcd_server):
    """GetAgents on etcd: names the mirror lacks (it lags here) are read from etcd
    concurrently, not one read after another; names it holds are read from it alone.
    Every answer is GetAgent's, lease id cleared."""

    async def body():
        async with replicas(etcd_server, slow_mirror_s=0.5) as (a, b):
            lease = await a.grant_lease(30)
            revs = [await a.put_if(record(f"g{i}", v=str(i)), lease, 0) for i in range(3)]
            in_flight, most = 0, 0
            call = b._call

            async def counted(*args, **kwargs):
                nonlocal in_flight, most
                in_flight += 1
                most = max(most, in_flight)
                try:
                    return await call(*args, **kwargs)
                finally:
                    in_flight -= 1

            b._call = counted  # type: ignore[method-assign]
            names = ["g0", "g1", "nobody", "g2"]
            assert not any(n in b._mirror for n in names)
            reads = b.etcd_reads
            answers = await b.get_answers(names)
            assert b.etcd_reads - reads == 4 and most == 4  # all four at once
            got = [None if a is None else GetAgentResponse.FromString(a).record for a in answers]
            assert [(r.name, r.revision, r.lease_id) if r else None for r in got] == [
                ("g0", revs[0], 0),
                ("g1", revs[1], 0),
                None,
                ("g2", revs[2], 0),
            ]
            await until(lambda: all(f"g{i}" in b._mirror for i in range(3)), 5, "b's mirror to see them")
            reads = b.etcd_reads
            assert await b.get_answers(["g2", "g0"]) == [answers[3], answers[0]]
            assert b.etcd_reads == reads  # from the mirror
            assert await b.get_answers([]) == []
            # At most GET_ANSWERS_AT_ONCE reads of one call at a time.
            most, reads = 0, b.etcd_reads
            assert await b.get_answers([f"none{i}" for i in range(GET_ANSWERS_AT_ONCE + 4)]) == [None] * (
                GET_ANSWERS_AT_ONCE + 4
            )
            assert b.etcd_reads - reads == GET_ANSWERS_AT_ONCE + 4 and most == GET_ANSWERS_AT_ONCE

            # The first read that fails fails the call and cancels the others at once.
            cancelled = 0

            async def get(name):
                nonlocal cancelled
                if name == "bad":
                    await asyncio.sleep(0.01)
                    raise StoreError("etcd unavailable")
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled += 1
                    raise

            b.get = get  # type: ignore[method-assign]
            started = time.monotonic()
            with pytest.raises(StoreError, match="etcd unavailable"):
                await b.get_answers(["slow1", "bad", "slow2", "slow3"])
            assert cancelled == 3 and time.monotonic() - started < 5

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
            live, gone = await a.grant_lease(2), await a.grant_lease(2)
            await a.put_if(record("live"), live, 0)
            await a.revoke_lease(gone)
            await until(lambda: live in b._lease_names, 5, "b's mirror to see live")
            forwarded = b.forwarded_keep_alives
            # b tracks neither: one etcd round trip for each distinct lease of ours, none
            # for repeats, none for an id that is not a lease (or not ours).
            assert await b.keep_alive_many([live, gone, live, 0x7777_0000_0001]) == [2, 0, 2, 0]
            assert b.forwarded_keep_alives - forwarded == 1
            # b forwards every renewal of a lease it took over for its ttl and a bit more.
            started = time.monotonic()
            while time.monotonic() - started < 2 + TAKEOVER_EXTRA_S + 0.3:
                assert await b.keep_alive(live) == 2
                await asyncio.sleep(0.5)
            forwarded = b.forwarded_keep_alives
            assert await b.keep_alive_many([live, live]) == [2, 2]
            assert b.forwarded_keep_alives == forwarded  # tracked now, answered here
            assert 0 < await b.lease_ttl(live) <= 2 and await b.lease_ttl(gone) == 0
            assert a.expired_leases == 0 and live not in a._leases  # a saw it move

    run(body())


def test_unrenewed_lease_expires_at_its_replica_long_before_the_backstop(etcd_server, caplog):
    caplog.set_level(logging.DEBUG, logger="kvx.metadata.etcd")

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
            # The logs name the expired lease by its record, never by its id (the
            # holder's proof: a reader of the logs could take the name with it).
            assert "'dying' expired" in caplog.text
            for lease in (kept, dying):
                assert f"{lease:x}" not in caplog.text.lower() and str(lease) not in caplog.text

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


def test_lease_moved_right_after_its_grant_is_not_revoked_at_the_default_ttl(etcd_server):
    """Registered at one replica, renewed at another from the start (the client's
    renewer has its own channel, which a load balancer may send elsewhere), at the
    client's pace of ttl/3 with the default ttl and backstop."""

    async def body():
        async with replicas(etcd_server) as (a, b):
            lease = await a.grant_lease(10)  # a tracks it from the grant
            await a.put_if(record("split"), lease, 0)
            answers = []
            started = time.monotonic()
            while time.monotonic() - started < 10 + EXPIRY_GRACE_S + 5:  # past a's check
                answers.append(await b.keep_alive(lease))
                assert answers[-1] == 10, f"the lease was lost: {answers}"
                await asyncio.sleep(10 / 3)
            assert a.expired_leases == 0 and lease not in a._leases  # a let it go
            assert await a.get("split") is not None and await b.get("split") is not None

    run(body())


async def _raw(store: EtcdStore, what: str, fn):
    return await store._call(what, lambda client, rpc: fn(client, rpc))


def test_foreign_etcd_lease_is_never_renewed_or_revoked(etcd_server):
    """Another application's lease on the same etcd, whose id looks like one of ours
    (mark and kvx ttl bits): renewals of it are answered 0, and its key stays."""

    async def body():
        async with replicas(etcd_server, backstop_s=20) as (a, b):
            foreign = 1 << 62 | secrets.randbits(52) << 10 | 2 << 1 | 1  # "kvx ttl 2"
            await _raw(
                a, "grant", lambda c, rpc: c.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=30, ID=foreign))
            )
            await _raw(a, "put", lambda c, rpc: c.kvstub.Put(
                rpc.PutRequest(key=b"/other-app/key", value=b"v", lease=foreign)))  # fmt: skip
            # A lease of ours that holds only another application's key is not revoked either.
            bare = await a.grant_lease(2)
            await _raw(a, "put", lambda c, rpc: c.kvstub.Put(
                rpc.PutRequest(key=b"/other-app/bare", value=b"v", lease=bare)))  # fmt: skip
            started = time.monotonic()
            while time.monotonic() - started < 2 + EXPIRY_GRACE_S + 3:  # past any check of a kvx ttl 2
                assert await b.keep_alive_many([foreign, foreign]) == [0, 0]
                assert await a.keep_alive(foreign) == 0
                await asyncio.sleep(0.6)
            assert foreign not in a._leases and foreign not in b._leases
            assert a.expired_leases == 0 and b.expired_leases == 0
            for key in (b"/other-app/key", b"/other-app/bare"):
                got = await _raw(a, "get", lambda c, rpc, k=key: c.kvstub.Range(rpc.RangeRequest(key=k)))
                assert got.kvs, f"{key!r} was deleted"
            ttl = await _raw(a, "ttl", lambda c, rpc: c.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=foreign)))  # fmt: skip
            assert 0 < ttl.TTL <= 30 - 5 + 1, "the foreign lease was renewed"

    run(body())


def test_flood_of_random_lease_ids_stays_bounded(etcd_server):
    """One caller sends many batches of random ids at once: at most FORWARDS_MAX
    are checked in etcd at a time, the rest refused at once; renewals of real
    leases are still answered and the etcd connection is kept."""

    async def body():
        async with replicas(etcd_server, backstop_s=20) as (a, b):
            moved = await a.grant_lease(30)
            await a.put_if(record("moved"), moved, 0)
            local = await b.grant_lease(30)
            await b.put_if(record("local"), local, 0)
            in_flight = [0, 0]  # now, peak

            def counted(fn):
                async def wrapper(*args):
                    in_flight[0] += 1
                    in_flight[1] = max(in_flight)
                    try:
                        return await fn(*args)
                    finally:
                        in_flight[0] -= 1

                return wrapper

            b._renewals.renew = counted(b._renewals.renew)  # type: ignore[method-assign]
            b._holds_our_keys = counted(b._holds_our_keys)  # type: ignore[method-assign]
            client = b._client
            refused = answered = 0

            async def flood():
                nonlocal refused, answered
                for _ in range(2):
                    ids = [secrets.randbits(62) | 1 for _ in range(1024)]
                    try:
                        assert await b.keep_alive_many(ids) == [0] * len(ids)
                        answered += 1
                    except StoreError:
                        refused += 1
                        await asyncio.sleep(0.05)

            batches = FORWARDS_MAX // 1024 + 2
            floods = [asyncio.create_task(flood()) for _ in range(batches)]
            while not all(task.done() for task in floods):
                assert await b.keep_alive(local) == 30  # answered here, no etcd round trip
                await asyncio.sleep(0.05)
            await asyncio.gather(*floods)
            assert in_flight[1] <= FORWARDS_MAX and refused > 0 and answered > 0, (in_flight, refused)
            assert b._client is client and b.mirror_synced, b._dropped_for  # no forward timed out
            assert await b.keep_alive(moved) == 30  # a real forward still goes through

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


def test_a_lease_runs_from_the_write_its_registrant_hears_of(etcd_server):
    """A registration whose write reaches etcd later than the lease's ttl after the
    grant (etcd slow in a storm): the registrant learns the lease only then, so the
    replica must not revoke it before its first renewal could come."""

    async def body():
        async with replicas(etcd_server, count=1, backstop_s=60) as (a,):
            lease = await a.grant_lease(2)
            await asyncio.sleep(2 + EXPIRY_GRACE_S + 0.5)  # the write is slow
            assert await a.put_if(record("late"), lease, 0)
            await asyncio.sleep(1.5)  # the registrant's first renewal, ttl/3 later at most
            assert await a.keep_alive(lease) == 2, "the lease was revoked before its registrant heard of it"
            assert await a.get("late") is not None
            assert a.expired_leases == 0

    run(body())


def test_counting_agents_during_a_storm_reads_no_etcd_range(etcd_server):
    async def body():
        async with replicas(etcd_server, count=1, slow_mirror_s=0.5) as (a,):
            lease = await a.grant_lease(30)
            for i in range(3):
                await a.put_if(record(f"n{i}"), lease, 0)
            ranges = 0
            call = a._call

            async def counting(what, fn):
                nonlocal ranges
                ranges += what == "count"
                return await call(what, fn)

            a._call = counting
            await until(lambda: not a._pending, 10, "the mirror to see the first writes")
            await a.put_if(record("fresh"), lease, 0)  # the mirror sees it 0.5 s late
            assert a._pending
            assert await a.count() == 4
            assert ranges == 0

    run(body())


def test_a_lease_past_its_deadline_frees_its_name_before_the_check(etcd_server):
    """A killed agent's restart asks for its name just after the old lease's deadline:
    the replica's expiry check comes a second or more later, but the name is free
    now (the memory store answers the same), or the restarted agent gives up."""

    async def body():
        async with replicas(etcd_server, count=1, backstop_s=60) as (a,):
            lease = await a.grant_lease(2)
            await a.put_if(record("killed"), lease, 0)
            await asyncio.sleep(2.3)  # past the deadline; the check is due at about 3.25 s
            assert await a.get("killed") is not None  # not revoked yet
            assert await a.lease_ttl(lease) == 0

    run(body())


def test_a_watch_cancelled_before_etcd_creates_it_leaves_nothing_behind(etcd_server, caplog):
    # A watcher that leaves (its RPC cancelled) while the service waits for etcd to
    # create its watch: the etcd watch call must end with it. Dropped alive, the task
    # sending its requests waits for good and garbage collection destroys it pending
    # (an ERROR in the service's log, seen in the chaos soak).
    async def body():
        async with replicas(etcd_server, count=1) as (store,):
            client = await store._connect()
            for spins in range(1, 6):
                task = asyncio.create_task(store._open_watch(client, store._aetcd.rpc, 0))
                for _ in range(spins):
                    await asyncio.sleep(0)
                cancelled = task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    call = await task
                    call.cancel()  # created already: this spin missed the window
                assert cancelled or spins > 1
                for _ in range(3):
                    await asyncio.sleep(0.05)
                    gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        run(body())
    destroyed = [r.getMessage() for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    assert not destroyed, destroyed


@pytest.mark.parametrize("compact_every_s", [0.2, 0])
def test_compacted_history_never_fills_etcds_quota(tmp_path, compact_every_s):
    """etcd keeps every revision until compacted, and its quota counts them:
    one record written again and again (a registrant's own, say) filled it,
    after which etcd refused every write and lease grant, for every agent,
    until an operator stepped in. Each replica now compacts etcd's history
    (every 300 s by default, 0.2 s here); with compaction off the quota
    fills, which shows the test writes enough to fill it."""
    from tests.integration.conftest import EtcdServer, _etcd_binary

    binary = _etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed: scripts/test.sh installs it")
    quota = 48 << 20
    server = EtcdServer(binary, tmp_path / "etcd-data", ("--quota-backend-bytes", str(quota)))
    server.start()
    value = secrets.token_hex(1 << 19)  # 1 MiB
    written = []

    async def body():
        async with replicas(server, count=1, compact_every_s=compact_every_s) as (store,):
            lease = await store.grant_lease(60)
            revision = 0
            with contextlib.suppress(StoreError):
                while len(written) * len(value) < 3 * quota:
                    revision = await store.put_if(record("big", v=value), lease, revision)
                    written.append(revision)
                    # At most 50 MiB a second: what two compaction periods keep stays well under the quota.
                    await asyncio.sleep(0.02)
            # Then a new agent: a lease and a record.
            other = await store.grant_lease(60)
            return await store.put_if(record("newcomer"), other, 0), store.compacted_revision

    try:
        if compact_every_s:
            revision, compacted = run(body())
            assert revision and compacted > written[0]
        else:
            with pytest.raises(StoreError, match="space"):
                run(body())
            assert len(written) * len(value) < quota
    finally:
        server.kill()


def test_a_watcher_that_stops_reading_holds_a_bounded_number_of_bytes(etcd_server, monkeypatch):
    """A watch that reads its snapshot and then nothing, while large records
    are replaced: each replacement queues the new and the old record (prev_kv).
    The count of responses was its only bound (1,000 of up to about 512 KiB
    each); now the bytes queued are bounded too, each watch's and all of them
    together (64 MiB and 512 MiB; 2 MiB here)."""
    from kvx.metadata import etcd as etcd_module

    monkeypatch.setattr(etcd_module, "WATCH_QUEUE_BYTES", 2 << 20)
    value = secrets.token_hex(128 << 10)  # 256 KiB: about 512 KiB a replacement

    async def body():
        async with replicas(etcd_server, count=1) as (store,):
            lease = await store.grant_lease(30)
            revision = await store.put_if(record("big", v=value), lease, 0)
            events = store.watch()
            try:
                while (await events.__anext__()).type is not EventType.SYNCED:
                    pass
                [queue] = [q for q in store._watches if q._totals is not None]
                most = 0
                for _ in range(12):  # 6 MiB of replacements, nobody reading
                    revision = await store.put_if(record("big", v=value[::-1]), lease, revision)
                    await asyncio.sleep(0.05)  # the watch's reader queues the response
                    most = max(most, queue.bytes)
                assert most <= (2 << 20) + (600 << 10), most  # the bound, and the one response over it
                with pytest.raises(WatchLagError, match="bytes of changes behind"):
                    for _ in range(12):
                        await asyncio.wait_for(events.__anext__(), 10)
            finally:
                await events.aclose()
            assert store._queued_bytes == [0]  # nothing left counted once the watch ended

    run(body())


def test_past_the_total_bound_the_watch_furthest_behind_is_cut_off(etcd_server, monkeypatch):
    """The bytes all watches hold together are bounded too (512 MiB; 3 MiB
    here). Past it, the watch holding the most is cut off, not the one that
    happens to receive the next change: a watcher that keeps up is never
    cut off for one that stopped reading."""
    from kvx.metadata import etcd as etcd_module

    monkeypatch.setattr(etcd_module, "WATCH_QUEUE_BYTES_TOTAL", 3 << 20)
    value = secrets.token_hex(128 << 10)  # 256 KiB: about 512 KiB a replacement

    async def synced(events):
        while (await asyncio.wait_for(events.__anext__(), 10)).type is not EventType.SYNCED:
            pass

    async def body():
        async with replicas(etcd_server, count=1) as (store,):
            lease = await store.grant_lease(30)
            revision = await store.put_if(record("big", v=value), lease, 0)
            stalled, reading = store.watch(), store.watch()
            seen: list[int] = []

            async def read():
                async for event in reading:
                    seen.append(event.revision)

            try:
                await synced(stalled)
                await synced(reading)
                reader = asyncio.create_task(read())
                for _ in range(12):  # 6 MiB of replacements
                    revision = await store.put_if(record("big", v=value[::-1]), lease, revision)
                    await asyncio.sleep(0.05)
                await until(
                    lambda: seen and seen[-1] == revision, 10, "the reading watch to see every change"
                )
                assert not reader.done()  # never cut off
                with pytest.raises(WatchLagError, match="furthest behind"):
                    for _ in range(12):
                        await asyncio.wait_for(stalled.__anext__(), 10)
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            finally:
                await stalled.aclose()
                await reading.aclose()
            assert store._queued_bytes == [0]

    run(body())
