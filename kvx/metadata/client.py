"""The metadata service client used by agents (synchronous gRPC, background threads).

- ``MetadataClient``: the RPCs, with gRPC errors translated into kvx errors.
- ``Registration``: keeps one agent registered: registers, renews its lease
  (on one KeepAlive stream shared by the process's registrations that use
  the same service and options, one message per round; their registrations
  that wait together go in one RegisterAgents call), registers again by
  itself when the service restarts
  or the lease is lost (never giving up: while another lease holds the name
  it retries when that lease would run out), and unregisters on stop.
- ``Watcher``: follows WatchAgents, reconnecting (and so resynchronising from
  a fresh snapshot) after the service restarts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from kvx.config import read_file
from kvx.errors import ConfigError, ConnectError, MetadataError
from kvx.metadata.roles import role_filter
from kvx.v1 import metadata_pb2, metadata_pb2_grpc

logger = logging.getLogger(__name__)

AgentRecord = metadata_pb2.AgentRecord
_Response = TypeVar("_Response")

CHANNEL_OPTIONS = [
    # Pings only while a call is open: a channel with none has nothing to lose to a
    # dead connection, and the next call's pings find it (its deadline bounds it).
    ("grpc.keepalive_permit_without_calls", 0),
    # gRPC stops pinging after two pings while this side sends nothing, then pings once a
    # minute: a watch (nothing sent after its request) of a service gone without a word
    # was noticed after about a minute (56 s measured), not within keepalive's bound.
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
# Keepalive: a connection gone without a word (a host lost, a partition) is noticed
# within the ping interval and KEEPALIVE_TIMEOUT_S while a call is open. gRPC pings
# only while nothing is read (each read resets the timer), so the channel of an
# agent's lease renewals, answered every few seconds, sends none: what pings is an
# agent's one watch, idle while its peers do not change. Each ping costs the service
# 0.10-0.13 ms of CPU (measured on a 2-core VM): 100,000 agents' watches ping 10,000
# times a second at this interval, about 1.2 cores of that VM in all.
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# A read replica's own watch of its primary: few, and its copy goes stale (--mirror-stale-s).
MIRROR_KEEPALIVE_S = 5.0
# gRPC waits up to 120 s between attempts to reconnect a channel whose service is
# down, and fails calls meanwhile: an agent would find its service (or its read
# replica) back up to two minutes late. The cap is also how often every agent
# tries while the service is down, and how widely their returns spread (gRPC
# jitters it by 20 %), so it differs by channel:
# - an agent's channel to the service: 100,000 agents try about 3,300
#   connections a second while it is down, and come back over about 30 s;
RECONNECT_MAX_S = 30.0
# - to a read replica: only its share of the agents, which watch the service
#   meanwhile and ask the replica's health about this often (READER_PROBE_S);
READER_RECONNECT_MAX_S = 10.0
# - a read replica's own channel to its primary: a few replicas, whose copy goes stale.
MIRROR_RECONNECT_MAX_S = 5.0


def channel_options(reconnect_max_s: float, keepalive_s: float | None = None) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS, a ping every ``keepalive_s`` (default KEEPALIVE_S) while nothing
    is read, and a reconnection backoff of at most ``reconnect_max_s``."""
    return [
        *CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", int((KEEPALIVE_S if keepalive_s is None else keepalive_s) * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(reconnect_max_s * 1000)),
    ]


_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
# Call metadata of a read replica's watch of its primary ("1"): the primary
# serves it from slots set aside for replicas (ServiceLimits.max_replica_watch_streams)
# while one is free, so that agents' watches filling --max-watch-streams cannot
# cut its replicas off.
READ_REPLICA_HEADER = "kvx-read-replica"
# A Watcher that fell back from a read replica to the service asks the replica's
# health about this often (jittered, from half to one and a half times it), and
# watches it again once it answers SERVING. Each return the replica does not keep
# (READER_STAYED_S) doubles the wait, up to READER_PROBE_MAX_S; one it keeps resets it.
READER_PROBE_S = 10.0
READER_PROBE_MAX_S = 300.0
READER_PROBE_TIMEOUT_S = 2.0  # one health check's deadline
# A return to the replica counts as kept once its watch has lived this long past its snapshot.
READER_STAYED_S = 10.0
# A watch that leaves its replica moves to the service after a random wait of up to this:
# the agents of a replica that dies do not all open a watch there at once.
READER_MOVE_SPREAD_S = 2.0
# The service's trailer on a registration refused because another lease holds the name.
_RETRY_AFTER_KEY = "kvx-retry-after-ms"
# With it, the etcd raft term of that time when the service does not renew that lease
# itself (NameHeldError.etcd_term).
_LEASE_ETCD_TERM_KEY = "kvx-lease-etcd-term"
# Bounds on how long to wait before asking again for a name another lease holds:
# the service's own max lease ttl is 300 s. An etcd lease backstop may be longer: a
# starting agent then waits for it in several waits (_UNTRACKED_WAITS), about 41
# min in all, and gives up on a dead holder whose etcd lease runs longer.
_HELD_RETRY_MIN_S = 0.1
_HELD_RETRY_MAX_S = 310.0
# A starting agent asks for a held name until this long past the time the service said.
_HELD_SLACK_S = 1.0
# Waits a starting agent gives a name held by a lease the service does not renew
# itself (its time is etcd's, which a new etcd leader resets) before it gives up.
_UNTRACKED_WAITS = 8
# During such a wait it asks again every quarter of the time left, but not more often
# than this, to see that time rise: a lease renewed at another replica rises at least
# once per etcd ttl (every third of it, up to two thirds where etcd's ttl is the
# agent's) within one etcd term; a dead one only in a new term.
_HELD_POLL_MIN_S = 1.0
# A rise: an answer this much above what the previous one left, less the time from
# that answer to the next question. That time is shorter than the one between the two
# readings, and answers are whole seconds (off by under 1 s): a time that only runs
# down never shows a rise. A renewal shows one if it puts back more than this + 1 s
# plus the time a question and its answer spend in flight.
_HELD_RISE_S = 1.5
# How long past its wait a starting agent keeps asking a service it cannot reach.
_HELD_OUTAGE_GRACE_S = 15.0
# While the name stays held, a warning at most this often.
_HELD_WARN_EVERY_S = 60.0
# Leases per KeepAlive message (the service refuses more: proto/kvx/v1/metadata.proto).
MAX_LEASES_PER_MESSAGE = 1024
# Registrations one RegisterAgents call carries at most (the service refuses more),
# and the encoded bytes past which a batch is cut: within the receive limit of a
# service with the default limits (a larger record goes alone).
MAX_REGISTRATIONS_PER_CALL = 128
_MAX_BATCH_BYTES = 256 * 1024
# The most names one watch may name (WatchAgentsRequest.names; the proto's bound).
MAX_WATCH_NAMES = 4096
# The most names one GetAgents call may look up (GetAgentsRequest.names; the proto's bound).
MAX_LOOKUPS_PER_CALL = 64
# A service that answered GetAgents UNIMPLEMENTED is asked one name a call this long,
# then GetAgents again (it, or the one behind its address, may have been upgraded).
ONE_BY_ONE_S = 60.0
# KeepAlive messages sent and not yet answered past which a renewal round is skipped.
_MAX_UNANSWERED_MESSAGES = 256


