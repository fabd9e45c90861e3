"""The kvx metadata service (gRPC, asyncio): a registry of agents and their memory.

Stateless in front of a ``Store``: the in-memory one (one process, nothing
to install) or etcd (several replicas, one cluster state). Standard gRPC
health checking and server reflection are on. With a token configured every
call must carry ``authorization: Bearer <token>`` in its metadata; with TLS
the server presents a certificate and may require client certificates.

Rules for registrations: a name belongs to one lease. A live record (its
lease not expired) is replaced or refreshed only by a registration that
sends that lease's id (``RegisterAgentRequest.lease_id``), which only its
registrant knows: no answer of any read API carries a lease id. Anyone else,
whatever epoch or start time it claims, is refused with FAILED_PRECONDITION
and a ``kvx-retry-after-ms`` trailer saying when the lease runs out unless
renewed. So a restarted agent (new epoch, old lease still running) gets its
name back once the old lease expires: within the old lease's TTL. Likewise
only the lease's holder unregisters a record; the admin API evicts.

Bounds (``ServiceLimits``): registered agents, concurrent watch streams,
changes queued or kept per watch (a watcher too far behind is cut off), records and bytes per
list page, bytes per GetAgents answer (and MAX_LOOKUPS_PER_CALL names a call). Nothing a client asks for copies the whole registry at once.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gc
import hmac
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvx._net import format_address, is_loopback, parse_listen_address
from kvx.config import check_name, read_file
from kvx.errors import ConfigError
from kvx.metadata.client import READ_REPLICA_HEADER
from kvx.metadata.metrics import ServiceMetrics
from kvx.metadata.refused import Refused
from kvx.metadata.store import (
    PAGE_RECORDS,
    WATCH_BATCH_EVENTS,
    EventType,
    MemoryStore,
    Store,
    StoreError,
    WatchLagError,
)
from kvx.metadata.store import Event as StoreEvent
from kvx.v1 import metadata_pb2, metadata_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name
Event = metadata_pb2.WatchAgentsResponse
_T = TypeVar("_T")
# Trailer of a registration refused because the name's lease is live: the
# milliseconds until that lease runs out unless its holder renews it.
RETRY_AFTER_KEY = "kvx-retry-after-ms"
# With it, when this service does not renew that lease itself: the etcd raft term
# in which that time, etcd's, was read (RegisterAgentResult.lease_etcd_term).
LEASE_ETCD_TERM_KEY = "kvx-lease-etcd-term"
STORE_ERROR_LOG_EVERY_S = 10.0  # a failing store is logged at most this often
# Leases one KeepAliveRequest may renew, lease_id included (proto/kvx/v1/metadata.proto).
MAX_KEEP_ALIVE_LEASES = 1024
# Registrations one RegisterAgentsRequest may carry (the proto's bound): a call's
# work stays bounded, as one registration's is.
MAX_REGISTRATIONS_PER_CALL = 128
# A RegisterAgents entry is made only while this much of the call's deadline is left.
_REGISTER_MARGIN_S = 0.5
# RegisterAgents entries made per turn of the event loop (about 0.4 ms of it).
_REGISTER_TURN = 8
# WatchAgentsRequest.names: at most this many (the proto's bound).
MAX_WATCH_NAMES = 4096
# GetAgentsRequest.names: at most this many (the proto's bound).
MAX_LOOKUPS_PER_CALL = 64
# The longest valid agent name (kvx.config.check_name), in bytes (ASCII only).
_MAX_NAME_BYTES = 128
# The largest valid names list of a WatchAgentsRequest, encoded: a tag byte, a
# two-byte length and the name, per name (536,576 bytes). Role and labels fit in
# the receive limit's 64 KiB of slack.
MAX_WATCH_NAMES_BYTES = MAX_WATCH_NAMES * (1 + 2 + _MAX_NAME_BYTES)
# The most bytes of events one WatchAgentsResponse carries when the watcher asks for
# several per message (WatchAgentsRequest.batch_bytes; the proto's cap). An event
# larger than the bound still goes, alone.
WATCH_BATCH_BYTES_MAX = 1 << 20
# The tag of WatchAgentsResponse.events (field 4, length-delimited): a batch is the
# events' cached encodings, each behind this tag and its length.
_EVENTS_TAG = b"\x22"
# The tag of GetAgentsResponse.answered (field 2, a varint). Its records are field 1, as
# GetAgentResponse's record is: the stored GetAgent answers, joined, are its records.
_ANSWERED_TAG = b"\x10"


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what clients can make the service hold or do.

    max_agents:         registered agents; one more new name is refused with
                        RESOURCE_EXHAUSTED (approximate under concurrent
                        registrations of new names: they may overshoot by their number).
    max_registry_bytes: the registered records' encoded bytes, in all, where the
                        store counts them (memory; etcd has its own quota): a
                        registration that would go past it is refused with
                        RESOURCE_EXHAUSTED. Without it, max_agents records of
                        max_record_bytes each could be made to hold 25 GiB.
    max_watch_streams:  WatchAgents streams open at once; one more is refused
                        with RESOURCE_EXHAUSTED. Sized for one per agent
                        that resolves peers: an idle watch of a few names
                        costs the service about 28 KiB (measured), and each
                        name about 0.9 KiB more: a watch of MAX_WATCH_NAMES
                        (4,096, the proto's bound, not a setting) of the
                        longest names about 3.4 MiB of RSS, so the default
                        cap allows about 13.5 GiB of such watches. Where
                        clients may name that many, set it to the memory
                        budget for watches / 3.4 MiB (600 for 2 GiB).
    max_replica_watch_streams: slots set aside for watches of every agent
                        whose caller says it is a read replica (call
                        metadata READ_REPLICA_HEADER), so that agents'
                        watches filling max_watch_streams cannot cut the
                        replicas off. With these taken, such a watch takes
                        an agent's slot. Any caller with the token may say
                        so: what it can take is these slots and its share
                        of the agents'.
    watch_queue_events: changes queued for one watch stream. Past it (and
                        while a watch reads its snapshot), the memory store
                        keeps the latest change of each name instead, up to
                        store.COALESCE_NAMES_MAX names per watch and
                        COALESCE_TOTAL_MAX names and COALESCE_BYTES_MAX
                        record bytes over all watches; a watcher past those
                        is cut off with RESOURCE_EXHAUSTED (it watches again
                        and resynchronises). On etcd, past it, it is cut off.
    max_page_size, max_page_bytes: one ListAgents page (larger page sizes
                        are lowered; a page ends early at the byte bound,
                        always holding at least one record). A GetAgents
                        answer ends early at max_page_bytes too.
    max_list_scan:      records one ListAgents call looks at to fill a
                        filtered page; past it the page is returned short,
                        with a next_page_token.
    """

    default_ttl_s: int = 10
    min_ttl_s: int = 2
    max_ttl_s: int = 300
    max_record_bytes: int = 256 * 1024
    max_regions: int = 4096
    max_labels: int = 64
    max_label_bytes: int = 256  # each key and each value
    max_engine_info: int = 64
    max_engine_info_bytes: int = 4096  # each value
    default_page_size: int = 100
    max_page_size: int = 1000
    max_page_bytes: int = 4 * 1024 * 1024
    max_list_scan: int = 10_000
    max_agents: int = 100_000
    max_registry_bytes: int = 512 * 1024 * 1024
    max_watch_streams: int = 4096
    max_replica_watch_streams: int = 16
    watch_queue_events: int = 1000

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ServiceLimits.{field.name} must be a positive integer, not {value!r}")
        if not self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s:
            raise ConfigError(
                f"the default lease ttl {self.default_ttl_s} s is outside "
                f"[{self.min_ttl_s}, {self.max_ttl_s}] s (--default-ttl-s)"
            )


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM files. With ``client_ca`` the server requires client certificates."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        if not self.cert or not self.key:
            raise ConfigError(
                "TlsConfig needs both cert and key (a CA for client certificates alone "
                "would serve plaintext): give the server's certificate and private key"
            )


