"""An agent's view of the metadata service: its own registration, and peer
lookups with a cache that watch events invalidate.

A peer that re-registers with a new epoch is never served from the old
record: the watch marks the name stale (and the old peer is closed at once),
and ``resolve`` asks the service again.

The watch covers only the names this agent has resolved (its peers), so that
it costs the service what the peers cost, not what the registry costs. A
name resolved for the first time restarts the watch with the larger set of
names before the name is looked up; a change that lands while the watch
restarts is in the new watch's snapshot (a peer missing from it is marked
stale too). A watch event marks its peer stale only when it is not the
record this agent knows (other metadata or another epoch): a restart of the
watch for one new peer costs no lookups of the others. No revisions are
compared: lookups and the watch may be answered by different services (a
read replica, the service itself when the replica lacks a name, a replica
restarted with a counter of its own); a lookup during which a watch event
of its name arrived is asked again instead. Past
``MAX_WATCHED_NAMES`` peers the watch covers every agent: dropping the oldest
peers instead would leave their restarts unseen. A name that no agent has
(its lookup found none) leaves the watch's names. A service that refuses the
watch of names is watched whole (see ``Watcher``), with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvx.errors import ConfigError, ConnectError
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
# The most names one watch may name (WatchAgentsRequest.names); past it, every agent is watched.
MAX_WATCHED_NAMES = MAX_WATCH_NAMES


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
            self.reader = MetadataClient(read_target, options) if read_target else self.client
        except BaseException:
            self.client.close()
            raise
        self.registration = Registration(self.client, self.record)
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}  # name -> epoch of the newest record seen
        # name -> digest of the metadata of the record a lookup last returned: an event
        # that carries the same is no news.
        self._known_metadata: dict[str, bytes] = {}
        self._events: dict[str, int] = {}  # name -> watch events seen of it (counted)
        self._stale: set[str] = set()
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
        for _ in range(5):
            with self._lock:
                events = self._events.get(name, 0)
            record = read_through(self.reader, self.client, name)
            if record is None:
                self._forget(name, cached)
                raise ConnectError(
                    f"no agent named {name!r} is registered with the metadata service at {self.client.target}"
                )
            with self._lock:
                # A watch event of this name during the lookup may be newer than the answer: ask again.
                if self._events.get(name, 0) != events:
                    continue
                self._stale.discard(name)
                self._known[name] = record.epoch
                # The watch's event of this record, if it comes later, is no news.
                self._known_metadata[name] = _digest(record)
            return self.agent.add_peer(record.metadata.SerializeToString(), streams=streams)
        raise ConnectError(f"agent {name!r} keeps changing in the metadata service; try again")

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
                watcher = self._watcher = Watcher(self.reader, self._on_event, names=names)
            elif watcher.names_refused or (not watcher.request.names and not names):
                return  # it already watches every agent
            else:
                watcher.watch_names(names)
        watcher.synced.wait(self.reader.options.timeout_s)

    def _on_event(self, event: metadata_pb2.WatchAgentsResponse) -> None:
        if event.type == _SYNCED:
            self._mark_missing_stale()
            return
        if event.type not in (_PUT, _DELETE):
            return
        name, epoch = event.record.name, event.record.epoch
        digest = _digest(event.record) if event.type == _PUT else None
        with self._lock:
            self._events[name] = self._events.get(name, 0) + 1
            # Regions may have changed, or the agent is gone. A PUT of the very record
            # this agent knows (a restarted watch's snapshot, a lookup's own change) changes nothing.
            if (
                event.type == _DELETE
                or epoch != self._known.get(name)
                or digest != self._known_metadata.get(name)
            ):
                self._stale.add(name)
            if event.type == _PUT:
                self._known[name] = epoch
        if event.type == _PUT:
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
            self._stale.update(self._watched - present)

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