class NameHeldError(MetadataError):
    """The name is held by another live lease (FAILED_PRECONDITION);
    ``retry_after_s``: when that lease runs out unless renewed. ``etcd_term``:
    nonzero when the service does not renew that lease itself (``untracked``:
    another replica or none renews it); the time is then etcd's, read in that
    etcd raft term, and a new term (a new etcd leader) sets it back to the full
    etcd ttl even when the holder is dead."""

    def __init__(
        self,
        message: str,
        code: object,
        retry_after_s: float,
        etcd_term: int = 0,
        reported_s: float | None = None,
    ) -> None:
        super().__init__(message, code)
        self.retry_after_s = retry_after_s
        self.etcd_term = etcd_term
        # The time the service said, before retry_after_s's bounds.
        self.reported_s = retry_after_s if reported_s is None else reported_s

    @property
    def untracked(self) -> bool:
        return self.etcd_term != 0


@dataclasses.dataclass(frozen=True)
class MetadataOptions:
    """How an agent talks to the metadata service.

    token:      sent as ``authorization: Bearer <token>`` on every call.
    tls_ca:     PEM file of the CA that signed the service's certificate;
                setting it switches the channel to TLS.
    tls_cert, tls_key: client certificate, when the service requires one.
    lease_ttl_s: the agent's lease; it is renewed every third of it.
    timeout_s:  per call.
    read_target: "host:port" of a read replica of the service (``kvx metadata
                --store mirror://SERVICE``), with the same token and TLS
                settings: an agent's peer lookups and its watch go there,
                its registration and renewals to the service itself.
    """

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    lease_ttl_s: int = 10
    timeout_s: float = 5.0
    read_target: str | None = None