class _Malformed:
    """A request whose bytes do not parse as the method's message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:  # answered INVALID_ARGUMENT by the method (grpcio says UNKNOWN)
            return _Malformed(exc)

    return parse


def _check_parsed(request: Any) -> None:
    if isinstance(request, _Malformed):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid kvx.v1 protobuf message ({request.error}); "
            "send one built from proto/kvx/v1/metadata.proto",
        )


def _as_is(answer: bytes) -> bytes:
    return answer


# Methods whose servicer returns (or yields) its answers already encoded, sent as they
# are: GetAgent's cached per record (GetAgents' joins them), WatchAgents' encoded once per
# event for every watcher.
_ENCODED_ANSWERS = frozenset({"GetAgent", "GetAgents", "WatchAgents"})


def _handlers(servicer: Any) -> grpc.GenericRpcHandler:
    """The MetadataService's method handlers, as the generated code makes them, but with
    parsers that let a method answer a malformed request with INVALID_ARGUMENT."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].methods:
        make = kinds[(method.client_streaming, method.server_streaming)]
        serialize = getattr(metadata_pb2, method.output_type.name).SerializeToString
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_parser(getattr(metadata_pb2, method.input_type.name)),
            response_serializer=_as_is if method.name in _ENCODED_ANSWERS else serialize,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _encoded(event: StoreEvent, event_type: Any) -> bytes:
    """The WatchAgentsResponse of ``event`` as ``event_type``, lease id cleared, serialized
    once per event and type: every watcher sent it reuses the bytes."""
    data = event.encoded.get(event_type)
    if data is None:
        out = Event(type=event_type, record=event.record, revision=event.revision)  # copies the record
        out.record.ClearField("lease_id")  # the stored record keeps it
        data = event.encoded[event_type] = out.SerializeToString()
    return data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _batched(events: list[bytes], limit: int) -> Iterator[bytes]:
    """``events`` (encoded WatchAgentsResponses) in messages of at most ``limit`` bytes
    each, and at least one event: several as WatchAgentsResponse.events, one as it is
    (so every one alone when ``limit`` is 0)."""
    parts: list[bytes] = []
    count = size = 0
    for data in events:
        header = _EVENTS_TAG + _varint(len(data))
        if count and size + len(header) + len(data) > limit:
            yield parts[1] if count == 1 else b"".join(parts)
            parts, count, size = [], 0, 0
        parts += (header, data)
        count += 1
        size += len(header) + len(data)
    if count:
        yield parts[1] if count == 1 else b"".join(parts)


def _check_names(names: Sequence[str], most: int, counted: str, advice: str) -> None:
    """INVALID_ARGUMENT for more than ``most`` names ("N ``counted``; at most ``most``:
    ``advice``"), or for one that is not a valid agent name."""
    if len(names) > most:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(names)} {counted}; at most {most}: {advice}")
    for name in names:
        try:
            check_name(name)
        except ConfigError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"names: {exc}") from None


