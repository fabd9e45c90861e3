"""``EtcdStore``: the metadata ``Store`` on etcd (v3 API, through ``aetcd``).

Several metadata-service replicas pointed at one etcd cluster share its state;
each keeps only a read mirror of it and the kvx deadlines of the leases renewed
at it (both rebuilt by themselves after a restart). How the store maps onto etcd:

* a kvx lease is an etcd lease with a long ttl, the backstop
  (``max(ttl, backstop_s)``, 60 s by default): LeaseGrant with a random id of
  ours (etcd's own ids count up and can be guessed; a lease id is the
  registrant's proof of holding its name); 52 of its bits are random, bits 1-9
  carry the kvx ttl, so that any replica knows which ttl to enforce, and bit 62
  is set (ids of older kvx versions, whose etcd ttl was the kvx ttl, have no
  mark: their etcd ttl is taken as their kvx ttl, never shorter). The kvx
  ttl is enforced by the replica the agent renews at (see "Leases" below);
  LeaseRevoke deletes the lease's keys;
* a record is the key ``prefix + name``, valued the serialized ``AgentRecord``
  and attached to its lease. A returned record's ``revision`` is the key's
  ``mod_revision``, its ``lease_id`` the key's lease;
* history: etcd keeps every revision of every key until it is compacted, and
  its quota (``--quota-backend-bytes``, 2 GiB by default) counts that history:
  past it etcd refuses every write, lease grants included, until an operator
  compacts, defragments and clears the alarm. Every ``compact_every_s`` (300 s
  by default; 0: leave it to etcd's own ``--auto-compaction-*``) each replica
  compacts etcd up to the revision it read one period before, as Kubernetes'
  API server does: the history of the last period stays, so a watch or a
  snapshot that resumes within it loses nothing, and one further behind gets
  WatchLagError and starts over. Replicas compacting the same history is
  harmless (etcd answers "already compacted");
* ``put_if`` / ``delete_if`` are transactions comparing the key's
  ``mod_revision`` with ``expect_revision`` (etcd compares an absent key as 0,
  so 0 means "absent"); ``put_if`` returns the transaction's revision;
* ``list_page`` is one range over the prefix from the key after ``after``,
  sorted by key, ``limit`` keys; ``count`` a count-only range (while the mirror
  cannot answer it). ``watch``
  ranges the prefix a page at a time, every page at the revision R of the
  first (one snapshot, never one copy of the whole prefix), yields their PUTs
  and SYNCED(R), then the changes of a watch of the prefix from R + 1 with
  ``prev_kv``, so that every DELETE (also the one etcd makes when a lease
  expires) carries the record as it was. A watch of ``names`` reads its
  snapshot as transactions of gets (128 names each, all at the first one's
  revision R) and passes on only the prefix watch's events of those names.
  A watch that falls ``queue_size``
  etcd responses behind is cut off with WatchLagError.

Every call is bounded by ``timeout_s``. An unreachable etcd raises
``StoreError`` (the aetcd/gRPC error chained) and ends watches with
``StoreError``; the connection is dropped and the next call connects again,
trying the endpoints in order, so callers just retry. ``start()`` raises
``StoreError`` when no endpoint answers; ``ready()`` never raises.

Reads come from a replica-local mirror: a watch of the prefix (the same as
``watch``: a paged snapshot, then the changes from its revision) keeps every
record in memory, and ``get`` and ``count`` answer from it once it is synced.
A name the mirror lacks is read from etcd before ``None`` is answered (it may
have been registered at another replica a moment ago), and so is a name this
instance wrote (``put_if``, ``delete_if``, ``revoke_lease``) until the
mirror has seen that write: a get right after our own write sees it. Another
replica's change reaches the mirror within the watch's delay (milliseconds;
longer while this replica is short of CPU): until then a get of a name the
mirror holds answers the record as the mirror has it, one another replica
updated or deleted meanwhile included. Gets are thus current for names
created anywhere and for our own writes, eventually current for other
replicas' updates and deletes. A ``put_if`` or ``delete_if`` that fails its
compare shows that the mirror may lag for that name: its reads go to etcd
too until the mirror has seen etcd's revision of it (deleted: any change of
it), so that the caller's retry (a get, then the write again) meets what etcd
holds rather than the same stale record. ``count`` is as current as the mirror.
While the mirror is not synced (starting, etcd unreachable, the watch cut
off, after which it loads again) every read goes to etcd, as do
``list_page`` and ``watch``.

Leases. Every replica keeps, for each lease renewed at it, the kvx deadline
(last renewal + kvx ttl) and when etcd last heard of it. A renewal is
answered from memory; it is forwarded to etcd (LeaseKeepAlive, over one
long-lived stream) only when this replica's last forward of that lease is a
third of its etcd ttl old, when the replica does not track the lease yet (the
forward also tells whether it exists: 0 if not), after a gap of more than half
the kvx ttl since its last renewal here, and for the kvx ttl plus
``TAKEOVER_EXTRA_S`` after taking a lease over (so that a forward of ours lands
in etcd more than its 1 s granularity after the old replica's last one, before
that replica's check: at the agent's pace of ttl/3, whatever the ttl). Only
leases of ours are forwarded: tracked ones, and those holding a key under the
prefix (the mirror's records tell; else LeaseTimeToLive with its keys, one
more round trip): any other id, another application's etcd lease included,
is answered 0 and never renewed, tracked or revoked. At most ``FORWARDS_MAX``
leases are forwarded or checked at once; a batch that would pass it is refused
with StoreError (UNAVAILABLE to the client, which retries) rather than answered
0 (which would make a live agent register again). ``keep_alive_many`` costs one
round trip per lease so forwarded and none for the rest: at 100,000 agents
renewing every ttl/3, etcd hears about
one renewal per lease per backstop/3 instead of every one. When a tracked
lease's kvx deadline passes unrenewed here (plus ``EXPIRY_GRACE_S``), the
replica asks etcd (LeaseTimeToLive): if the lease's remaining etcd ttl is more
than it can be had nobody forwarded a renewal since our last one, the agent
renews at another replica now, and this replica stops tracking it; otherwise
it revokes the lease (its records go, as before), if it still holds a key
under the prefix (else it is left to its etcd ttl). ``lease_ttl`` answers the kvx
remaining time for a tracked lease (0 once its deadline passed: the name is free
then, before the check decides) and etcd's remaining time for others: up to the backstop,
since only the replica renewing it knows its kvx deadline. What this changes:

* an agent that dies with the replica it renewed at lingers until its etcd
  lease runs out, up to the backstop, not its kvx ttl (no replica tracks it);
* an agent that moves to another replica keeps its lease and records;
* a restarted agent asking a replica that does not track its old lease waits
  up to etcd's remaining time (the backstop at most) for its name, not its ttl
  (``held_ttl`` gives the etcd raft term of that time: the service sends it
  with the refusal, and the agent tells a renewal, a rise within one term,
  from the reset a new etcd leader makes);
* while etcd is unreachable renewals fail as before (the mirror is not
  synced then, and every renewal is forwarded);
* after an etcd leader change (etcd resets every lease's remaining ttl) the
  check cannot tell a move from a death for a while: agents that died then
  linger until the backstop;
* a move costs up to (ttl + ``TAKEOVER_EXTRA_S``) / (ttl / 3) + 1 forwards
  (5 at ttl 10), once.

``expired_leases`` counts the distinct revisions (one per expired lease) of
the DELETE events this instance's watches (the mirror's included) see that its
own ``delete_if`` or ``revoke_lease`` did not make, and the leases this replica
revoked as expired. Approximate: another replica's deletes count too, and an
expiry seen while one of our deletes is in flight does not.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import hashlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import grpc

from kvx._net import parse_address
from kvx.errors import ConfigError
from kvx.metadata._etcd_leases import Renewals, TrackedLease
from kvx.metadata.store import (
    PAGE_RECORDS,
    WATCH_BATCH_EVENTS,
    WATCH_QUEUE_MAX,
    AgentRecord,
    Event,
    EventBatch,
    EventType,
    Store,
    StoreError,
    WatchLagError,
    encode_answer,
    split_batch,
)

logger = logging.getLogger(__name__)

# GetAgents: names a replica's mirror cannot answer, read from etcd at once (a call's share).
GET_ANSWERS_AT_ONCE = 16
# A watch without events checks this often that etcd still answers.
WATCH_IDLE_CHECK_S = 10.0
# The etcd lease behind a kvx lease lives at least this long unless renewed
# (``EtcdStore(backstop_s=...)``, ``kvx metadata --etcd-lease-backstop-s``).
BACKSTOP_S = 60
# How often a replica compacts etcd's history, up to the revision it read one
# period before (``EtcdStore(compact_every_s=...)``, ``kvx metadata
# --etcd-compact-every-s``; 0: never).
COMPACT_EVERY_S = 300.0
# A tracked lease is checked this long after its kvx deadline passed unrenewed.
EXPIRY_GRACE_S = 1.0
EXPIRY_TICK_S = 0.25
# A replica that starts tracking a lease renewed elsewhere before (a takeover)
# forwards every renewal of it for its kvx ttl plus this: until past the check of
# the replica that tracked it before (due at the second after its deadline + the
# grace, run at the next tick), which then sees the lease move through the etcd
# lease's remaining ttl.
TAKEOVER_EXTRA_S = EXPIRY_GRACE_S + 1 + EXPIRY_TICK_S
# Leases being forwarded to etcd (or checked there) at once, by all callers; a
# batch that would pass it is refused with StoreError (UNAVAILABLE: the client
# retries), so that random ids cannot pin memory or delay real forwards past the
# timeout (which drops the connection). One full batch (1,025 ids) fits; 2,048
# round trips take about 0.4 s on a 2-core machine.
FORWARDS_MAX = 2048
# LeaseTimeToLive checks of expired-looking leases in flight at once.
EXPIRY_CHECKS_MAX = 256
# Leases one replica tracks; past it, renewals of other leases are forwarded
# one by one (as without tracking) and their kvx ttl is not enforced here.
LEASES_TRACKED_MAX = 1 << 20
# The mirror's watch queue (etcd responses); a mirror that far behind reloads.
MIRROR_QUEUE_RESPONSES = 10_000
# What the other watches (the service's clients') may hold queued, in bytes of etcd
# responses (a replaced record's event carries its old value too): each, and all of
# them together. Past either, the watch that would add more is cut off (WatchLagError):
# a watcher that stops reading must not hold the replica's memory without bound.
WATCH_QUEUE_BYTES = 64 << 20
WATCH_QUEUE_BYTES_TOTAL = 512 << 20
# Names written here whose change the mirror has not seen yet; past it the
# mirror reloads (reads go to etcd meanwhile).
PENDING_WRITES_MAX = 65_536
# The kvx ttl rides in bits 1-9 of the lease ids we grant (see grant_lease), and
# bit 62 tells such ids from those of older kvx versions (62 random bits or etcd's).
_TTL_BITS = 9
_TTL_MASK = (1 << _TTL_BITS) - 1
_TTL_MARK = 1 << 62
# Gets per transaction of a names watch's snapshot: etcd's default --max-txn-ops is 128.
_TXN_GETS = 128
# gRPC codes after which the connection is dropped and the next call reconnects.
_TRANSIENT = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL", "ABORTED"}
# What a stream's read() returns at its end. grpc-stubs does not declare it (grpcio has it since 1.32).
_EOF = grpc.aio.EOF  # type: ignore[attr-defined]


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port[,host:port...]`` -> ``[(host, port), ...]``."""
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ConfigError(f"etcd URL {url!r} must look like etcd://host:port[,host:port...]")
    endpoints = []
    for part in url.removeprefix("etcd://").rstrip("/").split(","):
        try:
            host, port = parse_address(part.strip())  # [::1]:2379 too
        except ConfigError:
            host, port = "", 0  # refused below, with this function's message
        if "/" in host or port == 0:
            raise ConfigError(f"bad etcd endpoint {part!r} in {url!r}: expected host:port, port in 1..65535")
        endpoints.append((host, port))
    return endpoints