def translate(exc: grpc.RpcError, target: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    retry_after_ms: str | None = None
    etcd_term: Any = None
    if code == grpc.StatusCode.FAILED_PRECONDITION and hasattr(exc, "trailing_metadata"):
        trailers = {str(item[0]): item[1] for item in exc.trailing_metadata() or ()}  # type: ignore[index]
        retry_after_ms = trailers.get(_RETRY_AFTER_KEY)
        etcd_term = trailers.get(_LEASE_ETCD_TERM_KEY)
    return _status_error(target, code, detail, retry_after_ms, etcd_term)


def _status_error(
    target: str, code: Any, detail: str | None, retry_after_ms: Any = None, etcd_term: Any = None
) -> Exception:
    """The kvx error for a gRPC status (a call's, or one result of a RegisterAgents call)."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ConnectError(f"metadata service at {target} unavailable: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION and retry_after_ms is not None:
        try:
            reported_s = int(retry_after_ms) / 1000
        except (ValueError, OverflowError):
            pass
        else:
            retry_after_s = min(max(reported_s, _HELD_RETRY_MIN_S), _HELD_RETRY_MAX_S)
            return NameHeldError(
                f"metadata service at {target}: {detail}", code, retry_after_s, _term(etcd_term), reported_s
            )
    return MetadataError(f"metadata service at {target}: {detail}", code)


def _term(value: Any) -> int:
    """An etcd raft term from the service (0: none, or not a term)."""
    try:
        term = int(value)
    except (TypeError, ValueError):
        return 0
    return term if 0 < term < 1 << 64 else 0


# gRPC status codes by number (RegisterAgentResult.code).
_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def credentials(opts: MetadataOptions) -> grpc.ChannelCredentials | None:
    """The channel's TLS credentials from ``opts``; None for plaintext."""
    if bool(opts.tls_cert) != bool(opts.tls_key):
        raise ConfigError("MetadataOptions: tls_cert and tls_key go together")
    if not (opts.tls_ca or opts.tls_cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(opts.tls_ca) if opts.tls_ca else None,
        private_key=read_file(opts.tls_key) if opts.tls_key else None,
        certificate_chain=read_file(opts.tls_cert) if opts.tls_cert else None,
    )


def call_metadata(opts: MetadataOptions) -> list[tuple[str, str]] | None:
    """What every call carries: the bearer token, when there is one."""
    return [("authorization", f"Bearer {opts.token}")] if opts.token else None


def read_many_through(
    reader: MetadataClient, service: MetadataClient, names: Sequence[str]
) -> list[AgentRecord | None]:
    """``read_through`` of several names, a GetAgents call (or a few) each way: the names
    ``reader`` lacks (or all, when it does not answer) are asked of ``service``."""
    records: list[AgentRecord | None] = [None] * len(names)
    if reader is not service:
        with contextlib.suppress(ConnectError):
            records = reader.get_many(names)
    missing = [i for i, record in enumerate(records) if record is None]
    if missing:
        for i, record in zip(missing, service.get_many([names[i] for i in missing]), strict=True):
            records[i] = record
    return records


def read_through(
    reader: MetadataClient, service: MetadataClient, name: str
) -> tuple[AgentRecord | None, MetadataClient]:
    """``name``'s record from ``reader`` (a read replica), else from ``service``
    itself, and the client that answered: a replica that lacks the name (it
    may not have copied a registration of a moment ago) or does not answer is
    not the last word. The two count revisions of their own: compare those of
    one service only."""
    if reader is not service:
        try:
            record = reader.get(name)
        except ConnectError:
            record = None
        if record is not None:
            return record, reader
    return service.get(name), service


def _match(
    asked: list[str], response: metadata_pb2.GetAgentsResponse, target: str
) -> list[AgentRecord | None]:
    """The records of the names ``response`` answered (it covers ``asked[:answered]``),
    None for each name it left out; checked, since a service names what it sends."""
    covered = asked[: response.answered]
    if not 0 < response.answered <= len(asked):
        raise MetadataError(
            f"metadata service at {target}: GetAgents answered {response.answered} of {len(asked)} names"
        )
    found = iter(response.records)
    out: list[AgentRecord | None] = []
    record = next(found, None)
    for name in covered:
        if record is not None and record.name == name:
            out.append(record)
            record = next(found, None)
        else:
            out.append(None)
    if record is not None:
        raise MetadataError(
            f"metadata service at {target}: GetAgents answered a record of {record.name!r}, "
            "not one of the names asked, or out of their order"
        )
    return out


class MetadataClient:
    """One channel to a metadata service; ``reader``: to a read replica of it, which
    its agents try to reconnect to more often (READER_RECONNECT_MAX_S)."""

    def __init__(self, target: str, options: MetadataOptions | None = None, reader: bool = False) -> None:
        self.target = target
        self.options = options or MetadataOptions()
        self.reconnect_max_s = READER_RECONNECT_MAX_S if reader else RECONNECT_MAX_S
        self.keepalive_s = KEEPALIVE_S
        opts = self.options
        creds = credentials(opts)
        channel_opts = channel_options(self.reconnect_max_s, self.keepalive_s)
        if creds is not None:
            self._channel = grpc.secure_channel(target, creds, options=channel_opts)
        else:
            self._channel = grpc.insecure_channel(target, options=channel_opts)
        self.stub = metadata_pb2_grpc.MetadataServiceStub(self._channel)
        self.call_metadata = call_metadata(opts)
        self._one_by_one_until = -math.inf  # the service answered GetAgents UNIMPLEMENTED

    def close(self) -> None:
        self._channel.close()

    def serving(self, timeout_s: float | None = None) -> bool:
        """Whether the service's health check says SERVING (a read replica: its copy
        follows the primary); False when it does not answer."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            answer = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(),
                metadata=self.call_metadata,
                timeout=self.options.timeout_s if timeout_s is None else timeout_s,
            )
        except grpc.RpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def _unary(self, method: Callable[..., _Response], request: object) -> _Response:
        try:
            return method(request, timeout=self.options.timeout_s, metadata=self.call_metadata)
        except grpc.RpcError as exc:
            raise translate(exc, self.target) from None

    def register(
        self, record: AgentRecord, ttl_s: int = 0, lease_id: int = 0
    ) -> metadata_pb2.RegisterAgentResponse:
        """``lease_id``: the lease of our current registration of this name, if any
        (needed to refresh or replace a live record). Raises NameHeldError while
        another live lease holds the name."""
        return self._unary(
            self.stub.RegisterAgent,
            metadata_pb2.RegisterAgentRequest(record=record, ttl_s=ttl_s, lease_id=lease_id),
        )

    def register_many(
        self, requests: list[metadata_pb2.RegisterAgentRequest]
    ) -> list[metadata_pb2.RegisterAgentResponse | Exception]:
        """Several registrations in one RegisterAgents call: each one's response, or
        the error ``register`` would have raised for it. Raises (for all of them)
        when the call itself fails: MetadataError with UNIMPLEMENTED from a service
        older than the call."""
        response = self._unary(
            self.stub.RegisterAgents, metadata_pb2.RegisterAgentsRequest(requests=requests)
        )
        if len(response.results) != len(requests):
            raise MetadataError(
                f"metadata service at {self.target}: {len(response.results)} results "
                f"answered for {len(requests)} registrations"
            )
        return [
            result.response
            if result.code == 0
            else _status_error(
                self.target,
                _STATUS_BY_NUMBER.get(result.code, grpc.StatusCode.UNKNOWN),
                result.message,
                result.retry_after_ms if result.retry_after_ms > 0 else None,
                result.lease_etcd_term,
            )
            for result in response.results
        ]

    def get(self, name: str) -> AgentRecord | None:
        try:
            return self._unary(self.stub.GetAgent, metadata_pb2.GetAgentRequest(name=name)).record
        except MetadataError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def get_many(self, names: Sequence[str]) -> list[AgentRecord | None]:
        """Each name's record (None where no agent has it), in order: each name asked once,
        in GetAgents calls of MAX_LOOKUPS_PER_CALL names at most; from a service that
        answers GetAgents UNIMPLEMENTED (older than it), one GetAgent per name for the
        next ONE_BY_ONE_S."""
        unique = list(dict.fromkeys(names))
        found: list[AgentRecord | None] = []
        while len(found) < len(unique):
            name = unique[len(found)]
            if time.monotonic() < self._one_by_one_until:
                record = self.get(name)
                if record is not None and record.name != name:
                    raise MetadataError(
                        f"metadata service at {self.target}: GetAgent of {name!r} answered {record.name!r}'s record"
                    )
                found.append(record)
                continue
            asked = unique[len(found) : len(found) + MAX_LOOKUPS_PER_CALL]
            try:
                response = self._unary(self.stub.GetAgents, metadata_pb2.GetAgentsRequest(names=asked))
            except MetadataError as exc:
                if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._one_by_one_until = time.monotonic() + ONE_BY_ONE_S
                continue
            found += _match(asked, response, self.target)
        by_name = dict(zip(unique, found, strict=True))
        return [by_name[name] for name in names]

    def list(self, role: str | None = None, labels: dict[str, str] | None = None) -> list[AgentRecord]:
        request = metadata_pb2.ListAgentsRequest(role=role_filter(role), labels=labels or {}, page_size=1000)
        out: list[AgentRecord] = []
        while True:
            response = self._unary(self.stub.ListAgents, request)
            out.extend(response.records)
            if not response.next_page_token:
                return out
            request.page_token = response.next_page_token

    def unregister(self, name: str, epoch: int = 0, lease_id: int = 0) -> bool:
        """Ends our registration of ``name`` (the one under ``lease_id``); False if there was none."""
        return self._unary(
            self.stub.UnregisterAgent,
            metadata_pb2.UnregisterAgentRequest(name=name, epoch=epoch, lease_id=lease_id),
        ).existed


class Registration:
    """Keeps one agent's record registered until ``stop()``.

    Never gives up: when the lease is lost it registers again, and while
    another live lease holds the name (a restarted agent's predecessor whose
    lease still runs, or any other registrant) it asks again when the service
    says that lease runs out, logging why.
    """

    def __init__(self, client: MetadataClient, build_record: Callable[[], AgentRecord]) -> None:
        self.client = client
        self.build_record = build_record
        self.ttl_s = client.options.lease_ttl_s
        # The lease of the registration in force; None while there is none (or it is unknown).
        self.lease_id: int | None = None
        # The last lease granted, kept through outages: it proves to the service that the
        # live record (if it is still there) is ours.
        self._proof = 0
        self.name = ""  # the registered record's name (logs name it, never its lease id)
        self._held_since: float | None = None  # the name is held by another lease since then
        self._held_warned = 0.0
        # Registrations failing in a row (the service answered an error): logged sparingly.
        self._failing_since: float | None = None
        self._failed_text = ""
        self._failures = 0
        self._failed_warned = 0.0
        self._lock = threading.Lock()  # one registration call at a time
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._renewer: _Renewer | None = None  # shared with this process's other registrations
        self._registrar = _Registrar.of(client)  # likewise
        # The renewer's stream failed since the lease was last renewed (the service may be
        # away): update() then leaves publishing to the background thread, not to block.
        self.unconfirmed = False
        self.confirmed_at = 0.0  # monotonic: when the service last took or renewed the lease
        self._republish = False  # the background thread publishes the record again
        self._thread = threading.Thread(target=self._run, name="kvx-lease", daemon=True)

    def start(self) -> None:
        """Register now, then keep it. Raises if the service refuses the record or
        is unreachable. While another live lease holds the name (this agent's
        previous instance, dead but its lease not yet run out), waits for that
        lease to run out, up to its remaining ttl once; if it is renewed meanwhile,
        another live agent has this name, and that is raised. For a lease the
        service does not renew itself (``NameHeldError.untracked``: its time is
        etcd's, which a new etcd leader resets) only a time that rose twice within
        one etcd term shows a live holder; without that the lease is waited for
        again (_UNTRACKED_WAITS waits at most). A service unreachable for a while
        during the wait is asked again."""
        try:
            self._register()
        except NameHeldError as exc:
            self._wait_for_name(exc)
        self._thread.start()

    def _wait_for_name(self, exc: NameHeldError) -> None:
        logger.warning("%s; waiting up to %.1f s for that lease to run out", exc, exc.retry_after_s)
        now = time.monotonic()
        deadline = now + exc.retry_after_s + _HELD_SLACK_S
        waits = 1
        rises = 0  # renewals seen: rises of the holder's time within one etcd term
        last, last_at, last_term = exc.reported_s, now, exc.etcd_term
        pause_s = _held_pause(exc)
        while True:
            if self._stop.wait(pause_s):
                raise exc from None  # stopped while waiting
            asked_at = time.monotonic()
            try:
                self._register()
                return
            except ConnectError:
                if time.monotonic() >= deadline + _HELD_OUTAGE_GRACE_S:
                    raise
                pause_s = 1.0  # an outage (a service restart, etcd's): ask again soon
                continue
            except NameHeldError as again:
                exc = again
            now = time.monotonic()
            if exc.etcd_term != last_term:
                rises = 0  # a new etcd leader: etcd's time for every lease started again
            elif exc.reported_s > last - (asked_at - last_at) + _HELD_RISE_S:
                rises += 1  # within one term (or at this service): a renewal
            last, last_at, last_term = exc.reported_s, now, exc.etcd_term
            renewed_elsewhere = exc.untracked and rises >= 2  # proof enough: say so now
            if now < deadline and not renewed_elsewhere:
                pause_s = min(_held_pause(exc), deadline - now)
                continue
            if exc.untracked and not renewed_elsewhere and waits < _UNTRACKED_WAITS:
                waits += 1
                logger.warning(
                    "%s; still held past its time, but that lease is not renewed at this service "
                    "and was not seen renewed (a new etcd leader resets its time): waiting up to "
                    "%.1f s more",
                    exc,
                    exc.retry_after_s,
                )
                deadline = now + exc.retry_after_s + _HELD_SLACK_S
                pause_s = _held_pause(exc)
                continue
            if not exc.untracked:
                why = (
                    "The lease was renewed while we waited: another live agent uses this name "
                    "(give each agent its own name)"
                )
            elif renewed_elsewhere:
                why = (
                    "The lease was renewed while we waited (its time rose twice within one etcd "
                    "term): another live agent uses this name, renewing at another replica of "
                    "the service (give each agent its own name)"
                )
            else:
                why = (
                    f"The name stayed held through {waits} waits though its lease is not renewed "
                    "at this service: its holder may be dead, and its etcd lease then runs out "
                    "within the service's etcd lease backstop (or evict it, as above)"
                )
            raise MetadataError(f"{exc}. {why}", exc.code) from None

    def update(self) -> None:
        """Publish the record again now (regions changed). Raises MetadataError
        when the service refuses the record; while the service is unreachable
        the background thread publishes it once it is back, without blocking here."""
        if self.lease_id is None or self.unconfirmed:  # unreachable maybe: the thread will publish
            self._republish = True
            self._restart_stream()
            return
        try:
            self._register()
        except ConnectError as exc:
            logger.warning("could not update the registration now (%s); retrying in the background", exc)
            self.lease_id = None
        except NameHeldError as exc:
            # Our lease is gone and another holds the name: not this memory's fault. The
            # background thread asks again and publishes the record when it gets the name.
            logger.warning("could not update the registration now (%s); retrying in the background", exc)
            self.lease_id = None
        self._restart_stream()

    def stop(self, unregister: bool = True) -> None:
        self._stop.set()
        self._restart_stream()
        _Renewer.leave(self)
        if self._thread.is_alive():
            self._thread.join(self.client.options.timeout_s + 1)
        if unregister and self._proof:
            record = self.build_record()
            try:
                self.client.unregister(record.name, record.epoch, self._proof)
            except (ConnectError, MetadataError) as exc:
                logger.info("could not unregister %s (%s); its lease will expire", record.name, exc)

    def _register(self) -> None:
        with self._lock:
            self._republish = False  # this call publishes the record as it is now
            record = self.build_record()
            request = metadata_pb2.RegisterAgentRequest(record=record, ttl_s=self.ttl_s, lease_id=self._proof)
            response = self._registrar.register(request)
            self.name = record.name
            self.lease_id = self._proof = response.lease_id
            self.ttl_s = response.ttl_s
            self._held_since = None
            self.unconfirmed = False
            self.confirmed_at = time.monotonic()
        if self._stop.is_set():
            # stop() ran while this waited for its call (which may have waited for others):
            # its unregistration may have used the lease before this one. End this one too.
            try:
                self.client.unregister(record.name, record.epoch, response.lease_id)
            except (ConnectError, MetadataError) as exc:
                logger.info("could not unregister %s (%s); its lease will expire", record.name, exc)

    def _restart_stream(self) -> None:
        self._wake.set()

    def _lease_lost(self, lease_id: int) -> None:
        """The renewer's word: ``lease_id`` is gone (answered 0, or not renewed for its ttl)."""
        if self.lease_id == lease_id:  # not if update() registered again meanwhile
            self.lease_id = None
            self._wake.set()

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            wait_s = _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]
            # Cleared before the record is built, not after: an update() from here on wakes
            # the wait below, and its record is published next time round.
            self._wake.clear()
            try:
                if self.lease_id is None:
                    self._register()
                    logger.info("registered with the metadata service at %s again", self.client.target)
                elif self._republish:  # update() during an outage: the record changed
                    self._republish = False
                    self._register()
                attempt = 0
                self._failing_since = None
                self._keep_alive()
            except NameHeldError as exc:
                self.lease_id = None
                self._failing_since = None
                wait_s = exc.retry_after_s
                self._log_held(exc)
            except MetadataError as exc:
                self._log_failed(exc)
                self.lease_id = None
            except ConnectError as exc:
                self._failing_since = None
                if attempt == 0:
                    logger.warning("%s; registering again as soon as it is back", exc)
                self.lease_id = None
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED and attempt == 0:
                    logger.warning("lease keep-alive stream ended: %s", exc.details())
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.lease_id = None
            except Exception:  # noqa: BLE001 - a bug here must not end the registration for good
                logger.exception("metadata registration loop failed; trying again")
                self.lease_id = None
            self._stop.wait(wait_s)
            attempt += 1

    def _log_failed(self, exc: MetadataError) -> None:
        """The first of a run of the same refusal (a wrong token, a full registry), then
        one line every _HELD_WARN_EVERY_S with the count: every retry (every 2 s) would
        otherwise put a line in the agent's log for as long as the refusal lasts. Another
        refusal starts a new run."""
        now = time.monotonic()
        text = str(exc)
        if self._failing_since is None or text != self._failed_text:
            self._failing_since, self._failures, self._failed_warned = now, 0, now
            self._failed_text = text
            logger.warning("metadata registration failed: %s; trying again", exc)
        self._failures += 1
        if now - self._failed_warned >= _HELD_WARN_EVERY_S:
            self._failed_warned = now
            logger.warning(
                "metadata registration still failing (%d attempts in %.0f s): %s; trying again",
                self._failures,
                now - self._failing_since,
                exc,
            )

    def _log_held(self, exc: NameHeldError) -> None:
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        if now - self._held_warned >= _HELD_WARN_EVERY_S:
            self._held_warned = now
            logger.warning(
                "this agent is not registered (for %.0f s now): %s; asking again in %.1f s",
                now - self._held_since,
                exc,
                exc.retry_after_s,
            )

    def _keep_alive(self) -> None:
        """Hands the lease to this process's shared renewer, and waits until it is
        lost, the record is published again (update()), or stop()."""
        lease_id = self.lease_id
        if lease_id is None or self._republish:
            return
        _Renewer.renew(self, lease_id, self.ttl_s)
        while not self._stop.is_set() and not self._wake.wait(1.0):
            pass


class _Pending:
    """One registration waiting in a _Registrar: its answer, or its error, once ``done``."""

    __slots__ = ("request", "response", "error", "done")

    def __init__(self, request: metadata_pb2.RegisterAgentRequest) -> None:
        self.request = request
        self.response: metadata_pb2.RegisterAgentResponse | None = None
        self.error: Exception | None = None
        self.done = False

    def result(self) -> metadata_pb2.RegisterAgentResponse:
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


def _held_pause(exc: NameHeldError) -> float:
    """How long a starting agent waits before asking again for a held name: the
    time the service said, or for a lease it does not renew a quarter of it, so
    that the agent sees whether that time rises (Registration.start)."""
    if not exc.untracked:
        return exc.retry_after_s
    return min(exc.retry_after_s, max(_HELD_POLL_MIN_S, exc.retry_after_s / 4))


def _clone(exc: ConnectError | MetadataError) -> Exception:
    if isinstance(exc, NameHeldError):
        return NameHeldError(str(exc), exc.code, exc.retry_after_s, exc.etcd_term, exc.reported_s)
    if isinstance(exc, MetadataError):
        return MetadataError(str(exc), exc.code)
    return ConnectError(str(exc))


class _Registrar:
    """Sends together the registrations of every Registration of this process that
    talks to the same service with the same options. Whoever finds no call in
    flight sends every registration waiting, its own first, in one RegisterAgents
    call; those that come while it is in flight go together in the next. So the
    agents of one process that lose their leases together (the service restarted)
    cost the service about two calls, not one each: most of a registration's cost
    there is the call's (grpc.aio), not the record's. Nothing waits on purpose: a
    lone registration goes at once, as RegisterAgent, and so does every one sent
    to a service older than RegisterAgents.
    """

    _registry_lock = threading.Lock()
    # Kept alive by the Registrations that use one (each holds its own).
    _registry: weakref.WeakValueDictionary[tuple[str, MetadataOptions], _Registrar] = (
        weakref.WeakValueDictionary()
    )

    def __init__(self, key: tuple[str, MetadataOptions]) -> None:
        # Its own channel, closed when the last Registration lets go of it: no agent's
        # close() cuts off the registrations of others sent with its own.
        self.client = MetadataClient(*key)
        weakref.finalize(self, self.client.close)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._sending = False
        self._batches = True  # False once the service answered RegisterAgents UNIMPLEMENTED

    @classmethod
    def of(cls, client: MetadataClient) -> _Registrar:
        key = (client.target, dataclasses.replace(client.options, read_target=None))
        with cls._registry_lock:
            registrar = cls._registry.get(key)
            if registrar is None:
                registrar = cls._registry[key] = cls(key)
            return registrar

    def register(self, request: metadata_pb2.RegisterAgentRequest) -> metadata_pb2.RegisterAgentResponse:
        """``MetadataClient.register`` of ``request``, sent with whatever else is
        waiting. Raises what it would raise."""
        pending = _Pending(request)
        with self._cond:
            self._queue.append(pending)
            while not pending.done and self._sending:
                self._cond.wait()
            if pending.done:
                return pending.result()
            self._sending = True
        try:
            while not pending.done:  # its own is in the first batch unless 128 were ahead
                with self._cond:
                    batch = self._take()
                self._send(batch)
        finally:
            with self._cond:
                self._sending = False
                self._cond.notify_all()
        return pending.result()

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        while self._queue and len(batch) < MAX_REGISTRATIONS_PER_CALL:
            size += self._queue[0].request.ByteSize()
            if batch and size > _MAX_BATCH_BYTES:
                break
            batch.append(self._queue.popleft())
        return batch

    def _send(self, batch: list[_Pending]) -> None:
        client = self.client
        try:
            if len(batch) > 1 and self._batches:
                try:
                    answers = client.register_many([pending.request for pending in batch])
                except MetadataError as exc:
                    if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    logger.info("the metadata service takes no RegisterAgents; registering one by one")
                    self._batches = False
                else:
                    for pending, answer in zip(batch, answers, strict=True):
                        if isinstance(answer, Exception):
                            pending.error = answer
                        else:
                            pending.response = answer
                        pending.done = True
                    return
            for pending in batch:
                try:
                    request = pending.request
                    pending.response = client.register(request.record, request.ttl_s, request.lease_id)
                except (ConnectError, MetadataError) as exc:
                    pending.error = exc
                pending.done = True
        except (ConnectError, MetadataError) as exc:
            for pending in batch:
                if not pending.done:
                    pending.error = _clone(exc)  # one each: they are raised on several threads
                    pending.done = True
        except BaseException as exc:  # a bug, or an interrupt: nobody waits for good
            for pending in batch:
                if not pending.done:
                    pending.error = MetadataError(f"registration failed: {exc!r}")
                    pending.done = True
            raise


class _Renewer:
    """Renews the leases of every Registration of this process that talks to the
    same service with the same options: one KeepAlive stream, and one message
    per renewal interval (the smallest ttl/3 among them) carrying all their
    leases, split at MAX_LEASES_PER_MESSAGE. A service that answers without
    ``ttls_s`` (older than batches) gets one message per lease instead.

    A lease answered 0 is reported to its own Registration only. A failed
    stream keeps its leases and is sent again after a pause: the service
    answers 0 for one that is gone meanwhile. A lease that goes a whole ttl
    without a renewal answered (a refusal that lasts) is lost to its
    Registration, which registers again, proving its old lease.
    """

    _registry_lock = threading.Lock()
    _registry: dict[tuple[str, MetadataOptions], _Renewer] = {}

    def __init__(self, key: tuple[str, MetadataOptions]) -> None:
        self.key = key
        self.client = MetadataClient(*key)
        self._lock = threading.Lock()
        # Registration -> (lease id, ttl); bounded by the process's registrations.
        self._leases: dict[Registration, tuple[int, int]] = {}
        self._members: set[Registration] = set()
        self._changed = threading.Event()
        self._closed = threading.Event()
        self._stream: grpc.CallIterator[metadata_pb2.KeepAliveResponse] | None = None
        self._answered = False  # the current stream got an answer
        self._thread = threading.Thread(target=self._run, name="kvx-lease-renewer", daemon=True)
        self._thread.start()

    # The process-wide registry.

    @classmethod
    def renew(cls, registration: Registration, lease_id: int, ttl_s: int) -> None:
        # Where reads go does not matter to renewals: one stream for all of them.
        key = (registration.client.target, dataclasses.replace(registration.client.options, read_target=None))
        with cls._registry_lock:
            if registration._stop.is_set():
                return  # stopped meanwhile: leave() has run or will not find it
            renewer = registration._renewer
            if renewer is None or renewer.key != key or renewer._closed.is_set():
                renewer = cls._registry.get(key)
                if renewer is None:
                    renewer = cls._registry[key] = _Renewer(key)
                registration._renewer = renewer
            with renewer._lock:
                renewer._members.add(registration)
                renewer._leases[registration] = (lease_id, ttl_s)
        renewer._changed.set()

    @classmethod
    def leave(cls, registration: Registration) -> None:
        with cls._registry_lock:
            renewer = registration._renewer
            if renewer is None:
                return
            registration._renewer = None
            with renewer._lock:
                renewer._members.discard(registration)
                renewer._leases.pop(registration, None)
                empty = not renewer._members
            if empty:
                if cls._registry.get(renewer.key) is renewer:
                    del cls._registry[renewer.key]
                renewer._close()

    def _close(self) -> None:
        self._closed.set()
        self._changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        # The thread ends by itself (bounded: its waits and the stream cancelled); it
        # closes the channel. Not joined here: leave() may run on any thread.

    # The renewing thread.

    def _run(self) -> None:
        attempt = 0
        try:
            while not self._closed.is_set():
                if not self._snapshot():
                    self._changed.wait(1.0)
                    self._changed.clear()
                    continue
                try:
                    self._stream_once()
                    attempt = 0
                except grpc.RpcError as exc:
                    if self._closed.is_set():
                        return
                    # The leases are kept: the stream is sent again after a pause, and the
                    # service answers 0 for a lease that is gone meanwhile (expired, or a
                    # restarted memory store), which registers that one again. Dropping
                    # them all here made every agent of the process register again after
                    # any failed stream: a replica restarting, or a renewal turned away
                    # for a moment (UNAVAILABLE), and one etcd write per agent each time.
                    if self._answered:  # the stream worked for a while: a new failure, logged
                        attempt = 0
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        if attempt == 0:
                            logger.warning("lease keep-alive stream ended: %s; renewing again", exc.details())
                        self._unconfirmed()
                except Exception:  # noqa: BLE001 - a bug here must not stop every renewal
                    logger.exception("lease renewal failed; trying again")
                    self._lose_all()
                self._closed.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
                attempt += 1
        finally:
            self.client.close()

    def _unconfirmed(self) -> None:
        """Renewals fail or go unanswered: each registration hears it (update() then leaves
        publishing to its thread), and a lease not renewed for its whole ttl is given up."""
        now = time.monotonic()
        for registration, lease_id in self._snapshot():
            registration.unconfirmed = True
            if now - registration.confirmed_at >= registration.ttl_s:
                # The service has let it go, or refuses or ignores this stream for good:
                # registering again says which, in the log, and gets a lease if it can.
                self._forget(registration, lease_id)

    def _snapshot(self) -> list[tuple[Registration, int]]:
        with self._lock:
            return [(reg, lease_id) for reg, (lease_id, _) in self._leases.items()]

    def _interval_s(self) -> float:
        with self._lock:
            ttls = [ttl for _, ttl in self._leases.values()]
        return max(0.2, min(ttls, default=30) / 3)

    def _lose_all(self) -> None:
        for registration, lease_id in self._snapshot():
            self._forget(registration, lease_id)

    def _forget(self, registration: Registration, lease_id: int) -> None:
        with self._lock:
            if self._leases.get(registration, (0, 0))[0] == lease_id:
                del self._leases[registration]
        registration._lease_lost(lease_id)

    def _stream_once(self) -> None:
        self._answered = False
        # What each message sent carried, in order: the service answers in order.
        sent: collections.deque[list[tuple[Registration, int]]] = collections.deque()
        single = threading.Event()  # the service ignores lease_ids: one lease per message
        ended = threading.Event()  # this stream is over: its request generator returns

        def requests() -> Iterator[metadata_pb2.KeepAliveRequest]:
            while not self._closed.is_set() and not ended.is_set():
                leases = self._snapshot()
                if not leases:
                    return  # nothing to renew: the stream ends, the thread waits for leases
                sent_singly = single.is_set()
                if len(sent) > _MAX_UNANSWERED_MESSAGES:
                    logger.warning("the metadata service is not answering lease renewals; waiting")
                    self._unconfirmed()
                else:
                    step = 1 if sent_singly else MAX_LEASES_PER_MESSAGE
                    for start in range(0, len(leases), step):
                        chunk = leases[start : start + step]
                        sent.append(chunk)
                        yield metadata_pb2.KeepAliveRequest(
                            lease_id=chunk[0][1], lease_ids=[lease_id for _, lease_id in chunk[1:]]
                        )
                self._changed.clear()
                deadline = time.monotonic() + self._interval_s()
                # A new lease with a shorter ttl cuts the wait; the switch to single
                # leases ends it (the leases after each batch's first were not renewed).
                while (left := deadline - time.monotonic()) > 0 and not ended.is_set():
                    if self._closed.is_set() or (single.is_set() and not sent_singly):
                        break
                    if self._changed.wait(min(left, 1.0)):
                        self._changed.clear()
                        deadline = min(deadline, time.monotonic() + self._interval_s())

        stream: grpc.CallIterator[metadata_pb2.KeepAliveResponse]
        self._stream = stream = self.client.stub.KeepAlive(requests(), metadata=self.client.call_metadata)
        try:
            if self._closed.is_set():
                return
            for response in stream:
                if not sent:
                    raise MetadataError(
                        f"metadata service at {self.client.target}: more answers than renewals"
                    )
                chunk = sent.popleft()
                ttls = [response.ttl_s, *response.ttls_s]
                if len(ttls) != len(chunk):
                    if response.ttls_s:
                        raise MetadataError(
                            f"metadata service at {self.client.target}: "
                            f"{len(ttls)} ttls answered for {len(chunk)} leases"
                        )
                    # An older service: it renewed lease_id only. The rest go one by one now.
                    if not single.is_set():
                        logger.info("the metadata service renews one lease per message; sending them so")
                        single.set()
                        self._changed.set()
                self._answered = True
                for (registration, lease_id), ttl in zip(chunk, ttls, strict=False):
                    if ttl > 0:
                        registration.unconfirmed = False
                        registration.confirmed_at = time.monotonic()
                    else:
                        # The agent's name, not the lease id: a log reader must not learn
                        # a lease id (it proves ownership of a name to the service).
                        logger.warning(
                            "the lease of agent %s is gone (expired or revoked); registering again",
                            registration.name,
                        )
                        self._forget(registration, lease_id)
        finally:
            ended.set()
            stream.cancel()
            self._stream = None


def _why(ended: Exception) -> str:
    """What ended a watch, for a log line: the gRPC status code, else the error."""
    code = ended.code() if isinstance(ended, grpc.RpcError) and hasattr(ended, "code") else None
    return str(code) if code is not None else str(ended)


def _refuses_names(exc: grpc.RpcError) -> bool:
    """A watch of names refused for its names (too many, or a message too large for the
    service), not for a reason a watch of every agent would share (the stream cap)."""
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and "watch streams" not in (exc.details() or "")


# What a watch asks the service to pack into one message (WatchAgentsRequest.batch_bytes):
# well inside CHANNEL_OPTIONS' receive limit, and the service's own cap.
WATCH_BATCH_BYTES = 1 << 20
# The most events one WatchAgentsResponse holds (the proto's bound): a message of more
# is refused, so that 1 MiB of empty events is not a million steps.
WATCH_BATCH_EVENTS_MAX = 512


class MalformedWatch(MetadataError):
    """A WatchAgents message no kvx service sends (a batch inside a batch, or of
    more than WATCH_BATCH_EVENTS_MAX events)."""


def watch_events(
    message: metadata_pb2.WatchAgentsResponse,
) -> Iterable[metadata_pb2.WatchAgentsResponse]:
    """The events of one WatchAgents message: its ``events`` when it is a batch
    (WatchAgentsRequest.batch_bytes), else the message itself."""
    if not message.events:
        return (message,)
    if len(message.events) > WATCH_BATCH_EVENTS_MAX:
        raise MalformedWatch(
            f"the metadata service sent a watch batch of {len(message.events)} events; "
            f"at most {WATCH_BATCH_EVENTS_MAX} are valid"
        )
    for event in message.events:
        if event.events:
            raise MalformedWatch("the metadata service sent a watch batch inside a batch")
    return message.events


class Watcher:
    """Calls ``on_event(WatchAgentsResponse)`` for every change, from its own thread.

    After a reconnection the snapshot comes again (PUT events, then SYNCED).
    With ``names``, only those agents are watched; ``watch_names`` restarts the
    watch on another set of names (its snapshot comes again too). Before each
    SYNCED is passed on, ``snapshot_names`` holds the names of that snapshot's
    records: a watched name missing from it was absent from the service when
    it was read (a watch of every agent may also leave out agents registered
    while it read; they follow SYNCED).

    A service that refuses a watch of names (too many or too long for it)
    is watched whole instead, with a warning: ``names_refused`` is set, and
    ``watch_names`` watches every agent from then on.

    The watch asks for several events per message (``WATCH_BATCH_BYTES``);
    ``on_event`` gets them one by one all the same. An event may share its
    memory with the others of its message: copy what you keep for long
    (``CopyFrom``) rather than keep the event.

    With ``fallback`` (the service itself, where ``client`` is a read replica
    of it), a watch is never left with nothing to watch while the service
    answers:

    - a watch of the replica that ends before the replica kept it
      READER_STAYED_S past its snapshot (it is down, refuses it, or is
      stale; a restart by ``watch_names`` does not end it) moves to
      ``fallback``, with a warning; one it kept that long reconnects to
      the replica first, and moves if that fails. A move waits a random
      moment of up to READER_MOVE_SPREAD_S where the replica had answered
      (a replica that never did, as at an agent's start, is left at once);
    - while on ``fallback``, the replica's health is asked every
      ``READER_PROBE_S`` (jittered), and the watch moves back once it says
      SERVING; a return the replica does not keep doubles that wait (up to
      ``READER_PROBE_MAX_S``), so a replica that says SERVING but refuses or
      drops watches does not pull its agents back and forth in step;
    - a watch of ``fallback`` that ends reconnects to the replica first;
      reconnections wait a jittered backoff.

    Each move is a reconnection: the snapshot comes again, in the other
    service's revisions. ``source`` is the client to watch now, and
    ``current_stream`` the stream opened last (its number, and the client it
    watches): revisions compare only within one stream.
    """

    def __init__(
        self,
        client: MetadataClient,
        on_event: Callable[[metadata_pb2.WatchAgentsResponse], None],
        role: str | None = None,
        labels: dict[str, str] | None = None,
        names: Iterable[str] = (),
        fallback: MetadataClient | None = None,
    ) -> None:
        self.client = client
        self.fallback = fallback if fallback is not client else None
        self.source = client  # the client watched now: client, or fallback
        # The stream opened last: its number, and the client it watches. Each stream
        # (a reconnection may reach another replica, or a restarted service) numbers
        # revisions its own way.
        self.current_stream: tuple[int, MetadataClient] = (0, client)
        self.on_event = on_event
        self.request = metadata_pb2.WatchAgentsRequest(
            role=role_filter(role),
            labels=labels or {},
            names=sorted(set(names)),
            batch_bytes=WATCH_BATCH_BYTES,
        )
        self.synced = threading.Event()  # the current request's snapshot has been passed on
        self.snapshot_names: frozenset[str] = frozenset()
        # True while the events passed on are a new stream's snapshot (before its SYNCED):
        # a reconnection may reach another replica, or a restarted service, whose
        # revisions are numbered apart.
        self.snapshotting = True
        self.names_refused = False  # the service refused a watch of names: every agent is watched
        self._lock = threading.Lock()
        self._generation = 0  # counts watch_names calls: a stream of an older one is cut short
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends a reconnection backoff early (stop, watch_names)
        self._stream: grpc.CallIterator[metadata_pb2.WatchAgentsResponse] | None = None
        self._prober: threading.Thread | None = None  # while watching the fallback
        self._probe_s = READER_PROBE_S
        self._returning = False  # the prober moved the watch back; the replica has not kept it yet
        self._fell_back = False  # warned of a fallback; the replica has not kept a watch since
        self._kept_ended = False  # a watch the replica kept ended: the next move is spread
        # When the replica's watch first passed its snapshot since it last ended (or since
        # the watch moved to it): restarts of the watch (watch_names) do not reset it.
        self._replica_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="kvx-watch", daemon=True)
        self._thread.start()

    def watch_names(self, names: Iterable[str]) -> None:
        """Watches ``names`` from now on (empty: every agent); ``synced`` is set again
        once the new watch's snapshot has been passed on."""
        with self._lock:
            self._generation += 1
            self.request = metadata_pb2.WatchAgentsRequest(
                role=self.request.role,
                labels=self.request.labels,
                names=() if self.names_refused else sorted(set(names)),
                batch_bytes=WATCH_BATCH_BYTES,
            )
            self.synced.clear()
            stream = self._stream
        self._wake.set()
        if stream is not None:
            stream.cancel()  # the thread opens the new watch at once

    def _run(self) -> None:
        attempt = 0
        while True:
            with self._lock:
                if self._stop.is_set():  # under the lock: stop() cancels the stream it finds here
                    return
                generation, request, source = self._generation, self.request, self.source
                stream: grpc.CallIterator[metadata_pb2.WatchAgentsResponse]
                self._stream = stream = source.stub.WatchAgents(request, metadata=source.call_metadata)
                self.snapshotting = True  # before current_stream: see Directory._stream
                self.current_stream = (self.current_stream[0] + 1, source)
            present: set[str] | None = set()  # the snapshot's names, until SYNCED
            answered = False
            ended: Exception
            try:
                for message in stream:
                    events = watch_events(message)  # checked before it counts as an answer
                    attempt, answered = 0, True
                    for event in events:
                        if (
                            event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT
                            and present is not None
                        ):
                            present.add(event.record.name)
                        synced = event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED
                        if synced:
                            self.snapshot_names = frozenset(present or ())
                            present = None
                        try:
                            self.on_event(event)
                        except Exception:
                            logger.exception("watch callback failed")
                        if synced:
                            # After the callback, which drops what the old stream numbered.
                            self.snapshotting = False
                            if source is self.client and self._replica_since is None:
                                self._replica_since = time.monotonic()
                            with self._lock:
                                if generation == self._generation:
                                    self.synced.set()
                ended = EOFError("the metadata service ended the watch")
            except MalformedWatch as exc:
                stream.cancel()
                ended = exc
                if attempt == 0 and not self._stop.is_set():
                    logger.warning(
                        "watch of the metadata service at %s broken (%s); reconnecting", source.target, exc
                    )
                # A service that sends what none sends is broken, not busy: the longest
                # backoff, even after a stream that was good until then.
                attempt = len(_BACKOFF_S) - 1
            except grpc.RpcError as exc:
                ended = exc
            if self._stop.is_set():
                return
            if generation != self._generation:
                continue  # cut short (watch_names, a move back): watch again now, not after a backoff
            if isinstance(ended, grpc.RpcError) and not answered and request.names and _refuses_names(ended):
                self._watch_all(generation, len(request.names), ended)
                continue
            if self.fallback is not None:
                if source is self.client:
                    since = self._replica_since
                    stayed = since is not None and time.monotonic() - since >= READER_STAYED_S
                    wait_s = self._left(generation, answered, stayed, ended)
                    if wait_s is not None:
                        # On the fallback now (after wait_s): its watch sees the changes meanwhile.
                        if wait_s > 0:
                            self._wake.wait(wait_s)
                            self._wake.clear()
                        continue
                else:
                    self._move(generation, self.client)  # the replica first, after the backoff
            if attempt == 0:  # (a broken stream was reported above)
                logger.warning(
                    "watch of the metadata service at %s ended (%s); reconnecting", source.target, _why(ended)
                )
            # Jittered, so that the agents of one service do not all come back in step.
            self._wake.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)] * random.uniform(1.0, 1.5))
            self._wake.clear()
            attempt += 1

    def _move(self, generation: int, source: MetadataClient) -> None:
        """The next stream watches ``source`` (unless watch_names came meanwhile)."""
        with self._lock:
            if generation == self._generation:
                self.source = source

    def _left(self, generation: int, answered: bool, stayed: bool, ended: Exception) -> float | None:
        """The replica's watch ended: None where the watch stays with the replica,
        else how long to wait before it watches the fallback.

        It stays with the replica (reconnects to it first) only when the replica
        kept that watch READER_STAYED_S past its snapshot. Otherwise (it did not
        answer, or it says SERVING yet cuts its watchers off) the watch moves,
        and a return from the fallback that ended so doubles the wait before the
        next; a return kept that long resets it.

        The move waits a random moment of up to READER_MOVE_SPREAD_S where the
        replica had answered (this watch, or the one it kept before this
        reconnection failed): the agents of a replica that dies reach the
        service spread over that, not at once, as each new watch costs it CPU.
        A replica that never answered (an agent starting while it is down) is
        left at once."""
        assert self.fallback is not None
        with self._lock:
            if generation != self._generation or self._stop.is_set():
                return None  # a restart (watch_names), which does not end the replica's watch
            self._replica_since = None  # ended: the next stream's SYNCED counts anew
            returning, self._returning = self._returning, False
            if answered and stayed:
                self._probe_s = READER_PROBE_S  # the replica is back for good
                self._fell_back = False
                self._kept_ended = True  # if it is gone, the reconnection fails: spread that move
                return None
            spread, self._kept_ended = answered or self._kept_ended, False
            if returning:
                self._probe_s = min(self._probe_s * 2, READER_PROBE_MAX_S)
            self.source = self.fallback
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe, name="kvx-watch-probe", daemon=True)
                self._prober.start()
            first, self._fell_back = not self._fell_back, True
            wait_s = random.uniform(0, READER_MOVE_SPREAD_S) if spread else 0.0
        logger.log(
            logging.WARNING if first else logging.DEBUG,  # once until the replica keeps a watch again
            "the read replica at %s did not keep a watch (%s); watching the metadata service "
            "at %s until it does",
            self.client.target,
            _why(ended),
            self.fallback.target,
        )
        return wait_s

    def _probe(self) -> None:
        """While the watch is on the fallback: asks the replica's health now and then,
        and moves the watch back once it says SERVING."""
        try:
            self._probe_until_back()
        finally:
            with self._lock:  # ended by an error too: the next fallback starts another
                if self._prober is threading.current_thread():
                    self._prober = None

    def _probe_until_back(self) -> None:
        while True:
            with self._lock:
                wait_s = self._probe_s * random.uniform(0.5, 1.5)
            if self._stop.wait(wait_s):
                return
            with self._lock:
                if self.source is not self.fallback:  # back on the replica by another way
                    self._prober = None
                    return
            if not self.client.serving(min(self.client.options.timeout_s, READER_PROBE_TIMEOUT_S)):
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._prober = None
                if self.source is not self.fallback:
                    return
                self.source = self.client
                self._returning = True
                self._generation += 1  # the stream cut short below: watch again at once
                stream = self._stream
            logger.info("the read replica at %s serves again: watching it", self.client.target)
            self._wake.set()
            if stream is not None:
                stream.cancel()
            return

    def _watch_all(self, generation: int, names: int, exc: grpc.RpcError) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self.names_refused = True
            self.request = metadata_pb2.WatchAgentsRequest(
                role=self.request.role, labels=self.request.labels, batch_bytes=WATCH_BATCH_BYTES
            )
        logger.warning(
            "the metadata service at %s refused a watch of %d names (%s: %s); watching every "
            "agent instead, which costs the service more: a kvx metadata service takes up to "
            "%d names of any valid length in one watch",
            self.source.target,
            names,
            exc.code(),
            exc.details(),
            MAX_WATCH_NAMES,
        )

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            stream, prober = self._stream, self._prober
        if stream is not None:
            stream.cancel()
        self._thread.join(5)
        if prober is not None:
            prober.join(5)
