"""An agent's view of the metadata service: its own registration, and peer
lookups with a cache that watch events invalidate.

A peer that re-registers with a new epoch is never served from the old
record: the watch marks the name stale (and the old peer is closed at once),
and ``resolve`` asks the service again.

The watch covers only the names this agent has resolved (its peers), so that
it costs the service what the peers cost, not what the registry costs. A
name resolved for the first time restarts the watch with the larger set of
names before the name is looked up; a change that lands while the watch
restarts is in the new watch's snapshot, or follows it (a peer missing
from it is marked stale too). A watch event marks its peer stale only when it is not the
record this agent knows (other metadata or another epoch): a restart of the
watch for one new peer costs no lookups of the others.

A lookup is not kept when it is older than what the watch has shown: when
a change of its name (other metadata, epoch, or a delete) arrived while it
was asked, or when it comes from the service the watch's stream follows and
carries a lower revision than the stream's newest event of the name.
Revisions are compared only within one stream's numbering, past its
snapshot: a new stream (a reconnection, which may reach another read
replica, a restarted service, or the service itself while its replica does
not answer, each counting its own) takes them from its snapshot. Any other
answer of the service itself is kept. A replica's answer that cannot be
compared so (the watch follows the service, or is reconnecting) is kept
when it is the record the watch showed last of that name (or the watch
showed none), and is otherwise checked with the service, whose answer is
kept. So is any replica's answer for a peer that a replica's new snapshot
showed other than this agent knew it: that replica may be behind what the
watch showed before (a replica that lost its primary serves its frozen
copy for ``--mirror-stale-s``), and the peer's connection is not closed
on its word, nor on that replica's later changes of it (a replica that is
behind replays older ones) until it shows what this agent knew; the
service is asked right after the snapshot, and the change is acted on if
it agrees. A lookup refused as older is asked again after a short wait. Past
``MAX_WATCHED_NAMES`` peers the watch covers every agent: dropping the oldest
peers instead would leave their restarts unseen. A name that no agent has
(its lookup found none) leaves the watch's names. A service that refuses the
watch of names is watched whole (see ``Watcher``), with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvx.errors import ConfigError, ConnectError, MetadataError
from kvx.metadata.client import (
    MAX_WATCH_NAMES,
    MetadataClient,
    MetadataOptions,
    Registration,
    Watcher,
    read_through,
)
from kvx.metadata.roles import ROLES
from kvx.v1 import metadata_pb2

if TYPE_CHECKING:
    from kvx.agent import Agent, Peer

logger = logging.getLogger(__name__)
_DELETE = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE
_PUT = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT
_SYNCED = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED
# What the watch showed last of a watched name missing from its snapshot: as a delete.
_ABSENT = (_DELETE, 0, None)
# The most names one watch may name (WatchAgentsRequest.names); past it, every agent is watched.
MAX_WATCHED_NAMES = MAX_WATCH_NAMES
# A lookup older than what the watch has shown is asked again, after a wait that grows.
_LOOKUP_TRIES = 5
_LOOKUP_RETRY_S = 0.02


class Directory:
    def __init__(
        self,
        agent: Agent,
        target: str,
        role: str,
        labels: dict[str, str] | None,
        engine_info: dict[str, str] | None,
        options: MetadataOptions | None,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.agent = agent
        self.role = ROLES[role]
        self.labels = dict(labels or {})
        self.engine_info = dict(engine_info or {})
        self.started_unix_ms = int(time.time() * 1000)
        self.client = MetadataClient(target, options)
        # Lookups and the watch: a read replica's when there is one, so that they do
        # not queue behind the renewals of every agent at the service.
        read_target = options.read_target if options is not None else None
        try:
            self.reader = MetadataClient(read_target, options, reader=True) if read_target else self.client
        except BaseException:
            self.client.close()
            raise
        self.registration = Registration(self.client, self.record)
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}  # name -> epoch of the newest record seen
        # name -> digest of the metadata of the record a lookup last returned (or the
        # watch showed since, or the service answered _verify): an event that carries
        # the same is no news. Only peers this agent looked up are in it.
        self._known_metadata: dict[str, bytes] = {}
        # name -> changes the watch has shown of it (events whose type, epoch or metadata
        # differ from the one before): a lookup during which this moved is asked again.
        self._changes: dict[str, int] = {}
        self._last_event: dict[str, tuple[int, int, bytes | None]] = {}  # name -> (type, epoch, digest)
        # name -> the newest revision the current watch stream showed of it (that stream's numbering).
        self._seen_revision: dict[str, int] = {}
        self._stale: set[str] = set()
        # Names a read replica's new snapshot showed other than this agent knew them: the
        # replica may be behind what the watch showed before (a replica that lost its
        # primary still serves its copy for a while). The replica's word on them is not
        # acted on until the service agrees (_verify, a lookup, its watch) or the replica
        # shows what this agent knew; each change it shows of them meanwhile is asked of
        # the service (_verify), whose answer is acted on.
        self._unverified: set[str] = set()
        self._to_verify: set[str] = set()  # marked by the snapshot under way: asked of the service after it
        self._verify_pending: set[str] = set()  # asked of the service by the one kvx-verify thread
        self._verifying = False  # that thread is at work
        self._watched: set[str] = set()  # names resolved: the watch's names
        self._watcher: Watcher | None = None

    def start(self) -> None:
        try:
            self.registration.start()
        except BaseException:
            self._close_clients()
            raise

    def record(self) -> metadata_pb2.AgentRecord:
        return metadata_pb2.AgentRecord(
            name=self.agent.name,
            epoch=self.agent.epoch,
            role=self.role,
            labels=self.labels,
            metadata=self.agent.metadata_message(),
            engine_info=self.engine_info,
            started_unix_ms=self.started_unix_ms,
        )

    def regions_changed(self) -> None:
        self.registration.update()

    def resolve(self, name: str, cached: Peer | None, streams: int | None) -> Peer:
        self._ensure_watch(name)
        with self._lock:
            fresh = name not in self._stale and (
                cached is None or self._known.get(name, cached.epoch) == cached.epoch
            )
        if cached is not None and cached.alive and fresh:
            return cached
        for attempt in range(_LOOKUP_TRIES):
            if attempt:
                time.sleep(_LOOKUP_RETRY_S * attempt)  # the watch (or the replica) catches up
            with self._lock:
                changes = self._changes.get(name, 0)
                stream = self._stream()
            record, answered_by = read_through(self.reader, self.client, name)
            with self._lock:
                differs = (
                    record is not None
                    and answered_by is not self.client
                    and (
                        name in self._unverified
                        or (not self._comparable(stream, answered_by) and self._not_shown(name, record))
                    )
                )
            if differs:
                # A replica's answer that is not the record the watch showed last, on a
                # stream of another numbering, or of a name its snapshot may have shown
                # behind: the replica may lag, or the watch may. The service itself decides.
                with contextlib.suppress(ConnectError, MetadataError):  # else the replica's, not trusted
                    record, answered_by, differs = self.client.get(name), self.client, False
                if differs and cached is not None and cached.alive:
                    with self._lock:
                        if name in self._unverified:
                            # A replica's snapshot that may be behind, and no service to
                            # ask: the live connection is kept, and asked about next time.
                            self._stale.add(name)
                            return cached
            with self._lock:
                # A change of this name shown during the lookup may be newer than the answer;
                # a newer revision of the same numbering is: that of the watch's one stream,
                # past its snapshot, from the service that answered.
                changed = self._changes.get(name, 0) != changes
                comparable = self._comparable(stream, answered_by)
                behind = (
                    record is not None and comparable and self._seen_revision.get(name, 0) > record.revision
                )
                if changed or (behind and attempt < _LOOKUP_TRIES - 1):
                    continue
                if behind or differs or (answered_by is not self.client and name in self._unverified):
                    # Behind the watch after every try (the service lags, or the watch does),
                    # or a replica's answer the service could not check (or that a suspect
                    # snapshot marked meanwhile). Used, but not trusted: the next resolve
                    # asks again.
                    self._stale.add(name)
                elif record is not None:
                    self._stale.discard(name)
                    if answered_by is self.client:
                        self._unverified.discard(name)
                    self._known[name] = record.epoch
                    # The watch's event of this record, if it comes later, is no news.
                    self._known_metadata[name] = _digest(record)
                    if comparable:
                        self._seen_revision[name] = max(self._seen_revision.get(name, 0), record.revision)
            if record is None:
                self._forget(name, cached)
                raise ConnectError(
                    f"no agent named {name!r} is registered with the metadata service at {self.client.target}"
                )
            peer = self.agent.add_peer(record.metadata.SerializeToString(), streams=streams)
            with self._lock:
                if self._changes.get(name, 0) != changes:
                    # Changed while connecting: another resolve may have connected a newer record
                    # first and this one replaced its regions. The next resolve asks again.
                    self._stale.add(name)
            return peer
        raise ConnectError(f"agent {name!r} keeps changing in the metadata service; try again")

    def _comparable(self, stream: tuple[int, MetadataClient] | None, answered_by: MetadataClient) -> bool:
        """Whether an answer's revision compares with the watch's: the watch's stream is
        the one it was when the lookup began, past its snapshot, and follows the
        service that answered."""
        return stream is not None and stream == self._stream() and stream[1] is answered_by

    def _not_shown(self, name: str, record: metadata_pb2.AgentRecord) -> bool:
        """Whether the watch showed something of ``name`` last other than ``record``
        (another epoch or metadata, a delete, or its absence from a snapshot)."""
        shown = self._last_event.get(name)
        return shown is not None and shown != (_PUT, record.epoch, _digest(record))

    def _stream(self) -> tuple[int, MetadataClient] | None:
        """The watch's current stream (its number, and the client it watches) once past
        its snapshot; None before. Its revisions compare with that client's answers."""
        watcher = self._watcher
        if watcher is None:
            return None
        stream = watcher.current_stream  # read before snapshotting, which a new stream sets first
        return None if watcher.snapshotting else stream

    def _ensure_watch(self, name: str) -> None:
        """Makes the watch cover ``name``, and waits for its snapshot when it had to
        (re)start: changes after that are seen, earlier ones are in the snapshot."""
        with self._lock:
            if name in self._watched and self._watcher is not None:
                return
            self._watched.add(name)
            names = self._watched if len(self._watched) <= MAX_WATCHED_NAMES else ()
            watcher = self._watcher
            if watcher is None:
                # Watching a read replica: the service itself while the replica does not answer.
                watcher = self._watcher = Watcher(
                    self.reader, self._on_event, names=names, fallback=self.client
                )
            elif watcher.names_refused or (not watcher.request.names and not names):
                return  # it already watches every agent
            else:
                watcher.watch_names(names)
        watcher.synced.wait(self.reader.options.timeout_s)

    def _on_event(self, event: metadata_pb2.WatchAgentsResponse) -> None:
        if event.type == _SYNCED:
            self._mark_missing_stale()
            with self._lock:
                suspects, self._to_verify = self._to_verify, set()
            if suspects:  # asked of the service apart: this thread delivers the watch's events
                self._verify_later(suspects)
            return
        if event.type not in (_PUT, _DELETE):
            return
        name, epoch = event.record.name, event.record.epoch
        digest = _digest(event.record) if event.type == _PUT else None
        watcher = self._watcher
        # A new stream's snapshot (the first, or after a reconnection that may have reached
        # another read replica, or a restarted service) sets the revisions anew.
        snapshot = event.type == _PUT and (watcher is None or watcher.snapshotting)
        from_replica = watcher is not None and watcher.current_stream[1] is not self.client
        with self._lock:
            if self._last_event.get(name) != (event.type, epoch, digest):
                self._last_event[name] = (event.type, epoch, digest)
                self._changes[name] = self._changes.get(name, 0) + 1
            if snapshot:
                self._seen_revision[name] = event.revision
            else:
                self._seen_revision[name] = max(self._seen_revision.get(name, 0), event.revision)
            # Regions may have changed, or the agent is gone. A PUT of the very record
            # this agent knows (a restarted watch's snapshot, a lookup's own change) changes nothing.
            news = (
                event.type == _DELETE
                or epoch != self._known.get(name)
                or digest != self._known_metadata.get(name)
            )
            if news:
                self._stale.add(name)
            if not from_replica or not news:
                # The service's own event, or a replica showing what this agent knew
                # (it has caught up).
                self._unverified.discard(name)
            elif snapshot and name in self._known_metadata:
                # Maybe behind what this agent knew (the service's watch, another
                # replica's): the next lookup asks the service, and the peer's
                # connection is left alone until then. So is each later change the
                # replica shows of it: one that is behind replays older changes.
                self._unverified.add(name)
                self._to_verify.add(name)
            unverified = name in self._unverified
            if event.type == _PUT and not unverified:
                self._known[name] = epoch
                if name in self._known_metadata:  # what this agent knows of a peer it looked up
                    self._known_metadata[name] = digest  # type: ignore[assignment]
        if unverified and news and not snapshot:
            # Held back, but maybe a real change (the replica caught up past what this
            # agent knew): the service says which.
            self._verify_later({name})
        if event.type == _PUT and not unverified:
            try:
                peer: Any = self.agent.peer(name)
            except ConnectError:
                return
            if peer.epoch != epoch:
                logger.info(
                    "peer %s restarted (epoch %#x -> %#x): closing the old connection",
                    name,
                    peer.epoch,
                    epoch,
                )
                self.agent._replace_stale_peer(name, epoch)

    def _forget(self, name: str, cached: Peer | None) -> None:
        """``name`` has no agent: it leaves the watch's names (the next watch restart
        drops it). A cached peer of that name stays stale until a lookup finds it."""
        with self._lock:
            self._watched.discard(name)
            self._known.pop(name, None)
            self._known_metadata.pop(name, None)
            self._seen_revision.pop(name, None)
            self._unverified.discard(name)
            if cached is None:
                self._stale.discard(name)
            else:
                self._stale.add(name)

    def _mark_missing_stale(self) -> None:
        """A watched peer missing from a new watch's snapshot went away while no watch
        covered it (a restart of the watch, a reconnection): ask the service again."""
        watcher = self._watcher
        if watcher is None:
            return
        present = watcher.snapshot_names
        with self._lock:
            missing = self._watched - present
            self._stale.update(missing)
            for name in missing:  # gone meanwhile: a change, as a delete would be
                self._changes[name] = self._changes.get(name, 0) + 1
                self._last_event[name] = _ABSENT
                if watcher.current_stream[1] is not self.client and name in self._known_metadata:
                    # A replica's snapshot may lack a peer by lagging: its replays are held back.
                    self._unverified.add(name)
                    self._to_verify.add(name)
            # Revisions of names the new stream did not show were another stream's numbering.
            for name in [n for n in self._seen_revision if n not in present]:
                del self._seen_revision[name]

    def _verify_later(self, names: set[str]) -> None:
        """Has the one kvx-verify thread ask the service about ``names`` (started if none
        is at work): the watch's thread must not wait for the service."""
        with self._lock:
            self._verify_pending.update(names)
            if self._verifying:
                return
            self._verifying = True
        try:
            threading.Thread(target=self._verify_pending_names, name="kvx-verify", daemon=True).start()
        except BaseException:
            with self._lock:
                self._verifying = False
            raise

    def _verify_pending_names(self) -> None:
        while True:
            with self._lock:
                names, self._verify_pending = self._verify_pending, set()
                if not names:
                    self._verifying = False
                    return
            try:
                self._verify(names)
            except Exception:  # the thread must go on: it is the only one that asks
                logger.exception("checking peers %s with the metadata service failed", sorted(names))

    def _verify(self, names: set[str]) -> None:
        """Asks the service about peers a replica showed other than this agent knew them.
        The service's answer is what this agent knows from then on, and a restart it
        shows closes the old connection now, not at the next lookup. Where the service
        agrees with the replica (the peer did change while the watch moved, or the
        replica caught up past what this agent knew), the replica is trusted with the
        name again; otherwise the mark stays until the replica shows what the service
        said, the service's watch speaks, or a lookup asks the service."""
        for name in sorted(names):
            with self._lock:
                if name not in self._unverified:
                    continue  # settled meanwhile
            try:
                record = self.client.get(name)
            except (ConnectError, MetadataError, ValueError):  # ValueError: closed meanwhile
                return  # the next lookup, or the replica's next change of it, asks again
            with self._lock:
                if name not in self._unverified:
                    continue  # settled meanwhile
                last = self._last_event.get(name)
                if (
                    (last is not None and last[0] != _PUT)
                    if record is None
                    else (last == (_PUT, record.epoch, _digest(record)))
                ):
                    self._unverified.discard(name)  # the replica shows what the service says
                if record is None:
                    continue  # gone: stale already, and the next lookup forgets it
                self._known[name] = record.epoch
                if name in self._known_metadata:
                    self._known_metadata[name] = _digest(record)
                # A lookup under way may hold an older answer: it asks again.
                self._changes[name] = self._changes.get(name, 0) + 1
            try:
                peer: Any = self.agent.peer(name)
            except ConnectError:
                continue
            if peer.epoch != record.epoch:
                with self._lock:
                    if self._known.get(name) != record.epoch:
                        continue  # known otherwise meanwhile (the watch, a lookup): theirs stands
                logger.info(
                    "peer %s restarted (epoch %#x -> %#x): closing the old connection",
                    name,
                    peer.epoch,
                    record.epoch,
                )
                self.agent._replace_stale_peer(name, record.epoch)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self.registration.stop(unregister=True)
        self._close_clients()

    def _close_clients(self) -> None:
        if self.reader is not self.client:
            self.reader.close()
        self.client.close()


def _digest(record: metadata_pb2.AgentRecord) -> bytes:
    """What a peer connection is made from: the record's agent metadata (its epoch is compared apart)."""
    return hashlib.blake2b(record.metadata.SerializeToString(deterministic=True), digest_size=16).digest()