def _check_watch_names(names: Any) -> frozenset[str] | None:
    _check_names(names, MAX_WATCH_NAMES, "names to watch", "watch fewer, or watch every name (no names)")
    return frozenset(names) if names else None


def _matches(record: metadata_pb2.AgentRecord, role: int, labels: Any) -> bool:
    if role and record.role != role:
        return False
    return all(record.labels.get(k) == v for k, v in labels.items())


class MetadataServicer(metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(
        self, store: Store, limits: ServiceLimits, metrics: ServiceMetrics, token: str | None = None
    ) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self._token = token
        self._background: set[asyncio.Future] = set()
        self.watch_streams = 0  # open WatchAgents streams
        self.replica_watch_streams = 0  # of which in the slots set aside for read replicas
        metrics.watch_streams.labels("agent").set_function(
            lambda: self.watch_streams - self.replica_watch_streams
        )
        metrics.watch_streams.labels("replica").set_function(lambda: self.replica_watch_streams)
        self._get_seconds = metrics.request_seconds.labels("GetAgent")
        self._unavailable_logged = -math.inf  # when a store error was last logged
        self._unavailable_since_log = 0  # requests answered UNAVAILABLE since then

    # Plumbing: auth, timing, error translation.

    def unavailable(self, exc: StoreError) -> str:
        """What a caller is told when the store failed its request. The store's own words
        name etcd's endpoints and its errors: they go to this service's log (a line every
        STORE_ERROR_LOG_EVERY_S at most, with a count: an outage fails every request), not
        to a caller, who may be any client that can reach the port."""
        self._unavailable_since_log += 1
        now = time.monotonic()
        if now - self._unavailable_logged >= STORE_ERROR_LOG_EVERY_S:
            logger.warning(
                "metadata store unavailable: %s (%d request(s) answered UNAVAILABLE since the last such line)",
                exc,
                self._unavailable_since_log,
            )
            self._unavailable_logged, self._unavailable_since_log = now, 0
        if exc.shown_to_callers:
            return f"metadata store unavailable: {exc}"
        return "metadata store unavailable (the metadata service's log says why); try again"

    async def _call(
        self, method: str, request: Any, context: aio.ServicerContext, fn: Callable[[], Awaitable[Any]]
    ) -> Any:
        start = time.perf_counter()
        try:
            self._authorize(context)
            _check_parsed(request)
            return await fn()
        except Refused as refused:
            await context.abort(refused.code, str(refused), trailing_metadata=refused.trailing_metadata)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable(exc))
        finally:
            self.metrics.request_seconds.labels(method).observe(time.perf_counter() - start)

    def _authorize(self, context: aio.ServicerContext) -> None:
        if self._token is None:
            return
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self._token}".encode()):
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token: send 'authorization: Bearer <token>' metadata",
            )

    # RPCs.

    async def RegisterAgent(self, request, context):  # noqa: N802 - gRPC names
        return await self._call("RegisterAgent", request, context, lambda: self.register(request))

    async def register(
        self, request: metadata_pb2.RegisterAgentRequest
    ) -> metadata_pb2.RegisterAgentResponse:
        self.store.refuse_writes()
        record = request.record
        self._validate(record)
        ttl = request.ttl_s or self.limits.default_ttl_s
        if not self.limits.min_ttl_s <= ttl <= self.limits.max_ttl_s:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ttl_s {ttl} outside [{self.limits.min_ttl_s}, {self.limits.max_ttl_s}]",
            )
        for _ in range(8):
            current = await self.store.get(record.name)
            if current is not None and not (request.lease_id and request.lease_id == current.lease_id):
                remaining_s, etcd_term = await self.store.held_ttl(current.lease_id)
                if remaining_s > 0:
                    raise _held(record.name, current, remaining_s, etcd_term)
                # Its lease ran out (the store deletes the record any moment): the name is free.
            elif current is None and await self.store.count() >= self.limits.max_agents:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.limits.max_agents} agents are registered, the most this service takes "
                    "(kvx metadata --max-agents); unregister some, or raise the limit",
                )
            held = await self.store.record_bytes()
            if held is not None:
                size = record.ByteSize()
                grows = size - (current.ByteSize() if current is not None else 0)
                if grows > 0 and held + grows > self.limits.max_registry_bytes:
                    raise Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the registry holds {held} bytes of records; this one of {size} bytes "
                        f"would take it past {self.limits.max_registry_bytes} (kvx metadata "
                        "--max-registry-bytes); unregister some, or raise the limit",
                    )
            lease_id = await self.store.grant_lease(ttl)
            stored = metadata_pb2.AgentRecord()
            stored.CopyFrom(record)
            stored.registered_unix_ms = int(time.time() * 1000)
            revision = await self.store.put_if(stored, lease_id, current.revision if current else 0)
            if revision is None:  # raced with another write of this name
                await self.store.revoke_lease(lease_id)
                continue
            if current is not None and current.lease_id and current.lease_id != lease_id:
                # The old lease holds no record any more; revoking it tells the old
                # holder (its keep-alives get ttl 0). Retried until it goes through.
                self._revoke_later(current.lease_id, record.name)
            self.metrics.registrations.inc()
            logger.info(
                "registered %s epoch %#x role %s",
                record.name,
                record.epoch,
                metadata_pb2.Role.Name(record.role),
            )
            return metadata_pb2.RegisterAgentResponse(lease_id=lease_id, ttl_s=ttl, revision=revision)
        raise Refused(grpc.StatusCode.ABORTED, f"concurrent registrations of {record.name!r}; retry")

    async def RegisterAgents(self, request, context):  # noqa: N802
        return await self._call(
            "RegisterAgents", request, context, lambda: self.register_many(request, context.time_remaining)
        )

    async def register_many(
        self,
        request: metadata_pb2.RegisterAgentsRequest,
        time_remaining: Callable[[], float | None] = lambda: None,
    ) -> metadata_pb2.RegisterAgentsResponse:
        """Each of ``request.requests`` as ``register`` does it, in order, each answered
        on its own: the call's per-call cost (most of a registration's, in grpc.aio)
        is paid once for all of them. Entries the call's deadline leaves no time for
        are answered UNAVAILABLE, not made: a registration made after its caller gave
        up would hold its name under a lease nobody knows, until that lease ran out."""
        self.store.refuse_writes()
        if len(request.requests) > MAX_REGISTRATIONS_PER_CALL:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.requests)} registrations in one RegisterAgentsRequest; at most "
                f"{MAX_REGISTRATIONS_PER_CALL}: split them over several calls",
            )
        response = metadata_pb2.RegisterAgentsResponse()
        for i, item in enumerate(request.requests):
            if i and i % _REGISTER_TURN == 0:
                # A few registrations per turn of the event loop: a call of 128 must not
                # hold the loop while renewals wait (a lease whose renewal waits past its
                # ttl is lost, and its agent registers again).
                await asyncio.sleep(0)
            result = response.results.add()
            left_s = time_remaining()
            if left_s is not None and left_s < _REGISTER_MARGIN_S:
                result.code = grpc.StatusCode.UNAVAILABLE.value[0]
                result.message = "not registered: the call's deadline came first; register it again"
                continue
            try:
                result.response.CopyFrom(await self.register(item))
            except Refused as refused:
                result.code, result.message = refused.code.value[0], str(refused)
                for key, value in refused.trailing_metadata:
                    if key == RETRY_AFTER_KEY:
                        result.retry_after_ms = int(value)
                    elif key == LEASE_ETCD_TERM_KEY:
                        result.lease_etcd_term = int(value)
            except StoreError as exc:
                result.code = grpc.StatusCode.UNAVAILABLE.value[0]
                result.message = self.unavailable(exc)
        return response

    def _revoke_later(self, lease_id: int, name: str) -> None:
        async def revoke() -> None:
            for attempt in range(120):
                try:
                    await self.store.revoke_lease(lease_id)
                    return
                except StoreError as exc:
                    if attempt == 0:
                        logger.warning("could not revoke the replaced lease of %s yet: %s", name, exc)
                    await asyncio.sleep(1.0)
            logger.error("gave up revoking the replaced lease of %s; it expires unless renewed", name)

        task = asyncio.ensure_future(revoke())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _validate(self, record: metadata_pb2.AgentRecord) -> None:
        bad = lambda msg: Refused(grpc.StatusCode.INVALID_ARGUMENT, msg)  # noqa: E731
        lim = self.limits
        try:
            check_name(record.name)
        except ConfigError as exc:
            raise bad(str(exc)) from None
        if record.ByteSize() > lim.max_record_bytes:
            raise bad(f"record of {record.ByteSize()} bytes; at most {lim.max_record_bytes}")
        if not record.epoch:
            raise bad("epoch must be set (non-zero)")
        if record.started_unix_ms <= 0:
            raise bad("started_unix_ms must be set")
        if record.role not in metadata_pb2.Role.values():
            raise bad(f"unknown role {record.role}")
        md = record.metadata
        if md.name != record.name or md.epoch != record.epoch:
            raise bad("metadata.name and metadata.epoch must equal the record's name and epoch")
        if len(md.regions) > lim.max_regions:
            raise bad(f"{len(md.regions)} regions; at most {lim.max_regions}")
        for what, entries, count, size in (
            ("labels", record.labels, lim.max_labels, lim.max_label_bytes),
            ("engine_info", record.engine_info, lim.max_engine_info, lim.max_engine_info_bytes),
        ):
            if len(entries) > count:
                raise bad(f"{len(entries)} {what}; at most {count}")
            for key, value in entries.items():
                if not key or len(key) > lim.max_label_bytes or len(value) > size:
                    raise bad(f"{what} entry {key[:40]!r}: empty key, or key or value too long")

    async def KeepAlive(self, request_iterator, context):  # noqa: N802
        try:
            self._authorize(context)
            self.store.refuse_writes()
        except Refused as refused:
            await context.abort(refused.code, str(refused))
        self.metrics.keep_alive_streams.inc()
        try:
            async for request in request_iterator:
                _check_parsed(request)
                self.metrics.keep_alive_messages.inc()
                yield await self.keep_alive(request)
        except Refused as refused:
            await context.abort(refused.code, str(refused))
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable(exc))

    async def keep_alive(self, request: metadata_pb2.KeepAliveRequest) -> metadata_pb2.KeepAliveResponse:
        """Renews ``lease_id`` (when set) and every ``lease_ids`` entry with one store call."""
        batch = request.lease_ids
        if len(batch) + (1 if request.lease_id else 0) > MAX_KEEP_ALIVE_LEASES:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(batch) + (1 if request.lease_id else 0)} leases in one KeepAliveRequest; "
                f"at most {MAX_KEEP_ALIVE_LEASES}: split them over several requests",
            )
        if batch and min(batch) <= 0:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "lease_ids holds an id <= 0; send only lease ids from RegisterAgentResponse",
            )
        if not batch:  # one lease, as before batches: no list to build
            ttl = await self.store.keep_alive(request.lease_id) if request.lease_id else 0
            self.metrics.lease_renewals.inc(ttl > 0)
            return metadata_pb2.KeepAliveResponse(lease_id=request.lease_id, ttl_s=ttl)
        if request.lease_id:
            ttls = await self.store.keep_alive_many([request.lease_id, *batch])
            ttl = ttls.pop(0)
        else:
            ttls, ttl = await self.store.keep_alive_many(batch), 0
        self.metrics.lease_renewals.inc(len(ttls) - ttls.count(0) + (ttl > 0))
        return metadata_pb2.KeepAliveResponse(lease_id=request.lease_id, ttl_s=ttl, ttls_s=ttls)

    async def UnregisterAgent(self, request, context):  # noqa: N802
        return await self._call(
            "UnregisterAgent",
            request,
            context,
            lambda: self.unregister(request.name, request.epoch, request.lease_id),
        )

    async def unregister(
        self, name: str, epoch: int = 0, lease_id: int = 0, *, evict: bool = False
    ) -> metadata_pb2.UnregisterAgentResponse:
        """Ends the record of ``name`` if it is under ``lease_id``; ``evict`` (the admin
        API, behind the admin token) ends it whatever its lease."""
        self.store.refuse_writes()
        for _ in range(8):
            current = await self.store.get(name)
            if current is None or (epoch and current.epoch != epoch):
                return metadata_pb2.UnregisterAgentResponse(existed=False)
            if not evict and current.lease_id != lease_id:
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"agent {name!r} is registered under a lease this request does not hold: only "
                    "its registrant unregisters it (lease_id from its RegisterAgentResponse); an "
                    f"administrator evicts it with the admin API (DELETE /v1/agents/{name})",
                )
            if await self.store.delete_if(name, current.revision):
                await self.store.revoke_lease(current.lease_id)
                logger.info("unregistered %s epoch %#x", name, current.epoch)
                return metadata_pb2.UnregisterAgentResponse(existed=True)
        raise Refused(grpc.StatusCode.ABORTED, f"{name!r} kept changing; retry")

    async def GetAgent(self, request, context):  # noqa: N802
        """``_call`` unrolled, the hottest RPC: the store's encoded answer goes out as
        it is (no copy, no encoding here; see ``_ENCODED_ANSWERS``)."""
        start = time.perf_counter()
        try:
            if self._token is not None:
                self._authorize(context)
            if type(request) is _Malformed:
                _check_parsed(request)
            answer = await self.store.get_answer(request.name)
            if answer is None:
                raise _not_found(request.name)
            return answer
        except Refused as refused:
            await context.abort(refused.code, str(refused), trailing_metadata=refused.trailing_metadata)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable(exc))
        finally:
            self._get_seconds.observe(time.perf_counter() - start)

    async def get(self, name: str) -> metadata_pb2.GetAgentResponse:
        record = await self.store.get(name)
        if record is None:
            raise _not_found(name)
        record.ClearField("lease_id")  # the registrant's secret
        return metadata_pb2.GetAgentResponse(record=record)

    async def GetAgents(self, request, context):  # noqa: N802
        return await self._call("GetAgents", request, context, lambda: self.get_many(request.names))

    async def get_many(self, names: Sequence[str]) -> bytes:
        """The encoded GetAgentsResponse: the GetAgent answers of the names found (the
        stored ones, on the memory store and a read replica), joined, up to
        ``max_page_bytes`` (at least one name's), and how many names it covers."""
        _check_names(
            names, MAX_LOOKUPS_PER_CALL, "names in one GetAgentsRequest", "split them over several calls"
        )
        if len(set(names)) != len(names):
            # Each copy would be answered in full: a small request, a large answer.
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "names: a name is given twice")
        parts: list[bytes] = []
        size = answered = 0
        for answer in await self.store.get_answers(names):
            if answer is not None:
                if answered and size + len(answer) > self.limits.max_page_bytes:
                    break
                parts.append(answer)
                size += len(answer)
            answered += 1
        parts += (_ANSWERED_TAG, _varint(answered))
        return b"".join(parts)

    async def ListAgents(self, request, context):  # noqa: N802
        return await self._call("ListAgents", request, context, lambda: self.list(request))

    async def list(self, request: metadata_pb2.ListAgentsRequest) -> metadata_pb2.ListAgentsResponse:
        """One page, read from the store a chunk at a time: a call copies at most a
        page's worth of records beyond the one chunk it is looking at."""
        lim = self.limits
        if request.page_size < 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "page_size must not be negative")
        size = min(request.page_size or lim.default_page_size, lim.max_page_size)
        cursor = ""
        if request.page_token:
            try:
                cursor = base64.urlsafe_b64decode(request.page_token.encode()).decode()
                check_name(cursor)
            except (ValueError, ConfigError):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "invalid page_token") from None
        filtered = bool(request.role or request.labels)
        page: list[metadata_pb2.AgentRecord] = []
        page_bytes = scanned = 0
        full = False
        while not full and scanned < lim.max_list_scan:
            chunk = await self.store.list_page(cursor, PAGE_RECORDS if filtered else min(PAGE_RECORDS, size))
            if not chunk:
                break
            for record in chunk:
                scanned += 1
                cursor = record.name
                if _matches(record, request.role, request.labels):
                    record.ClearField("lease_id")
                    page.append(record)
                    page_bytes += record.ByteSize()
                    full = len(page) >= size or page_bytes >= lim.max_page_bytes
                if full or scanned >= lim.max_list_scan:
                    break
            del chunk  # the records not taken go now, not at the end of the call
        more = bool(cursor) and bool(await self.store.list_page(cursor, 1))
        token = base64.urlsafe_b64encode(cursor.encode()).decode() if more else ""
        return metadata_pb2.ListAgentsResponse(records=page, next_page_token=token)

    async def WatchAgents(self, request, context):  # noqa: N802
        try:
            self._authorize(context)
            _check_parsed(request)
            # A read replica's watch takes a slot set aside for replicas while one is
            # free, else an agent's, like any watch: never worse off than an agent.
            replica = (
                _says_replica(context)
                and not (request.names or request.role or request.labels)
                and self.replica_watch_streams < self.limits.max_replica_watch_streams
            )
            if (
                not replica
                and self.watch_streams - self.replica_watch_streams >= self.limits.max_watch_streams
            ):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.watch_streams - self.replica_watch_streams} watch streams are open, "
                    "the most this service serves (kvx metadata --max-watch-streams; and "
                    f"{self.replica_watch_streams} read replicas', --max-replica-watch-streams); "
                    "close one, or raise the limit",
                )
            names = _check_watch_names(request.names)
        except Refused as refused:
            await context.abort(refused.code, str(refused))
        self.watch_streams += 1
        self.replica_watch_streams += replica
        sent: set[str] = set()  # names this stream has shown as present
        # Several events per message only for a watcher that asked (an older one reads
        # one event per message), up to the bytes it asked for and the service's cap.
        batch_bytes = min(request.batch_bytes, WATCH_BATCH_BYTES_MAX)
        events = self.store.watch_batches(
            self.limits.watch_queue_events,
            names,
            WATCH_BATCH_EVENTS if batch_bytes else 1,
            batch_bytes or None,
        )
        try:
            async for batch in events:
                out: list[bytes] = []
                for event in batch:
                    if event.type is EventType.SYNCED:
                        out.append(
                            Event(type=Event.EVENT_TYPE_SYNCED, revision=event.revision).SerializeToString()
                        )
                        continue
                    assert event.record is not None, event  # every event but SYNCED carries its record
                    name = event.record.name
                    if event.type is EventType.PUT and _matches(event.record, request.role, request.labels):
                        sent.add(name)
                        out.append(_encoded(event, Event.EVENT_TYPE_PUT))
                    elif name in sent:
                        # Gone, or no longer matching the filter: either way it leaves this view.
                        sent.discard(name)
                        out.append(_encoded(event, Event.EVENT_TYPE_DELETE))
                for message in _batched(out, batch_bytes):  # 0: each event alone
                    yield message
        except WatchLagError as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{exc}: this watcher reads too slowly and was cut off; read faster, or watch "
                "again (a new watch starts from the current records)",
            )
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable(exc))
        finally:
            self.watch_streams -= 1
            self.replica_watch_streams -= replica
            # Now, not when the collector finds it: a cancelled stream's subscription
            # (and what it keeps) goes with it.
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()


