"""A read replica of a metadata service: ``kvx metadata --store mirror://PRIMARY``.

The memory store lives in one process, and that process's one event loop
answers every renewal and every lookup: under the renewals of 100,000
agents, lookups queue behind them. A mirror is a second service that holds
a copy of the primary's records and answers the reads (GetAgent, GetAgents,
ListAgents, WatchAgents, the admin API's reads) from it, so that agents
that look peers up there (``MetadataOptions.read_target``) never wait on
the primary's loop. Several mirrors of one
primary share the reads.

The copy follows the primary's own WatchAgents stream of every agent (the
first snapshot, then each change), over a channel with the service's token
(``--token-file``) and TLS to the primary (``--primary-tls-*``). Renewals change no record and cost the mirror nothing.
Revisions are the mirror's own (a counter, as in the memory store): a
client compares the revisions of one service, its lookups against its
watch events, and both come from the mirror.

Writes are the primary's: a registration, renewal, unregistration or admin
eviction sent to a mirror is refused (FAILED_PRECONDITION, naming the
primary), never forwarded; the mirror holds no lease and no lease id.

When the stream breaks (the primary restarts, the network fails, the primary
cuts a mirror that reads too slowly), the mirror reconnects with a backoff
and resynchronises from a new snapshot: records missing from it are deleted,
changed ones replaced, and the mirror's own watchers see only that
difference. Until the first snapshot is complete, and once the stream has
been down for ``stale_s`` (default: 10 s, the default lease), the mirror
answers no read (UNAVAILABLE), reports NOT_SERVING and cuts its watchers
off. A stream that dies without a word (a peer gone from the network) is
noticed by gRPC's keepalive within about 10 s, and a primary whose event
loop lags sends its changes that much later: a change reaches a mirror
within the primary's own delay plus, while the stream is down, up to
``stale_s`` and that keepalive time.

What the copy holds is bounded as the primary's registry is (``max_agents``,
``max_bytes``, each record ``max_record_bytes``, names checked): the stream
is input from the network. A snapshot is held apart until its SYNCED and
then applied in one pass (a snapshot cut short changes nothing): during a
resynchronisation the old copy and the new snapshot are held together, up
to twice that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence

import grpc
from grpc import aio

from kvx.config import check_name
from kvx.errors import ConfigError
from kvx.metadata.client import (
    MIRROR_KEEPALIVE_S,
    MIRROR_RECONNECT_MAX_S,
    READ_REPLICA_HEADER,
    WATCH_BATCH_BYTES,
    MetadataOptions,
    call_metadata,
    channel_options,
    credentials,
    watch_events,
)
from kvx.metadata.refused import Refused
from kvx.metadata.store import (
    WATCH_BATCH_EVENTS,
    WATCH_QUEUE_MAX,
    AgentRecord,
    Event,
    EventBatch,
    EventType,
    MemoryStore,
    StaleCopyError,
    StoreError,
    _copy,
    _encode,
    encode_answer,
)
from kvx.v1 import metadata_pb2, metadata_pb2_grpc

logger = logging.getLogger(__name__)

# Reconnection backoff, doubling between these.
_BACKOFF_MIN_S = 0.1
# Events of a batch from the primary taken per turn of the event loop.
_BATCH_TURN = 128
_BACKOFF_MAX_S = 2.0
# A stream that broke sooner than this after its snapshot (the primary cut a replica
# that could not keep up) is not retried at once: each retry is a whole snapshot.
_BACKOFF_RESET_S = 10.0
# While the primary stays unreachable, a warning at most this often.
_WARN_EVERY_S = 60.0
_PUT = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT
_DELETE = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE
_SYNCED = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED


def parse_mirror_url(url: str) -> str:
    """``mirror://host:port`` -> ``host:port``."""
    target = url.removeprefix("mirror://")
    host, sep, port = target.rpartition(":")
    if not url.startswith("mirror://") or not sep or not host or not port.isdigit() or "," in target:
        raise ConfigError(f"a mirror store is mirror://host:port (one primary service), not {url!r}")
    return target


