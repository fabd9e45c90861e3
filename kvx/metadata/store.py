"""Where the metadata service keeps agent records: the interface and the
embedded in-memory store. ``EtcdStore`` (``etcd.py``) implements the same
interface on etcd, so that several service replicas share one cluster state.

Records are ``kvx.v1.AgentRecord`` messages keyed by agent name, each
attached to a lease; a lease that is not renewed expires and takes its
records with it. Every change gets a store-wide revision (etcd's own, or a
counter here), which also serves compare-and-set writes.

Everything here is asyncio, run on the metadata service's event loop.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import contextlib
import dataclasses
import enum
import heapq
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Collection, Sequence

from kvx.errors import KvxError
from kvx.v1 import metadata_pb2

logger = logging.getLogger(__name__)

AgentRecord = metadata_pb2.AgentRecord

# A watcher that falls this far behind is cut off (it resynchronises); the
# service passes its own bound (ServiceLimits.watch_queue_events).
WATCH_QUEUE_MAX = 1000
# The most events ``Store.watch_batches`` hands over at once: what a watcher
# reading a storm takes per step (and the service sends per message, up to its
# byte bound) without holding the event loop long. At most the proto's bound on
# events per WatchAgentsResponse (kvx.metadata.client.WATCH_BATCH_EVENTS_MAX).
WATCH_BATCH_EVENTS = 512
# A memory-store watch that cannot take a change now (it is reading its snapshot,
# or its queue of changes is full: it reads more slowly than changes come) keeps
# the latest change of each name instead, sent, oldest first, once it reads on:
# its view ends the same, and a storm of registrations does not cut off a read
# replica. Bounded per watch (names), over all watches (names, and record bytes
# counted per watch: the watch keeping the most is cut off first), and in time
# (a lagging watch that has taken nothing for WATCH_STALL_S is cut off, so that
# a client that stops reading holds nothing for long). A cut-off watch gets
# WatchLagError, as etcd's do.
COALESCE_NAMES_MAX = 100_000
COALESCE_TOTAL_MAX = 1_000_000
COALESCE_BYTES_MAX = 512 << 20
WATCH_STALL_S = 15.0
# A pass of MemoryStore's expiry loop that starts this much later than planned
# means the service's event loop was stalled (a registration storm, a long
# collection of garbage): the time beyond it does not count against leases.
STALL_S = 0.5
# Records per page of a watch's initial snapshot and of ``list()``: no watch or
# listing ever holds a copy of the whole registry.
PAGE_RECORDS = 100


class StoreError(KvxError):
    """The store failed or is unreachable (etcd down); callers may retry.

    Its words are the service's log's, not its callers' (they may name etcd's
    endpoints), unless ``shown_to_callers``."""

    shown_to_callers = False


class StaleCopyError(StoreError):
    """A read replica's copy of the primary is not fresh: it says which primary,
    which every caller may know (the replica names it when it refuses a write)."""

    shown_to_callers = True


class WatchLagError(StoreError):
    """A watcher fell too far behind and was cut off; watch again."""


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"
    SYNCED = "synced"  # the initial snapshot is complete


@dataclasses.dataclass(frozen=True)
class Event:
    type: EventType
    record: AgentRecord | None  # for DELETE: the record as it was
    revision: int
    # The record's bytes, about as sent (0: not known): what bounds a watch's batch.
    size: int = dataclasses.field(default=0, compare=False)
    # Wire encodings of this event, made by the first watcher that sends it and
    # reused by every other one (the stores hand one Event to all their watchers).
    encoded: dict[int, bytes] = dataclasses.field(default_factory=dict, compare=False, repr=False)


# What Store.watch_batches hands over at once (``list`` is a Store method's name).
EventBatch = list[Event]


def split_batch(events: list[Event], max_events: int, max_bytes: int | None) -> list[EventBatch]:
    """``events`` in lists of at most ``max_events``, each ending once its records
    reach ``max_bytes`` (Event.size), none empty."""
    out: list[EventBatch] = []
    batch: EventBatch = []
    size = 0
    for event in events:
        batch.append(event)
        size += event.size
        if len(batch) >= max_events or (max_bytes and size >= max_bytes):
            out.append(batch)
            batch, size = [], 0
    if batch:
        out.append(batch)
    return out


class Store(abc.ABC):
    """The storage verbs the metadata service needs."""

    name: str
    # Whether count_by_role answers from counts kept as records come and go (cheap), or
    # reads every record (the default below): /metrics then counts at most every so often.
    counts_kept = False

    async def start(self) -> None:
        """Connect and start background work."""

    async def close(self) -> None:
        """Stop background work and disconnect."""

    @abc.abstractmethod
    async def ready(self) -> bool:
        """True when the store answers (for /readyz and gRPC health)."""

    def refuse_writes(self) -> None:
        """Raises ``Refused`` where this store takes no writes (a read replica,
        ``mirror.py``); the service calls it before a registration, a renewal or
        an unregistration."""

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease id, expiring ttl_s seconds from now unless renewed."""

    @abc.abstractmethod
    async def keep_alive(self, lease_id: int) -> int:
        """Renew a lease; its remaining ttl in seconds, 0 if it is gone."""

    async def keep_alive_many(self, lease_ids: Sequence[int]) -> list[int]:
        """Renew several leases: their remaining ttls, in order (0: gone). Stores
        override it where renewing several together is cheaper than one by one."""
        return [await self.keep_alive(lease_id) for lease_id in lease_ids]

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """End a lease now; its records are deleted. Unknown ids are ignored."""

    @abc.abstractmethod
    async def get(self, name: str) -> AgentRecord | None:
        """The record, with ``revision`` set to its last change; None if absent."""

    async def get_answer(self, name: str) -> bytes | None:
        """The encoded ``GetAgentResponse`` for ``name``, its lease id left out (the
        registrant's secret); None if absent. GetAgent sends these bytes as they are.
        This default encodes ``get()``'s copy per call; a store that keeps each
        record's answer encoded from its write on (MemoryStore) hands that out."""
        record = await self.get(name)
        return None if record is None else encode_answer(record)

    async def get_answers(self, names: Sequence[str]) -> list[bytes | None]:
        """``get_answer`` of each of ``names`` (GetAgents), in order. This default asks
        one after another: right for stores that answer from memory without waiting."""
        return [await self.get_answer(name) for name in names]

    @abc.abstractmethod
    async def lease_ttl(self, lease_id: int) -> int:
        """A lease's remaining time to live in whole seconds (rounded up), without
        renewing it; 0 if it is gone or expired."""

    async def held_ttl(self, lease_id: int) -> tuple[int, int]:
        """``lease_ttl``, and where that time comes from: 0 when this store renews
        the lease itself and knows its deadline (the time then grows only when the
        lease's holder renews it); else the etcd raft term in which etcd's remaining
        time for it was read (a lease renewed at another replica, at none, or here
        past the most leases a replica tracks). A new etcd leader, a new term, sets
        every lease's time back to its full etcd ttl, renewed or not."""
        return await self.lease_ttl(lease_id), 0

    @abc.abstractmethod
    async def count(self) -> int:
        """How many records there are."""

    async def record_bytes(self) -> int | None:
        """The records' encoded bytes, in all; None where the store does not count
        them (etcd bounds its own size: --quota-backend-bytes)."""
        return None

    async def count_by_role(self) -> dict[int, int]:
        """How many records there are of each role (``Role`` values; absent: none).
        Read a page at a time here; stores that can keep the counts override it."""
        counts: dict[int, int] = {}
        after = ""
        while page := await self.list_page(after, PAGE_RECORDS):
            for record in page:
                counts[record.role] = counts.get(record.role, 0) + 1
            after = page[-1].name
        return counts

    @abc.abstractmethod
    async def list_page(self, after: str, limit: int) -> list[AgentRecord]:
        """Up to ``limit`` records whose names sort after ``after`` ("" for the
        first), sorted by name. Copies only those records."""

    async def list(self) -> list[AgentRecord]:
        """Every record, sorted by name, read a page at a time. For tests and
        tools: the service itself never holds the whole registry at once."""
        out: list[AgentRecord] = []
        after = ""
        while page := await self.list_page(after, PAGE_RECORDS):
            out.extend(page)
            after = page[-1].name
        return out

    @abc.abstractmethod
    async def put_if(self, record: AgentRecord, lease_id: int, expect_revision: int) -> int | None:
        """Write ``record`` under ``lease_id`` if the name's current revision is
        ``expect_revision`` (0: absent). The new revision, or None on conflict."""

    @abc.abstractmethod
    async def delete_if(self, name: str, expect_revision: int) -> bool:
        """Delete if the current revision is ``expect_revision``; True if deleted."""

    @abc.abstractmethod
    def watch_batches(
        self,
        queue_size: int = WATCH_QUEUE_MAX,
        names: Collection[str] | None = None,
        max_events: int = WATCH_BATCH_EVENTS,
        max_bytes: int | None = None,
    ) -> AsyncIterator[EventBatch]:
        """The events of ``watch``, in order, in lists of 1 to ``max_events``:
        whatever is ready when the watcher reads is handed over in one list (a
        snapshot's page, the changes that came while it sent the last list), so
        that a watcher behind a storm pays its per-message cost once per list,
        not once per change. Nothing waits for a list to fill. With
        ``max_bytes``, a list ends once its records (``Event.size``) reach that
        many bytes: what a stalled watcher holds, and how long it may take to
        send one list, stay bounded as one message is."""

    async def watch(
        self, queue_size: int = WATCH_QUEUE_MAX, names: Collection[str] | None = None
    ) -> AsyncIterator[Event]:
        """A PUT per current record, one SYNCED, then every change in order.

        The current records are read a page at a time (PAGE_RECORDS), never
        as one copy of the registry. With ``names`` (not empty), only the
        records of those names: the snapshot reads each of them by name, and
        only their changes follow. Raises StoreError if the store goes away,
        or WatchLagError when the consumer falls too far behind: ``queue_size``
        watch responses (etcd); on the memory store, past ``queue_size``
        changes (and while the snapshot is read) the latest change of each name
        is kept instead, oldest first, up to the COALESCE_* bounds and
        WATCH_STALL_S; or etcd compacted past its place. The caller watches
        again to resynchronise. Revisions only grow per name: compare them, do
        not count them.
        """
        batches = self.watch_batches(queue_size, names)
        try:
            async for batch in batches:
                for event in batch:
                    yield event
        finally:
            close = getattr(batches, "aclose", None)
            if close is not None:  # now, not when the collector finds it
                await close()