class EtcdStore(Store):
    """Agent records in etcd, shared by every metadata-service replica."""

    name = "etcd"

    def __init__(
        self,
        endpoints: list[tuple[str, int]] | str,
        *,
        prefix: str = "/kvx/agents/",
        timeout_s: float = 5.0,
        backstop_s: int = BACKSTOP_S,
        compact_every_s: float = COMPACT_EVERY_S,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = parse_etcd_url(endpoints)
        self._endpoints = [(str(host), int(port)) for host, port in endpoints]
        if not self._endpoints:
            raise ConfigError("EtcdStore needs at least one etcd endpoint")
        if not prefix:
            raise ConfigError("the etcd key prefix must not be empty")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, not {timeout_s!r}")
        if not (isinstance(backstop_s, int) and 2 <= backstop_s <= 86_400):
            raise ConfigError(f"the etcd lease backstop must be 2..86400 s, not {backstop_s!r}")
        if not (
            isinstance(compact_every_s, (int, float))
            and (compact_every_s == 0 or 0.1 <= compact_every_s <= 86_400)
        ):
            raise ConfigError(
                f"the etcd compaction period must be 0 (off) or 0.1..86400 s, not {compact_every_s!r}"
            )
        self._compact_every_s = float(compact_every_s)
        self.compacted_revision = 0  # the revision this replica last compacted etcd up to
        self._prefix = prefix.encode()
        self._range_end = _prefix_end(self._prefix)
        self._timeout_s = float(timeout_s)
        self._channel_options = {
            "grpc.max_receive_message_length": 256 << 20,  # a page: PAGE_RECORDS records of up to 256 KiB
            "grpc.initial_reconnect_backoff_ms": 200,
            "grpc.max_reconnect_backoff_ms": 2000,
        }
        self._aetcd: Any = None  # the module, imported by start() (it is optional: kvx[etcd])
        self._client = None
        self._dropped_for = "etcd failed"  # why the last connection was dropped
        self._connect_lock = asyncio.Lock()
        self._watches: set[asyncio.Queue] = set()
        self._queued_bytes = [0]  # what the clients' watches hold queued, in all (_WatchQueue)
        self._mirror_task: asyncio.Task | None = None
        self._closing: set[asyncio.Future] = set()
        self._renewals = Renewals()
        self._own_deletes: collections.deque[int] = collections.deque(maxlen=4096)
        self._deleting = 0  # our delete_if/revoke_lease calls in flight
        self._counted: collections.deque[int] = collections.deque(maxlen=4096)
        self.expired_leases = 0  # approximate, see the module docstring
        self._backstop_s = int(backstop_s)
        self._tasks: list[asyncio.Task] = []
        # Leases renewed here: their kvx deadlines, and when etcd last heard of them.
        self._leases: dict[int, TrackedLease] = {}
        self._due: dict[int, set[int]] = {}  # second (monotonic) -> leases to check then
        self._next_due = 0
        self.renewals = 0  # kvx renewals asked of this store
        self.forwarded_keep_alives = 0  # etcd LeaseKeepAlives they cost
        self._forwards = 0  # leases being forwarded or checked now (FORWARDS_MAX)
        # The read mirror: every record under the prefix, fed by a watch.
        self._mirror: dict[str, AgentRecord] = {}
        self._mirror_synced = False
        self._mirror_revision = 0
        # name -> revision of its change the mirror lacks (our write, or one a failed compare revealed)
        self._pending: dict[str, int] = {}
        self._lease_names: dict[int, set[str]] = {}  # the mirror's records by lease
        self.etcd_reads = 0  # gets the mirror could not answer

    async def start(self) -> None:
        try:
            import aetcd
        except ImportError as e:
            raise ConfigError("the etcd metadata store needs aetcd: pip install kvx[etcd]") from e
        self._aetcd = aetcd
        if not self._tasks:  # started again after a failed start: the tasks run already
            self._next_due = int(time.monotonic())
            self._tasks = [
                asyncio.create_task(self._mirror_loop(), name="kvx-etcd-mirror"),
                asyncio.create_task(self._expiry_loop(), name="kvx-etcd-lease-expiry"),
            ]
            if self._compact_every_s:
                self._tasks.append(asyncio.create_task(self._compact_loop(), name="kvx-etcd-compact"))
        await self._call("connect", lambda client, rpc: asyncio.sleep(0))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for _ in range(50):  # cancel again: asyncio.wait_for (3.11) can swallow a cancellation
            for task in tasks:
                task.cancel()
            _, pending = await asyncio.wait(tasks, timeout=0.1) if tasks else (None, ())
            if not pending:
                break
            tasks = list(pending)
        self._renewals.close(StoreError("the metadata store is closing"))
        for queue in list(self._watches):
            _cut_off(queue, StoreError("the metadata store is closing"))
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)

    async def ready(self) -> bool:
        # Two tries in one timeout: the second connects afresh if the first dropped a dead connection.
        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    return await self._call("status", lambda c, rpc: _status(c, rpc))
                except StoreError:
                    return await self._call("status", lambda c, rpc: _status(c, rpc))
        except Exception:  # noqa: BLE001 - ready() reports, it never raises
            return False

    async def grant_lease(self, ttl_s: int) -> int:
        etcd_ttl_s = max(int(ttl_s), self._backstop_s)
        for _ in range(4):  # a clash of two random 52-bit ids is all but impossible; bounded anyway
            # The kvx ttl rides in the id (0: too long to fit), so that a replica the
            # agent moves to knows which ttl to enforce; 52 random bits stay secret.
            lease_id = secrets.randbits(62 - _TTL_BITS - 1) << (_TTL_BITS + 1) | _TTL_MARK
            lease_id |= (ttl_s if 0 < ttl_s <= _TTL_MASK else 0) << 1 | 1
            try:
                response = await self._call(
                    "lease grant",
                    lambda c, rpc, i=lease_id: c.leasestub.LeaseGrant(
                        rpc.LeaseGrantRequest(TTL=etcd_ttl_s, ID=i)
                    ),
                )
            except StoreError as e:
                if _code(e.__cause__) == "FAILED_PRECONDITION":  # "lease already exists"
                    continue
                raise
            if response.error:
                raise StoreError(f"etcd refused a lease of {etcd_ttl_s} s: {response.error}")
            now = time.monotonic()
            self._track(response.ID, int(ttl_s), int(response.TTL), now, takeover=False)
            return response.ID
        raise StoreError("etcd refused four random lease ids as taken")

    async def lease_ttl(self, lease_id: int) -> int:
        return (await self.held_ttl(lease_id))[0]

    async def held_ttl(self, lease_id: int) -> tuple[int, int]:
        lease = self._leases.get(lease_id)
        if lease is not None:  # its kvx deadline; past it, the name is free (as in the memory store)
            return max(0, math.ceil(lease.deadline - time.monotonic())), 0
        # Untracked here: renewed at another replica, or at none. Only etcd's remaining
        # time bounds it (up to the backstop): the replica renewing it knows better.
        try:
            response = await self._call(
                "lease ttl",
                lambda c, rpc: c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id)),
            )
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                return 0, 0
            raise
        return max(0, int(response.TTL)), max(1, int(response.header.raft_term))  # TTL -1: gone

    async def keep_alive(self, lease_id: int) -> int:
        return (await self.keep_alive_many([lease_id]))[0]

    async def keep_alive_many(self, lease_ids: Sequence[int]) -> list[int]:
        # A tracked lease is renewed here, in memory; etcd hears of it every third of
        # its etcd ttl. The rest is forwarded: one LeaseKeepAlive per distinct lease,
        # all over the one keep-alive stream (a stream per renewal cost the service
        # most of its CPU at 2,000 renewals per second), replies matched by lease id.
        now = time.monotonic()
        self.renewals += len(lease_ids)
        ttls = [0] * len(lease_ids)
        forward: dict[int, list[int]] = {}  # lease -> its places in lease_ids
        healthy = self._healthy()
        for i, lease_id in enumerate(lease_ids):
            lease = self._leases.get(lease_id)
            if lease is None or not healthy or lease.must_forward(now, TAKEOVER_EXTRA_S):
                forward.setdefault(lease_id, []).append(i)
            else:
                self._renewed(lease, now)
                ttls[i] = lease.ttl_s
        if not forward:
            return ttls
        if self._forwards + len(forward) > FORWARDS_MAX:
            raise StoreError(
                f"{self._forwards} lease renewals wait for etcd already (at most {FORWARDS_MAX}); "
                "retry in a moment"
            )
        self._forwards += len(forward)
        try:
            replies = await self._forward(list(forward), healthy)
        finally:
            self._forwards -= len(forward)
        replied = time.monotonic()
        for lease_id, etcd_ttl_s in replies.items():
            ttl = self._forwarded(lease_id, etcd_ttl_s, now, replied)
            for i in forward[lease_id]:
                ttls[i] = ttl
        return ttls

    async def _forward(self, ids: list[int], healthy: bool) -> dict[int, int]:
        """etcd's ttl for each lease of ``ids`` after a LeaseKeepAlive, 0 for those that
        do not exist. Only leases of ours are renewed: those tracked here and those
        holding a key under our prefix. Any other id (another application's lease on
        the same etcd, or a guess) is answered 0 and left alone."""
        out = dict.fromkeys(ids, 0)
        ours = [i for i in ids if i in self._leases or (healthy and i in self._lease_names)]
        unsure = [i for i in ids if i not in self._leases and not (healthy and i in self._lease_names)]
        if unsure:  # not in the mirror (yet: maybe registered at another replica a moment ago)
            held = await self._call(
                "lease check",
                lambda c, rpc: asyncio.gather(*(self._holds_our_keys(c, rpc, i) for i in unsure)),
            )
            ours += [i for i, ok in zip(unsure, held, strict=True) if ok]
        if ours:
            self.forwarded_keep_alives += len(ours)
            replies = await self._call(
                "lease keep-alive",
                lambda c, rpc: asyncio.gather(*(self._renewals.renew(c, rpc, i) for i in ours)),
            )
            out.update(zip(ours, replies, strict=True))
        return out

    async def _holds_our_keys(self, client, rpc, lease_id: int) -> bool:
        """Whether lease ``lease_id`` exists and holds a key under our prefix."""
        try:
            response = await client.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True)
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return response.TTL > 0 and any(key.startswith(self._prefix) for key in response.keys)

    async def revoke_lease(self, lease_id: int) -> None:
        self._untrack(lease_id)
        self._deleting += 1
        try:
            response = await self._call(
                "lease revoke", lambda c, rpc: c.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id))
            )
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                return  # unknown or already expired
            raise
        finally:
            self._deleting -= 1
        self._own_deletes.append(response.header.revision)
        for name in list(self._lease_names.get(lease_id, ())):
            self._wrote(name, response.header.revision)

    async def get(self, name: str) -> AgentRecord | None:
        if self._mirror_serves(name):
            record = self._mirror.get(name)
            if record is not None:
                return _copy(record)
            # Missing: maybe registered at another replica a moment ago, its event not
            # here yet. etcd decides, so that a live name is never reported missing.
        self.etcd_reads += 1
        key = self._key(name)
        response = await self._call("get", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(key=key)))
        return self._decode(response.kvs[0]) if response.kvs else None

    async def get_answers(self, names: Sequence[str]) -> list[bytes | None]:
        # As get() each, but the names the mirror cannot answer are read from etcd
        # GET_ANSWERS_AT_ONCE at a time: a GetAgents call of 64 names etcd must answer costs
        # four reads' time, not 64. The first read that fails cancels the others.
        records: list[AgentRecord | None] = []
        ask: list[int] = []
        for i, name in enumerate(names):
            record = self._mirror.get(name) if self._mirror_serves(name) else None
            records.append(None if record is None else _copy(record))
            if record is None:
                ask.append(i)
        for start in range(0, len(ask), GET_ANSWERS_AT_ONCE):
            chunk = ask[start : start + GET_ANSWERS_AT_ONCE]
            try:
                async with asyncio.TaskGroup() as group:
                    reads = [group.create_task(self.get(names[i])) for i in chunk]
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
            for i, read in zip(chunk, reads, strict=True):
                records[i] = read.result()
        return [None if record is None else encode_answer(record) for record in records]

    async def count(self) -> int:
        # The mirror, and our writes of new names it has not seen yet: approximate (a
        # write of another replica a moment ago is missing), as max_agents is. A count
        # range makes etcd read every key, and it came once per registration of a new
        # name while our writes were in flight: through a whole registration storm.
        # A pending name the mirror holds may be one of our deletes: then etcd counts.
        if self._healthy() and not any(name in self._mirror for name in self._pending):
            return len(self._mirror) + len(self._pending)
        response = await self._call(
            "count", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(
                key=self._prefix, range_end=self._range_end, count_only=True))
        )  # fmt: skip
        return int(response.count)

    async def list_page(self, after: str, limit: int) -> list[AgentRecord]:
        kvs, _ = await self._page(after, limit, 0)
        return [record for record in map(self._decode, kvs) if record is not None]

    async def put_if(self, record: AgentRecord, lease_id: int, expect_revision: int) -> int | None:
        if lease_id <= 0:
            raise StoreError(f"lease {lease_id:#x} does not exist")
        stored = AgentRecord()
        stored.CopyFrom(record)
        stored.lease_id = lease_id
        stored.ClearField("revision")
        value = stored.SerializeToString()
        try:
            response = await self._txn(
                "put", record.name, expect_revision, lambda rpc, key: rpc.RequestOp(
                    request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))
            )  # fmt: skip
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                raise StoreError(f"lease {lease_id:#x} does not exist (expired?)") from e.__cause__
            raise
        if not response.succeeded:
            self._refuted(record.name, response)
            return None
        self._wrote(record.name, response.header.revision)
        lease = self._leases.get(lease_id)
        if lease is not None:
            # Its registrant learns the lease only from the answer to this write: its ttl runs
            # from now, not from the grant. With etcd slow (a storm), the write can come
            # later than the ttl, and the lease was revoked before its first renewal could.
            self._renewed(lease, time.monotonic())
        return response.header.revision

    async def delete_if(self, name: str, expect_revision: int) -> bool:
        if expect_revision <= 0:
            return False  # an absent record cannot be deleted
        self._deleting += 1
        try:
            response = await self._txn(
                "delete", name, expect_revision,
                lambda rpc, key: rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)),
            )  # fmt: skip
        finally:
            self._deleting -= 1
        if not response.succeeded:
            self._refuted(name, response)
            return False
        if not response.responses[0].response_delete_range.deleted:
            return False
        self._own_deletes.append(response.header.revision)
        self._wrote(name, response.header.revision)
        return True

    async def watch_batches(
        self,
        queue_size: int = WATCH_QUEUE_MAX,
        names: Collection[str] | None = None,
        max_events: int = WATCH_BATCH_EVENTS,
        max_bytes: int | None = None,
    ) -> AsyncIterator[EventBatch]:
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, not {max_events}")
        wanted = sorted(set(names)) if names else None

        async def snapshot(after: str, revision: int) -> tuple[list[Any], str, int]:
            """The key-values of the snapshot's next chunk after name ``after``, at
            ``revision`` (0: now); with the chunk's last name ("": the snapshot is
            complete) and the revision read."""
            if wanted is None:
                kvs, read = await self._page(after, PAGE_RECORDS, revision)
                last = kvs[-1].key.removeprefix(self._prefix).decode(errors="replace") if kvs else ""
                return kvs, last, read
            start = bisect.bisect_right(wanted, after) if after else 0
            chunk = wanted[start : start + _TXN_GETS]
            if not chunk:
                return [], "", revision
            # One transaction of gets per chunk: every get of it at one revision, the
            # first chunk's; later chunks read at that revision too.
            keys = [self._key(name) for name in chunk]

            def txn(client, rpc):
                gets = [rpc.RequestOp(request_range=rpc.RangeRequest(key=key, revision=revision))
                        for key in keys]  # fmt: skip
                return client.kvstub.Txn(rpc.TxnRequest(success=gets))

            try:
                response = await self._call("get", txn)
            except StoreError as e:
                if revision and _code(e.__cause__) == "OUT_OF_RANGE":
                    raise WatchLagError(
                        f"etcd compacted its history past {revision} during the snapshot"
                    ) from e
                raise
            kvs = [kv for op in response.responses for kv in op.response_range.kvs]
            return kvs, chunk[-1], revision or response.header.revision

        kvs, after, revision = await snapshot("", 0)
        mirror = asyncio.current_task() is self._mirror_task
        queue = _WatchQueue(queue_size, None if mirror else self._queued_bytes)
        self._watches.add(queue)
        call = task = None
        try:
            call = await self._call("watch", lambda c, rpc: self._open_watch(c, rpc, revision + 1))
            task = asyncio.create_task(self._read_watch(call, queue), name="kvx-etcd-watch")
            while after:
                page = [
                    Event(EventType.PUT, record, kv.mod_revision, len(kv.value))
                    for kv in kvs
                    if (record := self._decode(kv)) is not None
                ]
                for part in split_batch(page, max_events, max_bytes):
                    yield part
                kvs, after, _ = await snapshot(after, revision)
            yield [Event(EventType.SYNCED, None, revision)]
            keep = None if wanted is None else {self._key(name) for name in wanted}
            while True:
                try:
                    response = await asyncio.wait_for(queue.get(), WATCH_IDLE_CHECK_S)
                except TimeoutError:  # a quiet watch: is etcd still there, or hung?
                    if not await self.ready():
                        raise StoreError("etcd stopped answering") from None
                    continue
                # This response's events, and those of the responses already queued behind it.
                batch: list[Event] = []
                size = 0
                while True:
                    if isinstance(response, Exception):
                        if batch:
                            yield batch
                        raise response
                    for event in response.events:
                        if keep is not None and event.kv.key not in keep:
                            if event.type != 0:
                                self._event(event)  # a DELETE still counts toward expired_leases
                            continue
                        if (out := self._event(event)) is not None:
                            batch.append(out)
                            size += out.size
                    if len(batch) >= max_events or (max_bytes and size >= max_bytes) or queue.empty():
                        break
                    response = queue.get_nowait()
                for part in split_batch(batch, max_events, max_bytes):
                    yield part
        finally:
            self._watches.discard(queue)
            queue.forget()
            if task is not None:
                task.cancel()
            if call is not None:
                call.cancel()

    # The read mirror.

    @property
    def mirror_synced(self) -> bool:
        """True while gets are answered from the watch-fed mirror."""
        return self._healthy()

    def _healthy(self) -> bool:
        """Connected, and the mirror's watch is live: what this replica knows is current."""
        return self._client is not None and self._mirror_synced

    def _mirror_serves(self, name: str) -> bool:
        return self._mirror_synced and self._client is not None and name not in self._pending

    def _wrote(self, name: str, revision: int) -> None:
        """Our own write of ``name`` at ``revision``: until the mirror has seen it, reads
        of that name go to etcd (a get right after our put_if/delete_if must see it)."""
        if revision <= self._mirror_revision and self._mirror_synced:
            return
        self._pend(name, revision)

    def _refuted(self, name: str, response) -> None:
        """A put_if/delete_if of ``name`` failed its compare: the caller's revision,
        most often from a get answered by the mirror, is not etcd's. If the mirror lags
        behind etcd for that name (another replica changed it), reads of it go to etcd
        until the mirror has seen that change: the caller's retry (a get, then the write
        again) must not meet the same stale record every time."""
        kvs = response.responses[0].response_range.kvs if response.responses else ()
        if kvs:
            self._wrote(name, kvs[0].mod_revision)  # nothing to do if the mirror has that revision
        elif (held := self._mirror.get(name)) is not None and held.revision < response.header.revision:
            # Deleted in etcd, still in the mirror: its DELETE is newer than the record held.
            # (A record newer than the failed compare was made after it: the mirror is ahead.)
            self._pend(name, held.revision + 1)

    def _pend(self, name: str, revision: int) -> None:
        """Reads of ``name`` go to etcd until the mirror sees a change of it at ``revision`` or later."""
        if len(self._pending) >= PENDING_WRITES_MAX:  # the mirror does not keep up: reload it
            self._mirror_synced = False
            self._pending.clear()
            return
        self._pending[name] = max(revision, self._pending.get(name, 0))

    async def _mirror_loop(self) -> None:
        self._mirror_task = asyncio.current_task()  # its watches are not bounded in bytes
        backoff_s = 0.2
        while True:
            loaded: dict[str, AgentRecord] = {}
            events: Any = self.watch(MIRROR_QUEUE_RESPONSES)  # an async generator: aclose() below
            try:
                async for event in events:
                    if event.type is EventType.SYNCED:
                        self._mirror, loaded = loaded, {}
                        self._lease_names = {}
                        for name, record in self._mirror.items():
                            self._lease_names.setdefault(record.lease_id, set()).add(name)
                        self._mirror_revision = event.revision
                        self._pending = {n: r for n, r in self._pending.items() if r > event.revision}
                        self._mirror_synced = True
                        backoff_s = 0.2
                        logger.info("etcd read mirror synced: %d records", len(self._mirror))
                    elif not self._mirror_synced and self._mirror_revision:
                        raise StoreError("too many of our writes were not seen yet: reloading")
                    elif self._mirror_synced:
                        self._apply(event)
                    elif event.record is not None:  # the snapshot, a page at a time
                        loaded[event.record.name] = event.record
            except StoreError as e:  # etcd went away, or the mirror fell behind: load again
                logger.info("etcd read mirror stopped (%s); reads go to etcd until it is back", e)
            except Exception:  # noqa: BLE001 - a bug here must not end the mirror for good
                logger.exception("etcd read mirror failed; loading it again")
            finally:
                await events.aclose()
                self._mirror_synced = False
                self._mirror, self._mirror_revision, self._lease_names = {}, 0, {}
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, 2.0)

    def _apply(self, event: Event) -> None:
        record = event.record
        assert record is not None  # PUT or DELETE
        old = self._mirror.pop(record.name, None)
        if old is not None:
            names = self._lease_names.get(old.lease_id)
            if names is not None:
                names.discard(record.name)
                if not names:
                    del self._lease_names[old.lease_id]
        if event.type is EventType.PUT:
            self._mirror[record.name] = record
            self._lease_names.setdefault(record.lease_id, set()).add(record.name)
            gone = old.lease_id if old is not None and old.lease_id != record.lease_id else 0
        else:
            gone = record.lease_id
        if gone:  # the lease's record went (unregistered, evicted, replaced): ask etcd at its next renewal
            self._untrack(gone)
        self._mirror_revision = max(self._mirror_revision, event.revision)
        if self._pending.get(record.name, math.inf) <= event.revision:
            del self._pending[record.name]

    # Leases tracked at this replica.

    def _track(self, lease_id: int, ttl_s: int, etcd_ttl_s: int, now: float, *, takeover: bool):
        if lease_id not in self._leases and len(self._leases) >= LEASES_TRACKED_MAX:
            return None
        lease = TrackedLease(lease_id, ttl_s, etcd_ttl_s, now)
        if takeover:
            lease.take_over(now, TAKEOVER_EXTRA_S)
        self._untrack(lease_id)
        self._leases[lease_id] = lease
        self._renewed(lease, now)
        return lease

    def _renewed(self, lease: TrackedLease, now: float) -> None:
        lease.renewed = now
        lease.deadline = now + lease.ttl_s
        self._schedule(lease, math.ceil(lease.deadline + EXPIRY_GRACE_S))

    def _schedule(self, lease: TrackedLease, due: int) -> None:
        if due == lease.due:
            return
        self._unschedule(lease)
        self._due.setdefault(due, set()).add(lease.lease_id)
        lease.due = due

    def _unschedule(self, lease: TrackedLease) -> None:
        bucket = self._due.get(lease.due)
        if bucket is not None:
            bucket.discard(lease.lease_id)
            if not bucket:
                del self._due[lease.due]
        lease.due = 0

    def _untrack(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._unschedule(lease)

    def _forwarded(self, lease_id: int, etcd_ttl_s: int, sent: float, replied: float) -> int:
        """etcd answered a forwarded renewal with ``etcd_ttl_s``: the kvx ttl to answer."""
        if etcd_ttl_s <= 0:
            self._untrack(lease_id)
            return 0
        lease = self._leases.get(lease_id)
        if lease is None:
            lease = self._track(
                lease_id, self._kvx_ttl(lease_id, etcd_ttl_s), etcd_ttl_s, sent, takeover=True
            )
            if lease is None:
                return self._kvx_ttl(lease_id, etcd_ttl_s)
        lease.etcd_ttl_s = etcd_ttl_s
        lease.forwarded = replied  # etcd reset the lease before this: the expiry check relies on it
        self._renewed(lease, sent)
        return lease.ttl_s

    def _kvx_ttl(self, lease_id: int, etcd_ttl_s: int) -> int:
        ttl_s = (lease_id >> 1) & _TTL_MASK
        # Only ids we grant carry a ttl (and the mark): ids of an older kvx (whose etcd
        # ttl was the kvx ttl) do not, nor does a lease granted with another backstop
        # (its etcd ttl is not max(ttl, backstop)): the etcd ttl is the kvx ttl then,
        # never shorter than the agent renews at.
        if lease_id & _TTL_MARK and 0 < ttl_s <= etcd_ttl_s and etcd_ttl_s in (ttl_s, self._backstop_s):
            return ttl_s
        return etcd_ttl_s

    async def _compact_loop(self) -> None:
        """Every compact_every_s: compact etcd up to the revision read one period
        before (see the module docstring). A failure is logged and tried again
        next period; the next revision is read either way."""
        previous = 0
        while True:
            await asyncio.sleep(self._compact_every_s)
            try:
                status = await self._call(
                    "status", lambda c, rpc: c.maintenancestub.Status(rpc.StatusRequest())
                )
            except StoreError as e:
                logger.info("could not read etcd's revision to compact its history: %s", e)
                continue
            revision = int(status.header.revision)
            if revision < max(self.compacted_revision, previous):  # etcd lost or restored its data
                self.compacted_revision = previous = 0
            if previous > self.compacted_revision:
                try:
                    await self._call(
                        "compact",
                        lambda c, rpc, r=previous: c.kvstub.Compact(rpc.CompactionRequest(revision=r)),
                    )
                    self.compacted_revision = previous
                    logger.debug("compacted etcd's history up to revision %d", previous)
                except StoreError as e:
                    if _code(e.__cause__) == "OUT_OF_RANGE":  # compacted past it already (another replica)
                        self.compacted_revision = previous
                    else:
                        logger.warning("could not compact etcd's history: %s", e)
            previous = revision

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            now = time.monotonic()
            due: list[int] = []
            while self._next_due <= now:
                due.extend(self._due.pop(self._next_due, ()))
                self._next_due += 1
            for start in range(0, len(due), EXPIRY_CHECKS_MAX):
                await asyncio.gather(*(self._check(i) for i in due[start : start + EXPIRY_CHECKS_MAX]))

    async def _check(self, lease_id: int) -> None:
        """A tracked lease's kvx deadline passed unrenewed here: did it move to another
        replica (then stop tracking it) or is its agent gone (then revoke it)?"""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        lease.due = 0  # its bucket was taken
        sent = time.monotonic()
        if sent < lease.deadline + EXPIRY_GRACE_S:
            self._renewed(lease, lease.renewed)  # not due after all: schedule it again
            return
        try:
            response = await self._call(
                "lease ttl",
                lambda c, rpc: c.leasestub.LeaseTimeToLive(
                    rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True)
                ),
            )
            remaining_s, granted_s = int(response.TTL), int(response.grantedTTL)
            ours = any(key.startswith(self._prefix) for key in response.keys)
        except StoreError as e:
            if _code(e.__cause__) != "NOT_FOUND":
                if self._leases.get(lease_id) is lease and not lease.due:
                    self._schedule(lease, math.ceil(time.monotonic()) + 1)  # etcd is away: ask again
                return
            remaining_s = granted_s = -1
            ours = False
        if self._leases.get(lease_id) is not lease or lease.deadline + EXPIRY_GRACE_S > time.monotonic():
            return  # renewed here meanwhile
        self._untrack(lease_id)
        if remaining_s <= 0:
            return  # gone already
        if not ours:  # none of our keys (any more): never revoke what may be another's
            logger.debug("%s holds no record; left to its etcd ttl", self._label(lease_id))
            return
        # Nobody else renewed it since our last forward: etcd's remaining time is at
        # most this (truncated, and etcd reset it before our forward's reply came).
        if remaining_s > granted_s - (sent - lease.forwarded):
            logger.debug("%s is renewed at another replica now", self._label(lease_id))
            return
        logger.info("%s expired", self._label(lease_id))
        self.expired_leases += 1  # before its records' DELETE events reach any watcher
        try:
            await self.revoke_lease(lease_id)
        except StoreError as e:
            logger.warning("could not revoke expired %s (%s); asking again", self._label(lease_id), e)
            self.expired_leases -= 1
            self._leases.setdefault(lease_id, lease)
            self._schedule(lease, math.ceil(time.monotonic()) + 1)

    def _label(self, lease_id: int) -> str:
        """A lease for the logs: its records' names, or a tag; never its id (a lease
        id is its holder's proof: whoever reads it could take the holder's names)."""
        names = sorted(self._lease_names.get(lease_id, ()))
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            return f"the lease of {', '.join(map(repr, names[:3]))}{more}"
        tag = hashlib.blake2s(lease_id.to_bytes(8, "little", signed=True), digest_size=4).hexdigest()
        return f"lease tag {tag}"

    # Internals.

    async def _call(self, what: str, fn):
        """``await fn(client, rpc)`` within timeout_s, connecting first if need be;
        aetcd/gRPC errors and timeouts become StoreError."""
        if self._aetcd is None:
            raise StoreError("the etcd store is not started")
        client = None
        try:
            async with asyncio.timeout(self._timeout_s):
                client = await self._connect()
                return await fn(client, self._aetcd.rpc)
        except TimeoutError as e:
            error: BaseException = e
            message = f"etcd did not answer ({what}) within {self._timeout_s:g} s"
        except (self._aetcd.ClientError, grpc.RpcError) as e:
            error = e.__cause__ if isinstance(e, self._aetcd.ClientError) and e.__cause__ else e
            message = f"etcd {what} failed: {_details(error)}"
            if _code(error) not in _TRANSIENT:
                raise StoreError(message) from error
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # we are cancelled (or timed out: the timeout above turns that into TimeoutError)
            # The call was cancelled under us: another call dropped this connection.
            raise StoreError(f"{self._dropped_for} (the etcd connection was dropped during {what})") from e
        if client is not None and client is self._client:
            self._client = None  # the next call connects again, maybe to another endpoint
            self._dropped_for = message
            task = asyncio.ensure_future(_close_quietly(client))  # this ends its watches
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        raise StoreError(message) from error

    async def _connect(self):
        async with self._connect_lock:
            if self._client is not None:
                return self._client
            errors, last = [], None
            for host, port in self._endpoints:
                client = self._aetcd.Client(host, port, options=self._channel_options)
                try:
                    await client.connect()  # only makes the channel: ask for the status to know
                    async with asyncio.timeout(self._timeout_s / len(self._endpoints)):
                        await _status(client, self._aetcd.rpc)
                except (TimeoutError, self._aetcd.ClientError, grpc.RpcError) as e:
                    errors.append(f"{host}:{port}: {_details(e)}")
                    last = e
                    await _close_quietly(client)
                    continue
                self._client = client
                return client
            raise StoreError("no etcd endpoint answers: " + "; ".join(errors)) from last

    async def _txn(self, what: str, name: str, expect_revision: int, op):
        key = self._key(name)

        def txn(client, rpc):
            compare = rpc.Compare(
                key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=expect_revision
            )
            # On a failed compare, the key's revision now: see _refuted.
            failure = rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True))
            return client.kvstub.Txn(
                rpc.TxnRequest(compare=[compare], success=[op(rpc, key)], failure=[failure])
            )

        return await self._call(what, txn)

    def _cut_off_largest(self) -> None:
        """The clients' watches hold more than WATCH_QUEUE_BYTES_TOTAL: cut off the one
        holding the most (the one furthest behind, not the one that happens to add next)."""
        counted = [q for q in self._watches if isinstance(q, _WatchQueue) and q.counted]
        if counted:
            largest = max(counted, key=lambda q: q.bytes)
            total = self._queued_bytes[0]
            _cut_off(
                largest,
                WatchLagError(
                    f"the watches hold {total} bytes of changes not yet read (at most "
                    f"{WATCH_QUEUE_BYTES_TOTAL} in all); this one, {largest.bytes} of them, is furthest behind"
                ),
            )
            largest.forget()  # counts nothing more; its consumer ends it
            largest.cut = True  # and its reader queues nothing more (_read_watch)

    async def _open_watch(self, client, rpc, start_revision: int):
        create = rpc.WatchCreateRequest(
            key=self._prefix, range_end=self._range_end, start_revision=start_revision, prev_kv=True
        )

        ended = asyncio.Event()

        async def requests():
            yield rpc.WatchRequest(create_request=create)
            await ended.wait()  # keep our side of the stream open while the call lives

        # hasleader: etcd ends the watch if its member loses the cluster leader.
        call = rpc.WatchStub(client.channel).Watch(requests(), metadata=(("hasleader", "true"),))
        # gRPC's task that sends these requests is cancelled by call.cancel() only
        # while the call lives: once etcd ended it (etcd gone, a leader lost), it
        # would wait in requests() for good, one task more for every reconnection.
        call.add_done_callback(lambda _call: ended.set())
        try:
            created = await call.read()
        except BaseException:
            # Cancelled (the watcher left, the timeout) or failed before etcd answered:
            # the call must end here. Dropped alive, etcd would keep its watch, and the
            # task sending requests() would wait for good, until garbage collection
            # destroys it pending (the soak saw that after a client's watch was cancelled).
            call.cancel()
            raise
        if created is _EOF or not created.created or created.canceled:
            call.cancel()
            raise StoreError(f"etcd refused the watch: {getattr(created, 'cancel_reason', '') or 'ended'}")
        return call

    async def _read_watch(self, call, queue: _WatchQueue) -> None:
        try:
            while (response := await call.read()) is not _EOF:
                if queue.cut:  # cut off by another watch's reader: hold nothing more for it
                    call.cancel()
                    return
                if response.compact_revision:
                    raise WatchLagError(f"etcd compacted its history past {response.compact_revision}")
                if response.canceled:
                    raise StoreError(f"etcd cancelled the watch: {response.cancel_reason or 'no reason'}")
                if queue.full():  # the consumer does not keep up: cut it off, hold nothing more for it
                    raise WatchLagError(f"the watch fell {queue.maxsize} etcd responses behind")
                if queue.over():
                    raise WatchLagError(
                        f"the watch fell {queue.bytes} bytes of changes behind (at most {WATCH_QUEUE_BYTES})"
                    )
                if self._queued_bytes[0] > WATCH_QUEUE_BYTES_TOTAL:
                    self._cut_off_largest()
                if queue.cut:  # cut off for the total (maybe now): hold nothing more for it
                    call.cancel()
                    return
                queue.put_nowait(response)
            error: Exception = StoreError("etcd ended the watch")
        except StoreError as e:
            error = e
        except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - CancelledError: channel closed
            error = StoreError(f"the etcd watch failed: {_details(e)}")
            error.__cause__ = e
        if queue in self._watches:
            _cut_off(queue, error)

    async def _page(self, after: str, limit: int, revision: int):
        """Up to ``limit`` key-values after the key of name ``after``, at ``revision``
        (0: the latest); with the revision read."""
        start = self._key(after) + b"\0" if after else self._prefix
        try:
            response = await self._call(
                "range", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(
                    key=start, range_end=self._range_end, limit=limit, revision=revision,
                    sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY))
            )  # fmt: skip
        except StoreError as e:
            if revision and _code(e.__cause__) == "OUT_OF_RANGE":  # compacted while paging
                raise WatchLagError(f"etcd compacted its history past {revision} during the snapshot") from e
            raise
        return list(response.kvs), response.header.revision

    def _event(self, event) -> Event | None:
        if event.type == 0:  # PUT
            record = self._decode(event.kv)
            return (
                None
                if record is None
                else Event(EventType.PUT, record, event.kv.mod_revision, len(event.kv.value))
            )
        revision = event.kv.mod_revision
        record = self._decode(event.prev_kv) if event.prev_kv.key else None
        if record is None:  # no previous value (compacted): the name is all there is
            record = AgentRecord(name=event.kv.key.removeprefix(self._prefix).decode(errors="replace"))
        if revision not in self._own_deletes and revision not in self._counted and not self._deleting:
            self._counted.append(revision)
            self.expired_leases += 1
        return Event(EventType.DELETE, record, revision, len(event.prev_kv.value))

    def _key(self, name: str) -> bytes:
        return self._prefix + name.encode()

    def _decode(self, kv) -> AgentRecord | None:
        record = AgentRecord()
        try:
            record.ParseFromString(kv.value)
        except Exception:  # noqa: BLE001 - a foreign value under our prefix
            logger.warning("ignoring etcd key %r: its value is not an AgentRecord", kv.key)
            return None
        record.revision = kv.mod_revision
        record.lease_id = kv.lease
        return record


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix.rstrip(b"\xff"))
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