class MirrorStore(MemoryStore):
    """A copy of a primary service's records that follows its changes; reads only."""

    name = "mirror"

    def __init__(
        self,
        primary: str,
        options: MetadataOptions | None = None,
        *,
        stale_s: float = 10.0,
        max_agents: int = 100_000,
        max_bytes: int = 512 * 1024 * 1024,
        max_record_bytes: int = 256 * 1024,
    ) -> None:
        super().__init__()
        if stale_s <= 0:
            raise ConfigError(f"stale_s must be positive, not {stale_s}")
        # What the copy may hold, as the primary's own limits bound what it holds
        # (--max-agents, --max-registry-bytes): the stream is input from the network.
        self._max_agents = max_agents
        self._max_bytes = max_bytes
        self._max_record_bytes = max_record_bytes
        # A WatchAgentsResponse holds one record, or events of at most WATCH_BATCH_BYTES in
        # all (an event larger than that comes alone): no message beyond that and its frame.
        self._channel_options = [
            *(
                o
                for o in channel_options(MIRROR_RECONNECT_MAX_S, MIRROR_KEEPALIVE_S)
                if o[0] != "grpc.max_receive_message_length"
            ),
            ("grpc.max_receive_message_length", max(max_record_bytes, WATCH_BATCH_BYTES) + 64 * 1024),
        ]
        self.primary = primary
        self._options = options or MetadataOptions()
        self._credentials = credentials(self._options)  # bad TLS settings fail here, at start
        self._stale_s = stale_s
        self._following = False  # connected, and past the current stream's snapshot
        self._synced_once = False
        self._lost_at = time.monotonic()  # when the copy last stopped following
        self._tasks: list[asyncio.Task] = []
        self._warned_at = -_WARN_EVERY_S
        self.resyncs = 0  # snapshots taken after the first (logged; for tests)
        self._followed_at = 0.0  # when the current stream's snapshot completed

    # Lifecycle.

    async def start(self) -> None:  # no expiry loop: the primary's leases expire there
        self._tasks = [
            asyncio.create_task(self._follow(), name="kvx-mirror"),
            asyncio.create_task(self._watch_staleness(), name="kvx-mirror-staleness"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await super().close()

    async def ready(self) -> bool:
        return self._fresh()

    def _fresh(self) -> bool:
        return self._following or (self._synced_once and time.monotonic() - self._lost_at < self._stale_s)

    def _check_fresh(self) -> None:
        if self._fresh():
            return
        if not self._synced_once:
            raise StaleCopyError(f"this read replica has not copied the records of {self.primary} yet")
        raise StaleCopyError(
            f"this read replica lost the primary {self.primary} {time.monotonic() - self._lost_at:.0f} s "
            f"ago (at most {self._stale_s:g} s of it is served)"
        )

    # Writes: the primary's.

    def refuse_writes(self) -> None:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this metadata service is a read replica of {self.primary}: register, renew and "
            f"unregister there; read replicas answer lookups and watches",
        )

    async def grant_lease(self, ttl_s: int) -> int:
        self.refuse_writes()
        raise AssertionError  # not reached

    async def keep_alive(self, lease_id: int) -> int:
        self.refuse_writes()
        raise AssertionError

    async def keep_alive_many(self, lease_ids: Sequence[int]) -> list[int]:
        self.refuse_writes()
        raise AssertionError

    async def revoke_lease(self, lease_id: int) -> None:
        self.refuse_writes()

    async def lease_ttl(self, lease_id: int) -> int:
        self.refuse_writes()
        raise AssertionError

    async def put_if(self, record: AgentRecord, lease_id: int, expect_revision: int) -> int | None:
        self.refuse_writes()
        raise AssertionError

    async def delete_if(self, name: str, expect_revision: int) -> bool:
        self.refuse_writes()
        raise AssertionError

    # Reads: the copy's, while it is fresh.

    async def get(self, name: str) -> AgentRecord | None:
        self._check_fresh()
        return await super().get(name)

    async def get_answer(self, name: str) -> bytes | None:
        self._check_fresh()
        return self._answers.get(name)

    async def count(self) -> int:
        self._check_fresh()
        return len(self._records)

    async def record_bytes(self) -> int | None:
        self._check_fresh()
        return self._bytes

    async def list_page(self, after: str, limit: int) -> list[AgentRecord]:
        self._check_fresh()
        return await super().list_page(after, limit)

    async def watch_batches(
        self,
        queue_size: int = WATCH_QUEUE_MAX,
        names: Collection[str] | None = None,
        max_events: int = WATCH_BATCH_EVENTS,
        max_bytes: int | None = None,
    ) -> AsyncIterator[EventBatch]:
        self._check_fresh()
        batches = super().watch_batches(queue_size, names, max_events, max_bytes)
        assert isinstance(batches, AsyncGenerator)  # MemoryStore's is one: closed here, not by GC
        async with contextlib.aclosing(batches):
            async for batch in batches:
                yield batch

    # Following the primary.

    async def _follow(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            if self._credentials is not None:
                channel = aio.secure_channel(self.primary, self._credentials, options=self._channel_options)
            else:
                channel = aio.insecure_channel(self.primary, options=self._channel_options)
            try:
                stub = metadata_pb2_grpc.MetadataServiceStub(channel)
                call = stub.WatchAgents(
                    metadata_pb2.WatchAgentsRequest(batch_bytes=WATCH_BATCH_BYTES),
                    metadata=[*(call_metadata(self._options) or ()), (READ_REPLICA_HEADER, "1")],
                )
                await self._copy_stream(call)
                error = "the primary ended the watch"
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                error = f"{code}: {details}"
            except Exception as exc:  # a malformed event, a copy past its bounds: start over
                if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                    logger.error("read replica: following %s failed", self.primary, exc_info=True)
                error = str(exc) or repr(exc)
            finally:
                if self._following:
                    self._lost_at = time.monotonic()
                    if self._lost_at - self._followed_at >= _BACKOFF_RESET_S:
                        backoff = _BACKOFF_MIN_S
                self._following = False
                with contextlib.suppress(Exception):
                    await channel.close(None)
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                logger.warning(
                    "read replica: the watch of the primary %s ended (%s); reconnecting", self.primary, error
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _copy_stream(self, call: AsyncIterator[metadata_pb2.WatchAgentsResponse]) -> None:
        # The snapshot, until SYNCED: applied then, in one pass, so that a snapshot cut
        # short changes nothing, and the copy's own watchers see only the difference.
        snapshot: dict[str, AgentRecord] | None = {}
        snapshot_bytes = 0
        async for message in call:
            for i, event in enumerate(watch_events(message), 1):  # one, or a batch
                if i % _BATCH_TURN == 0:
                    await asyncio.sleep(0)  # lookups waiting are answered between
                if event.type == _SYNCED:
                    if snapshot is not None:
                        await self._apply_snapshot(snapshot)
                        if self._synced_once:
                            self.resyncs += 1
                        snapshot = None
                        self._following = self._synced_once = True
                        self._followed_at = time.monotonic()
                        logger.info(
                            "read replica: following %s (%d agents)", self.primary, len(self._records)
                        )
                    continue
                name = event.record.name
                if snapshot is None:
                    if event.type == _PUT:
                        self._put(event.record)
                    elif event.type == _DELETE:
                        self._delete(name)
                    continue
                # A snapshot is bounded by itself, as the primary's registry is.
                old = snapshot.pop(name, None)
                if old is not None:
                    snapshot_bytes -= old.ByteSize()
                if event.type == _PUT:
                    self._check(event.record)
                    snapshot_bytes += event.record.ByteSize()
                    if len(snapshot) >= self._max_agents or snapshot_bytes > self._max_bytes:
                        raise self._too_large()
                    snapshot[name] = event.record

    async def _apply_snapshot(self, snapshot: dict[str, AgentRecord]) -> None:
        """Makes the copy the snapshot: deletes what it lacks, puts what changed. Yields to
        the event loop every thousand records, so that reads go on meanwhile."""
        # Deleted from the end of the sorted names: a delete there moves nothing.
        gone = sorted((name for name in self._records if name not in snapshot), reverse=True)
        for i, name in enumerate(gone, 1):
            self._delete(name)
            if i % 1000 == 0:
                await asyncio.sleep(0)
        for i, record in enumerate(snapshot.values(), 1):
            self._put(record, bounded=False)  # the snapshot was bounded as it came
            if i % 1000 == 0:
                await asyncio.sleep(0)

    async def _watch_staleness(self) -> None:
        """Cuts the copy's watchers off once it is stale: they watch again, and are
        refused until the copy follows the primary again."""
        while True:
            await asyncio.sleep(min(self._stale_s / 4, 0.5))
            if self._watchers and not self._fresh():
                error = StaleCopyError(f"this read replica lost the primary {self.primary}")
                for queue in list(self._watchers):
                    self._cut_off(queue, error)

    def _too_large(self) -> StoreError:
        return StoreError(
            f"the primary {self.primary} holds more than this read replica takes ({self._max_agents} "
            f"agents, {self._max_bytes} bytes of records: --max-agents, --max-registry-bytes); "
            "give the replica the primary's limits"
        )

    def _check(self, record: AgentRecord) -> None:
        check_name(record.name)
        # The primary bounds a record as registered; it adds a revision and a timestamp.
        if record.ByteSize() > self._max_record_bytes + 1024:
            raise StoreError(f"the primary sent a record of {record.ByteSize()} bytes for {record.name!r}")

    def _put(self, record: AgentRecord, bounded: bool = True) -> None:
        """Takes the primary's ``record`` into the copy, with a revision of the copy's own.
        ``bounded``: the copy's own size is checked (a snapshot is checked by itself)."""
        name = record.name
        if bounded:
            self._check(record)
        current = self._records.get(name)
        stored = _copy(record)
        stored.ClearField("lease_id")  # the primary never sends it; nor is it ever kept here
        if current is not None:
            stored.revision = self._meta[name][0]
            if _encode(stored) == current:
                return  # a new snapshot's copy of a record this one holds: no change
        grows = stored.ByteSize() - (len(current) if current is not None else 0)
        if bounded and (
            (current is None and len(self._records) >= self._max_agents)
            or self._bytes + grows > self._max_bytes
        ):
            raise self._too_large()
        self._revision += 1
        stored.revision = self._revision
        self._store(name, stored)
        self._answers[name] = answer = encode_answer(_copy(stored))
        self._publish(Event(EventType.PUT, stored, self._revision, len(answer)))