def _says_replica(context: Any) -> bool:
    return any(
        key == READ_REPLICA_HEADER and value == "1" for key, value in context.invocation_metadata() or ()
    )


def max_receive_bytes(limits: ServiceLimits) -> int:
    """The largest request the service reads: the largest valid record, or the
    largest valid watch of names (602,112 bytes with the default limits), and
    64 KiB for the rest of the message."""
    return max(limits.max_record_bytes, MAX_WATCH_NAMES_BYTES) + 64 * 1024


# The service pings a connection that has sent it nothing for this long, and closes it
# when the ping is not answered within the timeout: a client gone without a word (a host
# lost, a partition) holding a watch that receives nothing would otherwise keep its
# --max-watch-streams slot for gRPC's default of two hours. kvx's clients ping more
# often while they watch (kvx/metadata/client.py), and an answered ping or renewal resets
# this timer, so it pings only connections that are silent.
CLIENT_KEEPALIVE_S = 60.0
CLIENT_KEEPALIVE_TIMEOUT_S = 20.0


# gRPC health: Watch streams open at once, and the longest service name one may name.
# Health needs no token (probes have none), so without these anyone could hold any
# number of streams, each keyed by a name up to the message limit (600 KiB).
MAX_HEALTH_WATCHES = 64
MAX_HEALTH_SERVICE_CHARS = 256
# Reflection needs no token either (grpcurl and friends): its streams are bounded
# the same way, and one that asks nothing for REFLECTION_IDLE_S is ended.
MAX_REFLECTION_STREAMS = 64
REFLECTION_IDLE_S = 30.0