class _WatchQueue(asyncio.Queue):
    """One memory-store watch: its queue of changes, and while ``pending`` is not None
    (its snapshot is being read, or it fell a full queue behind), the latest change of
    each name, with its record's bytes, oldest first. ``taken_at``: when its reader
    last took an event; ``error``: why it was cut off."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.pending: dict[str, tuple[Event, int]] | None = {}
        self.taken_at = time.monotonic()
        self.error: Exception | None = None


class MemoryStore(Store):
    """Everything in this process: nothing to install, nothing survives a restart.

    Agents re-register by themselves when the service comes back, so a
    restart costs a few seconds of lookups, not the cluster's state.
    """

    name = "memory"
    counts_kept = True

    def __init__(self, *, expiry_interval_s: float = 0.1) -> None:
        # A registry of 100,000 agents is kept in containers that Python's cycle
        # collector does not track: bytes, ints, and dicts and tuples of those.
        # A message or object per agent would be 300,000 objects that every full
        # collection walks (200-500 ms on the event loop that answers lookups).
        # Each record, encoded as stored (lease id and revision set, map entries in
        # key order); read back into a message only for the few that are asked for.
        self._records: dict[str, bytes] = {}
        # name -> (revision, lease id, role) of its record: what writes and counts need.
        self._meta: dict[str, tuple[int, int, int]] = {}
        self._names: list[str] = []  # the keys of _records, sorted: pages without sorting
        # The revision that created each record (etcd's create_revision): a watch's
        # snapshot of every name leaves out those created after the watch began.
        self._created: dict[str, int] = {}
        # Each record's GetAgent answer, encoded when it is written; replaced or
        # dropped in the same step as the record, so never older than it.
        self._answers: dict[str, bytes] = {}
        self._by_role: dict[int, int] = {}  # records of each role
        self._bytes = 0  # the records' encoded bytes (as stored, with lease id and revision)
        # Each lease: its deadline on the lease clock, its ttl, and its names. A tuple
        # (untracked, unlike a set, or a dict from Python 3.14 on), made anew when a
        # name comes or goes: the service grants a lease per registration, so it
        # holds one name, or none.
        self._deadlines: dict[int, float] = {}
        self._ttls: dict[int, int] = {}
        self._lease_names: dict[int, tuple[str, ...]] = {}
        # (deadline, lease id) for the expiry loop, one entry per lease: a renewal only moves
        # the lease's own deadline, and the loop pushes the entry again, later, when it pops one
        # whose lease was renewed meanwhile. So a pass looks only at entries that fell due,
        # not at every lease. Revoked leases leave entries behind until they fall due or the
        # heap is rebuilt (_compact_expiry_heap).
        self._expiry_heap: list[tuple[float, int]] = []
        self._revision = 0
        self._watchers: set[_WatchQueue] = set()  # every watch, to close them
        self._watch_all: set[_WatchQueue] = set()  # watches of every name
        self._watch_names: dict[str, set[_WatchQueue]] = {}  # name -> watches of it
        # Changes kept by lagging watches (_WatchQueue.pending), and their records' bytes.
        self._pending_total = 0
        self._pending_bytes = 0
        self._expiry_interval_s = expiry_interval_s
        self._expiry_task: asyncio.Task | None = None
        self.expired_leases = 0  # for metrics
        # Seconds the event loop was stalled past STALL_S, summed: the lease clock
        # (_now) stands still for them, so that no lease runs out because the
        # service was too busy to read its renewal.
        self.stalled_s = 0.0
        self._stall_warned = -math.inf
        self.expiry_checks = 0  # heap entries the expiry loop looked at: its work, for tests

    async def start(self) -> None:
        self._expiry_task = asyncio.create_task(self._expire_loop(), name="kvx-lease-expiry")

    async def close(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        for queue in list(self._watchers):
            self._cut_off(queue, StoreError("the metadata store is closing"))

    async def ready(self) -> bool:
        return True

    async def grant_lease(self, ttl_s: int) -> int:
        # Random, not counted: after a restart no old lease id names a new lease.
        lease_id = secrets.randbits(62) | 1
        while lease_id in self._deadlines:
            lease_id = secrets.randbits(62) | 1
        deadline = self._now() + ttl_s
        self._deadlines[lease_id] = deadline
        self._ttls[lease_id] = ttl_s
        self._lease_names[lease_id] = ()
        heapq.heappush(self._expiry_heap, (deadline, lease_id))
        if len(self._expiry_heap) > 2 * len(self._deadlines) + 1024:
            self._compact_expiry_heap()
        return lease_id

    async def keep_alive(self, lease_id: int) -> int:
        return self._renew(lease_id, self._now())

    async def keep_alive_many(self, lease_ids: Sequence[int]) -> list[int]:
        # No await per lease: a batch is one step of the event loop.
        now = self._now()
        return [self._renew(lease_id, now) for lease_id in lease_ids]

    def _renew(self, lease_id: int, now: float) -> int:
        deadline = self._deadlines.get(lease_id)
        if deadline is None or deadline <= now:
            # Past its deadline it is over, though the expiry loop has not deleted it yet:
            # lease_ttl says 0 already, and register() counts the name as free.
            return 0
        ttl_s = self._ttls[lease_id]
        self._deadlines[lease_id] = now + ttl_s
        return ttl_s

    async def revoke_lease(self, lease_id: int) -> None:
        if self._deadlines.pop(lease_id, None) is not None:
            del self._ttls[lease_id]
            for name in sorted(self._lease_names.pop(lease_id)):
                self._delete(name)

    async def lease_ttl(self, lease_id: int) -> int:
        deadline = self._deadlines.get(lease_id)
        if deadline is None:
            return 0
        return max(0, math.ceil(deadline - self._now()))

    async def get(self, name: str) -> AgentRecord | None:
        encoded = self._records.get(name)
        return AgentRecord.FromString(encoded) if encoded is not None else None

    async def get_answer(self, name: str) -> bytes | None:
        return self._answers.get(name)

    async def count(self) -> int:
        return len(self._records)

    async def record_bytes(self) -> int | None:
        return self._bytes

    async def count_by_role(self) -> dict[int, int]:
        # Kept as records come and go: a /metrics scrape of 100,000 agents must not copy
        # them all on the event loop that answers lookups.
        return {role: n for role, n in self._by_role.items() if n}

    async def list_page(self, after: str, limit: int) -> list[AgentRecord]:
        start = bisect.bisect_right(self._names, after) if after else 0
        return [AgentRecord.FromString(self._records[name]) for name in self._names[start : start + limit]]

    async def put_if(self, record: AgentRecord, lease_id: int, expect_revision: int) -> int | None:
        name = record.name
        current = self._meta.get(name)
        if (current[0] if current is not None else 0) != expect_revision:
            return None
        if lease_id not in self._lease_names:
            raise StoreError(f"the lease for {name!r} does not exist (expired?)")
        if current is not None:
            self._drop_lease_name(current[1], name)
        self._revision += 1
        stored = _copy(record)
        stored.revision = self._revision
        answer = encode_answer(stored)
        stored.lease_id = lease_id
        self._store(name, stored)
        self._answers[name] = answer
        self._lease_names[lease_id] += (name,)
        self._publish(Event(EventType.PUT, stored, self._revision, len(answer)))
        return self._revision

    def _store(self, name: str, stored: AgentRecord) -> None:
        """Keeps ``stored`` (its revision set) as ``name``'s record, and counts it."""
        encoded = _encode(stored)
        current = self._meta.get(name)
        if current is None:
            bisect.insort(self._names, name)
            self._created[name] = stored.revision
        else:
            self._by_role[current[2]] -= 1
            self._bytes -= len(self._records[name])
        self._by_role[stored.role] = self._by_role.get(stored.role, 0) + 1
        self._bytes += len(encoded)
        self._records[name] = encoded
        self._meta[name] = (stored.revision, stored.lease_id, stored.role)

    def _drop_lease_name(self, lease_id: int, name: str) -> None:
        names = self._lease_names.get(lease_id)
        if names is not None and name in names:
            self._lease_names[lease_id] = tuple(n for n in names if n != name)

    async def delete_if(self, name: str, expect_revision: int) -> bool:
        current = self._meta.get(name)
        if current is None or current[0] != expect_revision:
            return False
        self._delete(name)
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
        byte_bound = max_bytes or math.inf
        queue = _WatchQueue(queue_size)
        wanted = sorted(set(names)) if names else None
        # Subscribe first, then page through the live records: every change made
        # from then on is kept too (coalesced per name: queue.pending) and follows
        # the snapshot. A record is read as it is when its page is read; a kept
        # change of it no newer than that is dropped (_fold), so that no name goes
        # back to an older state. A snapshot of every name holds every record that
        # existed when the watch began and still exists; those created since follow
        # SYNCED, so that it does not chase a storm's new registrations page after
        # page.
        revision = self._revision
        self._subscribe(queue, wanted)
        try:
            batch: list[Event] = []
            size = 0
            async for record, record_size in self._snapshot(wanted, revision):
                if queue.error is not None:
                    raise queue.error
                self._fold(queue, record)
                batch.append(Event(EventType.PUT, record, record.revision, record_size))
                size += record_size
                if len(batch) >= max_events or size >= byte_bound:
                    yield batch
                    batch, size = [], 0
                    queue.taken_at = time.monotonic()
            if queue.error is not None:
                raise queue.error
            if not queue.pending:
                queue.pending = None  # nothing changed meanwhile: every change in order from now
            batch.append(Event(EventType.SYNCED, None, revision))
            yield batch
            while True:
                queue.taken_at = time.monotonic()
                if queue.error is not None:
                    raise queue.error
                if queue.pending is None or not queue.empty():
                    item = await queue.get()  # waits only with nothing kept (pending None)
                    if isinstance(item, Exception):
                        raise item
                    batch, size = [item], item.size
                else:
                    batch, size = [], 0
                # Then whatever else is ready, without waiting: the queue's changes first,
                # then (once it is empty) the latest change of each name it could not take,
                # oldest first; changes meanwhile keep coalescing until none is left.
                error: Exception | None = None
                while len(batch) < max_events and size < byte_bound:
                    if not queue.empty():
                        item = queue.get_nowait()
                        if isinstance(item, Exception):
                            error = item
                            break
                    elif queue.pending is not None:
                        item = self._take_pending(queue)
                    else:
                        break
                    batch.append(item)
                    size += item.size
                if batch:
                    yield batch
                if error is not None:
                    raise error
        finally:
            self._drop_pending(queue)
            self._unsubscribe(queue, wanted)

    def _fold(self, queue: _WatchQueue, record: AgentRecord) -> None:
        """Drops the kept change of ``record``'s name that the snapshot shows already."""
        kept = queue.pending.get(record.name) if queue.pending else None
        if kept is not None and kept[0].revision <= record.revision:
            assert queue.pending is not None
            del queue.pending[record.name]
            self._pending_total -= 1
            self._pending_bytes -= kept[1]

    def _take_pending(self, queue: _WatchQueue) -> Event:
        assert queue.pending  # not empty: the caller looked
        name = next(iter(queue.pending))
        item, size = queue.pending.pop(name)
        self._pending_total -= 1
        self._pending_bytes -= size
        if not queue.pending:
            queue.pending = None  # caught up: every change in order, through the queue, from now
        return item

    def _drop_pending(self, queue: _WatchQueue) -> None:
        for _, size in (queue.pending or {}).values():
            self._pending_bytes -= size
        self._pending_total -= len(queue.pending or ())
        queue.pending = None

    async def _snapshot(
        self, names: list[str] | None, revision: int
    ) -> AsyncIterator[tuple[AgentRecord, int]]:
        """Copies of the current records created by ``revision``, a page at a time;
        of ``names`` only (one dict get each, whenever created), when given. Each
        with its size (its GetAgent answer's)."""
        answers = self._answers
        if names is None:
            after = ""
            while True:
                start = bisect.bisect_right(self._names, after) if after else 0
                chunk = self._names[start : start + PAGE_RECORDS]
                if not chunk:
                    return
                created = self._created
                page = [
                    (AgentRecord.FromString(self._records[name]), len(answers[name]))
                    for name in chunk
                    if created[name] <= revision
                ]
                for item in page:
                    yield item
                after = chunk[-1]
        for name in names:
            if (current := self._records.get(name)) is not None:
                yield AgentRecord.FromString(current), len(answers[name])

    def _subscribe(self, queue: _WatchQueue, names: list[str] | None) -> None:
        self._watchers.add(queue)
        if names is None:
            self._watch_all.add(queue)
        for name in names or ():
            self._watch_names.setdefault(name, set()).add(queue)

    def _unsubscribe(self, queue: _WatchQueue, names: list[str] | None) -> None:
        self._watchers.discard(queue)
        self._watch_all.discard(queue)
        for name in names or ():
            queues = self._watch_names.get(name)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._watch_names[name]

    # Internals.

    def _delete(self, name: str) -> None:
        encoded = self._records.pop(name, None)
        if encoded is None:
            return
        _, lease_id, role = self._meta.pop(name)
        del self._answers[name]
        del self._created[name]
        del self._names[bisect.bisect_left(self._names, name)]
        self._by_role[role] -= 1
        size = len(encoded)
        self._bytes -= size
        self._drop_lease_name(lease_id, name)
        self._revision += 1
        if self._watch_all or name in self._watch_names:  # read back only for a watcher
            self._publish(Event(EventType.DELETE, AgentRecord.FromString(encoded), self._revision, size))

    def _publish(self, event: Event) -> None:
        assert event.record is not None  # only PUT and DELETE are published
        # The same Event goes to every watcher: its wire encoding is made once.
        queues = list(self._watch_all)
        queues.extend(self._watch_names.get(event.record.name, ()))
        name = event.record.name
        size = -1
        for queue in queues:
            if queue not in self._watchers:
                continue  # cut off by an earlier put of this loop
            if queue.pending is None:
                try:
                    queue.put_nowait(event)
                    continue
                except asyncio.QueueFull:
                    queue.pending = {}  # it lags: the latest change of each name from now
            if size < 0:
                size = event.record.ByteSize()
            self._keep(queue, name, event, size)

    def _keep(self, queue: _WatchQueue, name: str, event: Event, size: int) -> None:
        pending = queue.pending
        assert pending is not None
        old = pending.pop(name, None)  # the newer change replaces it, at the end
        if old is not None:
            self._pending_total -= 1
            self._pending_bytes -= old[1]
        if time.monotonic() - queue.taken_at > WATCH_STALL_S:
            self._cut_off(queue, self._lag_error(queue, f"its reader took nothing for {WATCH_STALL_S:g} s"))
            return
        if len(pending) >= COALESCE_NAMES_MAX:
            self._cut_off(queue, self._lag_error(queue, f"{COALESCE_NAMES_MAX} names kept for it"))
            return
        # Over all watches: the one keeping the most goes first (not whichever watch
        # needs room now), so that no watch is cut off for another's lag.
        while self._pending_total >= COALESCE_TOTAL_MAX or self._pending_bytes + size > COALESCE_BYTES_MAX:
            most = max(self._watchers, key=lambda q: len(q.pending or ()))
            self._cut_off(
                most, self._lag_error(most, "the most kept of all watches, past the service's bound")
            )
            if most is queue:
                return
        pending[name] = (event, size)
        self._pending_total += 1
        self._pending_bytes += size

    @staticmethod
    def _lag_error(queue: _WatchQueue, why: str) -> WatchLagError:
        kept = len(queue.pending or ())
        return WatchLagError(f"the watch fell {queue.qsize() + kept} changes behind ({why})")

    def _cut_off(self, queue: _WatchQueue, error: Exception) -> None:
        self._watchers.discard(queue)
        self._drop_pending(queue)
        queue.error = error
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(error)

    def _now(self) -> float:
        """The lease clock: monotonic time less the stalls of the event loop."""
        return time.monotonic() - self.stalled_s

    async def _expire_loop(self) -> None:
        planned = time.monotonic() + self._expiry_interval_s
        while True:
            await asyncio.sleep(max(0.0, planned - time.monotonic()))
            late = time.monotonic() - planned
            if late > STALL_S:
                # Renewals sent meanwhile are still queued behind whatever held the loop:
                # their leases must not run out before they are read.
                self.stalled_s += late
                if time.monotonic() - self._stall_warned > 60:
                    self._stall_warned = time.monotonic()
                    logger.warning(
                        "the metadata service stalled for %.1f s (overloaded?); leases were "
                        "extended by that much (%.1f s of stalls so far)",
                        late,
                        self.stalled_s,
                    )
            await self._expire_due(self._now())
            planned = time.monotonic() + self._expiry_interval_s

    async def _expire_due(self, now: float) -> None:
        """Revoke the leases whose deadline is past ``now``. Looks only at the heap
        entries that fell due: O((due + renewed since pushed) * log n), never every lease."""
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            self.expiry_checks += 1
            deadline = self._deadlines.get(lease_id)
            if deadline is None:
                continue  # revoked already
            if deadline > now:
                heapq.heappush(heap, (deadline, lease_id))  # renewed meanwhile
                continue
            # The names, never the lease id: a log reader must not learn what proves a name.
            logger.info("the lease of %s expired", _names_for_log(self._lease_names[lease_id]))
            self.expired_leases += 1
            await self.revoke_lease(lease_id)

    def _compact_expiry_heap(self) -> None:
        # Entries of revoked leases pile up when leases come and go faster than they
        # fall due: rebuild from the live leases (O(n), at most once per n grants).
        self._expiry_heap = [(deadline, lease_id) for lease_id, deadline in self._deadlines.items()]
        heapq.heapify(self._expiry_heap)


def _names_for_log(names: Collection[str], most: int = 8) -> str:
    shown = sorted(names)[:most]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return (", ".join(shown) or "no agent") + more


def encode_answer(record: AgentRecord) -> bytes:
    """``record`` as an encoded GetAgentResponse, its lease id cleared (in ``record``
    too: pass a copy you own)."""
    record.ClearField("lease_id")
    return metadata_pb2.GetAgentResponse(record=record).SerializeToString()


def _encode(record: AgentRecord) -> bytes:
    # Map entries in key order: the same record always encodes to the same bytes.
    return record.SerializeToString(deterministic=True)


def _copy(record: AgentRecord) -> AgentRecord:
    out = AgentRecord()
    out.CopyFrom(record)
    return out