async def _status(client, rpc) -> bool:
    await client.maintenancestub.Status(rpc.StatusRequest())
    return True


class _WatchQueue(asyncio.Queue):
    """One watch's etcd responses, with their bytes counted: its own, and with
    ``totals`` (a one-item list shared by the clients' watches) all of theirs
    together; the mirror's (``totals`` None) are not counted."""

    def __init__(self, maxsize: int, totals: list[int] | None) -> None:
        super().__init__(maxsize)
        self.bytes = 0
        self._sizes: collections.deque[int] = collections.deque()
        self._totals = totals
        self.cut = False  # cut off by another watch's reader (_cut_off_largest)

    def over(self) -> bool:
        """A counted watch holding more than WATCH_QUEUE_BYTES: cut it off."""
        return self._totals is not None and self.bytes > WATCH_QUEUE_BYTES

    @property
    def counted(self) -> bool:
        return self._totals is not None

    def forget(self) -> None:
        """The watch ended: what it still holds no longer counts."""
        if self._totals is not None:
            self._totals[0] -= self.bytes
        self.bytes = 0
        self._sizes.clear()
        self._totals = None

    def _put(self, item: Any) -> None:
        size = item.ByteSize() if self._totals is not None and not isinstance(item, Exception) else 0
        self._sizes.append(size)
        self.bytes += size
        if self._totals is not None:
            self._totals[0] += size
        super()._put(item)

    def _get(self) -> Any:
        size = self._sizes.popleft() if self._sizes else 0
        self.bytes -= size
        if self._totals is not None:
            self._totals[0] -= size
        return super()._get()


def _cut_off(queue: asyncio.Queue, error: Exception) -> None:
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(error)


def _code(error) -> str | None:
    return error.code().name if isinstance(error, grpc.aio.AioRpcError) else None


def _details(error) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name  # details() is None when the server sent none
    return str(error) or type(error).__name__


async def _close_quietly(client) -> None:
    try:
        async with asyncio.timeout(2):
            await client.close()
    except Exception:  # noqa: BLE001
        logger.debug("closing an etcd client failed", exc_info=True)


def _copy(record: AgentRecord) -> AgentRecord:
    out = AgentRecord()
    out.CopyFrom(record)
    return out