class _BoundedHealth(health.aio.HealthServicer):  # type: ignore[name-defined]
    """gRPC's health service with its Watch streams bounded (MAX_HEALTH_WATCHES,
    MAX_HEALTH_SERVICE_CHARS); Check as before. Watch is gRPC's, but for one
    thing: gRPC's drops a service's condition when any one of its watchers
    leaves, after which the others never hear of a change again; here it goes
    with the last."""

    def __init__(self) -> None:
        super().__init__()
        self._watching: dict[str, int] = {}  # service -> its open Watch streams

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802
        service = request.service
        if len(service) > MAX_HEALTH_SERVICE_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"service name of {len(service)} characters; at most {MAX_HEALTH_SERVICE_CHARS}",
            )
        if sum(self._watching.values()) >= MAX_HEALTH_WATCHES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_HEALTH_WATCHES} health watches are open already; use Check, or retry later",
            )
        self._watching[service] = self._watching.get(service, 0) + 1
        condition = self._server_watchers[service]
        last = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                        last = status
                    await condition.wait()
        finally:
            self._watching[service] -= 1
            if not self._watching[service]:
                del self._watching[service]
                self._server_watchers.pop(service, None)


class _BoundedReflection(reflection.aio.ReflectionServicer):  # type: ignore[name-defined]
    """gRPC's server reflection with its streams bounded: MAX_REFLECTION_STREAMS
    at once (RESOURCE_EXHAUSTED beyond), each ended once it has asked nothing
    for REFLECTION_IDLE_S. The answers are gRPC's. A client that asks but
    reads no answer leaves its stream waiting on flow control: it keeps its
    slot, and what gRPC buffers for it (its flow-control window), until its
    call ends."""

    def __init__(self, service_names: list[str]) -> None:
        super().__init__(service_names)
        self._open = 0

    async def ServerReflectionInfo(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        if self._open >= MAX_REFLECTION_STREAMS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_REFLECTION_STREAMS} reflection streams are open already; retry later",
            )
        self._open += 1
        try:
            async for response in super().ServerReflectionInfo(_idle_bounded(request_iterator), context):
                yield response
        finally:
            self._open -= 1


async def _idle_bounded(requests: Any) -> Any:
    """``requests``, ending when none comes for REFLECTION_IDLE_S."""
    iterator = aiter(requests)
    while True:
        try:
            request = await asyncio.wait_for(anext(iterator), REFLECTION_IDLE_S)
        except (StopAsyncIteration, TimeoutError):
            return
        yield request


def server_options(limits: ServiceLimits) -> list[tuple[str, int]]:
    """The gRPC server's options. gRPC ignores a key it does not know without a word
    (tests/unit check each key against the gRPC library)."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes(limits)),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(CLIENT_KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(CLIENT_KEEPALIVE_TIMEOUT_S * 1000)),
        # kvx's clients ping every 10 s (a read replica's channel to its primary every 5 s)
        # while a watch sends them nothing (kvx/metadata/client.py), and older ones also
        # with no call open: accept that, instead of gRPC's default of one ping in 5 min
        # without data, past which a server answers with GOAWAY "too_many_pings". (It also
        # lets the service's own pings, CLIENT_KEEPALIVE_S, reach connections with no call.)
        ("grpc.keepalive_permit_without_calls", 1),
        # Their pings arrive bunched when either side is short of CPU (a loaded host, a
        # registration storm): a 5 s pinger must not be cut off for two pings that land
        # 4 s apart, which took every stream of that connection down with it. (gRPC's
        # constant GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS names this key;
        # an unknown key is ignored without a word, and the default then counts every
        # ping of a watch that sends nothing as a strike.)
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        # A service starved of CPU for seconds reads a client's pings of that time
        # together; three such bunches (gRPC's default of 2 strikes) cut it off.
        ("grpc.http2.max_ping_strikes", 10),
    ]


def _not_found(name: str) -> Refused:
    return Refused(grpc.StatusCode.NOT_FOUND, f"no agent named {name!r} is registered")


def _held(name: str, current: metadata_pb2.AgentRecord, remaining_s: int, etcd_term: int) -> Refused:
    trailers = [(RETRY_AFTER_KEY, str(remaining_s * 1000))]
    if etcd_term:
        trailers.append((LEASE_ETCD_TERM_KEY, str(etcd_term)))
    return Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"agent name {name!r} is held by a live registration (epoch {current.epoch:#x}) whose lease "
        f"runs {remaining_s} s more unless renewed"
        + (" (etcd's time for it: this service replica does not renew it)" if etcd_term else "")
        + "; only a registration with that lease replaces it. A restarted agent gets its name back "
        "when the old lease expires; a dead holder can be evicted with the admin API "
        f"(DELETE /v1/agents/{name})",
        tuple(trailers),
    )


def check_security(*, token: str | None, admin_token: str | None, admin_reads_need_token: bool) -> None:
    """Refuses settings that would be weaker than they look (TlsConfig checks its own)."""
    if admin_reads_need_token and not (admin_token or token):
        raise ConfigError(
            "admin reads need a token (--admin-reads-need-token) but none is configured: "
            "give --admin-token-file (or --token-file)"
        )
    if token and admin_token and hmac.compare_digest(token.encode(), admin_token.encode()):
        raise ConfigError(
            "the admin token equals the gRPC token: every agent could evict any other through "
            "the admin API; give --admin-token-file and --token-file different tokens"
        )


class MetadataServer:
    """The gRPC service, health, reflection and (optionally) the admin API, on one event loop."""

    def __init__(
        self,
        listen: str = "127.0.0.1:50051",
        store: Store | None = None,
        *,
        admin_listen: str | None = None,
        admin_token: str | None = None,
        admin_reads_need_token: bool = False,
        token: str | None = None,
        tls: TlsConfig | None = None,
        limits: ServiceLimits | None = None,
    ) -> None:
        check_security(token=token, admin_token=admin_token, admin_reads_need_token=admin_reads_need_token)
        self.listen = listen
        self.store = store or MemoryStore()
        self.limits = limits or ServiceLimits()
        self.metrics = ServiceMetrics(self.store)
        self.servicer = MetadataServicer(self.store, self.limits, self.metrics, token)
        self.token = token
        self.admin_listen = admin_listen
        self.admin_token = admin_token
        self.admin_reads_need_token = admin_reads_need_token
        self.tls = tls
        self.address = ""
        self.admin_address = ""
        self._server: aio.Server | None = None
        self._health = _BoundedHealth()
        self._tasks: list[asyncio.Task] = []
        self._admin: Any = None
        self.ready = False

    async def start(self) -> None:
        try:
            await self.store.start()
        except StoreError as exc:
            # Serve anyway, reporting not-ready: the store may come up after us.
            logger.warning("metadata store not reachable yet (%s); serving, not ready", exc)
        try:
            self.metrics.gc_pauses.install()
            await self._start_serving()
        except BaseException:
            await self.stop(0)  # nothing half-started is left behind
            raise

    async def _start_serving(self) -> None:
        try:
            host, _ = parse_listen_address(self.listen)
        except ConfigError:
            raise ConfigError(
                f"metadata service listen address {self.listen!r}: expected host:port, e.g. 127.0.0.1:50051"
            ) from None
        options = server_options(self.limits)
        self._server = aio.server(options=options)
        self._server.add_generic_rpc_handlers((_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            _BoundedReflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]), self._server
        )
        self.address = format_address(host, self._add_port(self._server))
        await self._server.start()
        await self._update_health()
        self._tasks.append(asyncio.create_task(self._health_loop(), name="kvx-metadata-health"))
        if self.admin_listen:
            # Here, not at the top: FastAPI takes about half a second to import, paid only
            # when the admin API is on. kvx.admin does not import this module (no cycle).
            from kvx.admin.app import serve_admin

            self._admin = await serve_admin(self)
        logger.info(
            "kvx metadata service on %s (store: %s, event loop: %s)%s",
            self.address,
            self.store.name,
            type(asyncio.get_running_loop()).__module__.split(".")[0],  # asyncio or uvloop
            f", admin API on {self.admin_address}" if self.admin_address else "",
        )
        self._warn_exposure(host)

    def _warn_exposure(self, host: str) -> None:
        """Says so at startup where a setting leaves the service open to its network."""
        if is_loopback(host):
            return
        if self.token is None and not (self.tls and self.tls.client_ca):
            logger.warning(
                "the gRPC port %s is reachable beyond this host with no token and no client "
                "certificates: anyone who reaches it can register, read and renew (set --token-file, "
                "or --tls-client-ca with --tls-cert/--tls-key)",
                self.address,
            )
        elif self.token is not None and self.tls is None:
            logger.warning(
                "the gRPC token travels in plaintext on %s: anyone on the path can read it "
                "(serve TLS with --tls-cert/--tls-key)",
                self.address,
            )
        admin_host = self.admin_address.rpartition(":")[0].strip("[]")
        if self.admin_address and not is_loopback(admin_host) and (self.admin_token or self.token):
            logger.warning(
                "the admin API on %s is plain HTTP: its bearer tokens cross the network in the "
                "clear; keep it on loopback or behind a TLS proxy",
                self.admin_address,
            )

    def _add_port(self, server: aio.Server) -> int:
        """Binds ``self.listen``; the port bound."""
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.listen)
            else:
                creds = grpc.ssl_server_credentials(
                    [(read_file(self.tls.key), read_file(self.tls.cert))],
                    root_certificates=read_file(self.tls.client_ca) if self.tls.client_ca else None,
                    require_client_auth=self.tls.client_ca is not None,
                )
                port = server.add_secure_port(self.listen, creds)
        except RuntimeError:  # how grpcio reports a port it cannot bind (older ones returned 0)
            port = 0
        if not port:
            raise ConfigError(
                f"the metadata service cannot listen on {self.listen} (is another process "
                "on that port? pick another with --listen)"
            )
        return port

    async def _update_health(self) -> None:
        try:
            ready = await asyncio.wait_for(self.store.ready(), 5)
        except (TimeoutError, StoreError):
            ready = False
        if ready != self.ready:
            logger.log(
                logging.INFO if ready else logging.WARNING,
                "metadata store %s",
                "ready" if ready else "NOT ready",
            )
        self.ready = ready
        self.metrics.store_ready.set(1 if ready else 0)
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            result = self._health.set(service, status)
            if asyncio.iscoroutine(result):
                await result

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self._update_health()

    async def stop(self, grace_s: float = 1.0) -> None:
        self.metrics.gc_pauses.remove()
        for task in self._tasks:
            task.cancel()
        if self._admin is not None:
            await self._admin.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.store.close()

    async def serve_forever(self, *, freeze_gc: bool = False) -> None:
        """Serves until terminated. ``freeze_gc``: once serving, what exists then
        (modules, the server, the admin API) is set aside from the cycle
        collector for good (gc.freeze()); for a process that is only this service."""
        await self.start()
        assert self._server is not None  # start() returned: it serves
        if freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            await self._server.wait_for_termination()
        finally:
            await self.stop()


class ThreadedServer:
    """A MetadataServer on its own event loop in a background thread
    (``kvx demo``, tests, embedding next to an engine)."""

    def __init__(self, server: MetadataServer, start_timeout_s: float = 30.0) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvx-metadata", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            raise RuntimeError("the metadata service did not start in time")
        if self._error is not None:
            raise self._error

    @property
    def address(self) -> str:
        return self.server.address

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        self._loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, _T], timeout_s: float = 30.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.call(self.server.stop(0.5))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
