"""``Directory.resolve`` and the watch's events, with the services replaced by
fakes: which answers it keeps. An answer is older than the watch when a
change of its name arrived during the lookup, or when it carries a lower
revision of the same numbering (the watch's stream, from the service that
stream follows), or, from another service, when it is not the record the
watch showed last; a new watch stream (which may be another read replica's)
sets the revisions anew; a record is the one the agent knows when its epoch
and metadata are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvx.errors import ConnectError
from kvx.metadata.directory import Directory
from kvx.v1 import agent_pb2, metadata_pb2

_PUT = metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT


def _record(regions: int, revision: int, epoch: int = 5) -> metadata_pb2.AgentRecord:
    record = metadata_pb2.AgentRecord(name="peer", epoch=epoch, revision=revision)
    record.metadata.name, record.metadata.epoch = "peer", epoch
    for region_id in range(1, regions + 1):
        record.metadata.regions.add(id=region_id, size_bytes=4096)
    return record


class _Agent:
    name, epoch = "me", 1

    def __init__(self) -> None:
        self.added: list[agent_pb2.AgentMetadata] = []

    def add_peer(self, metadata: bytes, streams: int | None = None) -> SimpleNamespace:
        md = agent_pb2.AgentMetadata.FromString(metadata)
        self.added.append(md)
        return SimpleNamespace(epoch=md.epoch, alive=True)

    def peer(self, name: str) -> None:
        raise ConnectError(name)


class _Reader:
    target = "fake:1"

    def __init__(self, answers: list, during=None) -> None:
        self.answers, self.during, self.calls = answers, during, 0

    def get(self, name: str) -> metadata_pb2.AgentRecord | None:
        self.calls += 1
        if self.during is not None and self.calls == 1:
            self.during()
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _directory(agent: _Agent, reader: _Reader, service: _Reader | None = None) -> Directory:
    """A Directory whose lookups go to ``reader`` (a read replica), and, where they
    must, to ``service`` (the service itself: by default, one asked of nothing)."""
    directory = Directory(agent, "127.0.0.1:1", "decode", None, None, None)  # never started: no call
    directory.client.close()
    directory.reader = reader  # type: ignore[assignment]
    directory.client = service or _Reader([])  # type: ignore[assignment]
    directory._watched.add("peer")
    # The watch's stream follows the reader, as an agent's does while its replica answers.
    directory._watcher = SimpleNamespace(  # type: ignore[assignment]
        snapshot_names=frozenset(), snapshotting=False, current_stream=(1, reader)
    )
    return directory


def _event(record: metadata_pb2.AgentRecord) -> metadata_pb2.WatchAgentsResponse:
    return metadata_pb2.WatchAgentsResponse(type=_PUT, record=record, revision=record.revision)


class _Connected(_Agent):
    """An agent connected to the peer's epoch 6; ``replaced`` lists each epoch the
    directory told it to replace that connection with (connected to at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced: list[int] = []
        self.connected = 6

    def peer(self, name: str) -> SimpleNamespace:  # type: ignore[override]
        return SimpleNamespace(epoch=self.connected, alive=True)

    def _replace_stale_peer(self, name: str, epoch: int) -> None:
        self.replaced.append(epoch)
        self.connected = epoch  # as if connected again at once


def _replica_snapshot(directory: Directory, reader: _Reader, record: metadata_pb2.AgentRecord) -> None:
    """The watch moved to ``reader`` (a replica), whose snapshot shows ``record``."""
    directory._watcher.current_stream = (2, reader)  # type: ignore[union-attr]
    directory._watcher.snapshotting = True  # type: ignore[union-attr]
    directory._on_event(_event(record))
    directory._watcher.snapshotting = False  # type: ignore[union-attr]


def test_an_answer_during_which_a_change_was_seen_is_asked_again() -> None:
    """The lookup's answer (one region) was read before the change the watch
    delivered meanwhile (two regions): it is not kept, even though its revision,
    another service's, is higher."""
    agent = _Agent()
    newer = _record(2, revision=3)
    reader = _Reader([_record(1, revision=900), newer])
    directory = _directory(agent, reader)
    reader.during = lambda: directory._on_event(_event(newer))
    directory.resolve("peer", None, None)
    assert reader.calls == 2 and len(agent.added[-1].regions) == 2
    assert "peer" not in directory._stale


def test_an_event_of_the_record_the_agent_knows_is_no_news() -> None:
    """A new stream's snapshot (another replica: another revision) of the record a
    lookup returned leaves the peer fresh; a change of its metadata does not."""
    agent = _Agent()
    directory = _directory(agent, _Reader([_record(1, revision=40)]))
    directory.resolve("peer", None, None)
    directory._on_event(_event(_record(1, revision=2)))  # the same record, counted elsewhere
    assert "peer" not in directory._stale
    directory._on_event(_event(_record(2, revision=3)))  # its regions changed
    assert "peer" in directory._stale
    directory._stale.clear()
    directory._on_event(_event(_record(1, revision=4, epoch=6)))  # restarted
    assert "peer" in directory._stale


def test_an_answer_behind_an_event_seen_before_it_is_asked_again() -> None:
    """The watch showed revision 10 before the lookup began; the service (an etcd
    replica's mirror, say) still answered revision 8: not kept, asked again."""
    agent = _Agent()
    newer = _record(2, revision=10)
    reader = _Reader([_record(1, revision=8), newer])
    directory = _directory(agent, reader)
    directory._on_event(_event(newer))
    directory.resolve("peer", None, None)
    assert reader.calls == 2 and len(agent.added[-1].regions) == 2
    assert "peer" not in directory._stale


def test_a_new_streams_snapshot_sets_the_revisions_anew() -> None:
    """After a reconnection to a replica that counts lower, its snapshot's revision
    is the one lookups there are compared with."""
    agent = _Agent()
    reader = _Reader([_record(1, revision=2)])
    directory = _directory(agent, reader)
    directory._on_event(_event(_record(1, revision=33)))  # the old replica's numbering
    directory._watcher.snapshotting = True  # type: ignore[union-attr]
    directory._on_event(_event(_record(1, revision=2)))  # the new replica's snapshot
    directory._watcher.snapshotting = False  # type: ignore[union-attr]
    directory.resolve("peer", None, None)
    assert reader.calls == 1 and "peer" not in directory._stale


def test_an_answer_behind_the_watch_after_every_try_is_used_but_not_trusted() -> None:
    """The watch still shows an old stream's numbering (it has not reconnected yet):
    the lookup is used, and the next resolve asks again."""
    agent = _Agent()
    reader = _Reader([_record(1, revision=2)])
    directory = _directory(agent, reader)
    directory._on_event(_event(_record(1, revision=33)))
    directory.resolve("peer", None, None)
    assert reader.calls == 5 and len(agent.added) == 1
    assert "peer" in directory._stale


def test_the_same_record_shown_again_during_a_lookup_is_no_change() -> None:
    """A watch restart re-sends every watched record: that is no reason to ask again."""
    agent = _Agent()
    same = _record(1, revision=4)
    reader = _Reader([same])
    directory = _directory(agent, reader)
    directory._on_event(_event(same))
    reader.during = lambda: directory._on_event(_event(same))
    directory.resolve("peer", None, None)
    assert reader.calls == 1 and "peer" not in directory._stale


def test_another_services_answer_is_kept_when_it_is_the_record_the_watch_showed() -> None:
    """The watch follows the service (its replica did not answer a watch) while the
    replica answers lookups: their numberings differ, so a lower revision is no
    sign of age. The record the watch showed last is kept at once."""
    agent = _Agent()
    reader = _Reader([_record(2, revision=3)])
    directory = _directory(agent, reader)
    directory._watcher.current_stream = (1, directory.client)  # type: ignore[union-attr]
    directory._on_event(_event(_record(2, revision=900)))  # the service's numbering
    directory.resolve("peer", None, None)
    assert reader.calls == 1 and len(agent.added[-1].regions) == 2
    assert "peer" not in directory._stale


def test_a_replicas_answer_that_is_not_what_the_watch_showed_is_asked_of_the_service() -> None:
    """The same, but the replica has not copied the change the watch showed yet: its
    answer (one region), though of a higher revision than the watch's, is checked
    with the service, whose answer (two regions) is kept."""
    agent = _Agent()
    reader, service = _Reader([_record(1, revision=950)]), _Reader([_record(2, revision=901)])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(_record(2, revision=900)))
    directory.resolve("peer", None, None)
    assert (reader.calls, service.calls) == (1, 1) and len(agent.added[-1].regions) == 2
    assert "peer" not in directory._stale


def test_a_newer_answer_while_the_watch_reconnects_is_kept_after_the_service_agrees() -> None:
    """The watch is reconnecting (a new stream, before its snapshot): the replica's
    answer (two regions) is newer than what the old stream showed (one). The
    service confirms it: kept, at once and trusted, not refused as behind."""
    agent = _Agent()
    newer = _record(2, revision=8)
    reader, service = _Reader([newer]), _Reader([newer])
    directory = _directory(agent, reader, service)
    directory._on_event(_event(_record(1, revision=7)))
    directory._watcher.snapshotting = True  # type: ignore[union-attr]
    directory.resolve("peer", None, None)
    assert (reader.calls, service.calls) == (1, 1) and len(agent.added[-1].regions) == 2
    assert "peer" not in directory._stale


def test_a_peer_missing_from_the_snapshot_is_not_taken_from_a_lagging_replica() -> None:
    """The service's watch (a new stream) no longer shows the peer: it left. A replica
    that has not copied that yet still answers its record: the service, asked,
    has none, and the lookup says so."""
    agent = _Agent()
    reader, service = _Reader([_record(1, revision=3)]), _Reader([None])
    directory = _directory(agent, reader, service)
    directory._on_event(_event(_record(1, revision=40)))
    directory._watcher.current_stream = (2, service)  # type: ignore[union-attr]
    directory._on_event(
        metadata_pb2.WatchAgentsResponse(type=metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED)
    )
    with pytest.raises(ConnectError, match="no agent named 'peer'"):
        directory.resolve("peer", None, None)
    assert (reader.calls, service.calls) == (1, 1) and not agent.added


def test_a_replicas_answer_the_service_cannot_check_is_used_but_not_trusted() -> None:
    """The replica's answer differs from what the watch showed and the service does
    not answer: the peer is connected from it, and asked again next time."""
    agent = _Agent()
    reader, service = _Reader([_record(1, revision=3)]), _Reader([ConnectError("down")])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(_record(2, revision=900)))
    directory.resolve("peer", None, None)
    assert len(agent.added[-1].regions) == 1 and "peer" in directory._stale


def test_an_answer_across_a_new_stream_is_not_compared_by_revision() -> None:
    """The watch reconnected during the lookup (another stream, another numbering):
    the answer's revision says nothing against the old stream's; being the record
    the watch showed, it is kept."""
    agent = _Agent()
    directory = _directory(agent, _Reader([]))
    reader = _Reader([_record(1, revision=2)])
    directory.reader = reader  # type: ignore[assignment]
    directory._watcher.current_stream = (1, reader)  # type: ignore[union-attr]
    directory._on_event(_event(_record(1, revision=33)))

    def reconnect() -> None:
        directory._watcher.current_stream = (2, reader)  # type: ignore[union-attr]

    reader.during = reconnect
    directory.resolve("peer", None, None)
    assert reader.calls == 1 and "peer" not in directory._stale


def test_a_replica_snapshot_behind_what_the_agent_knew_does_not_roll_the_peer_back() -> None:
    """The watch followed the service and showed the peer's restart (epoch 6, the
    connected peer); it moves back to a replica whose copy froze before that
    restart (it lost its primary, and serves its copy for --mirror-stale-s). Its
    snapshot's epoch 5 does not close the connection to epoch 6, and the next
    lookup asks the service, whose epoch 6 is kept, not the replica's 5."""
    current = _record(1, revision=40, epoch=6)

    agent = _Connected()
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))  # the service's watch: the restart
    directory.resolve("peer", None, None)  # the replica's epoch 5 is not what the watch showed
    assert agent.added[-1].epoch == 6 and service.calls == 1

    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))  # the frozen copy's snapshot
    assert agent.replaced == [] and "peer" in directory._stale

    directory.resolve("peer", None, None)
    assert agent.added[-1].epoch == 6 and service.calls == 2
    assert "peer" not in directory._stale and directory._known["peer"] == 6
    # Verified: the replica's later answers are compared as before.
    directory._on_event(_event(_record(1, revision=8, epoch=6)))
    assert agent.replaced == [] and "peer" not in directory._stale


def test_a_read_replicas_channel_reconnects_sooner_and_channels_ping_only_in_a_call() -> None:
    """While the service is down, every agent's channel tries again at most every
    RECONNECT_MAX_S (their returns spread that wide); a replica's channel, which
    only its share of the agents holds, as often as its health is asked. The
    channels ping every 10 s while a call is open (none without); a replica's own
    channel to its primary pings every 5 s and reconnects within 5 s."""
    from kvx.metadata.client import MetadataOptions, channel_options
    from kvx.metadata.mirror import MirrorStore

    directory = Directory(
        _Agent(), "127.0.0.1:1", "decode", None, None, MetadataOptions(read_target="127.0.0.1:2")
    )
    try:
        assert directory.client.reconnect_max_s == 30.0
        assert (directory.reader.reconnect_max_s, directory.reader.keepalive_s) == (10.0, 10.0)
        assert directory.client.keepalive_s == 10.0
    finally:
        directory._close_clients()
    options = dict(channel_options(10.0, 10.0))
    assert options["grpc.max_reconnect_backoff_ms"] == 10_000 and options["grpc.keepalive_time_ms"] == 10_000
    assert options["grpc.http2.max_pings_without_data"] == 0  # pings go on while nothing is sent
    assert options["grpc.keepalive_permit_without_calls"] == 0  # but not with no call open
    mirror = dict(MirrorStore("127.0.0.1:1")._channel_options)
    assert mirror["grpc.max_reconnect_backoff_ms"] == 5_000 and mirror["grpc.keepalive_time_ms"] == 5_000


def test_every_grpc_option_key_kvx_sets_is_one_grpc_knows() -> None:
    """gRPC ignores an option key it does not know, without a word: the service once
    set its ping allowance under a key that only resembles gRPC's, kept the default,
    and cut every idle watch off with GOAWAY "too_many_pings". Each "grpc.*" key in
    kvx's source must appear in the gRPC library itself, and the server's and the
    channels' options must come from those keys."""
    import pathlib
    import re

    from grpc._cython import cygrpc

    from kvx.metadata.client import channel_options
    from kvx.metadata.service import ServiceLimits, server_options

    library = pathlib.Path(cygrpc.__file__).read_bytes()
    source = pathlib.Path(__file__).resolve().parents[2] / "kvx"
    keys = {
        key
        for path in source.rglob("*.py")
        for key in re.findall(r"""["'](grpc\.[a-z0-9_.]+)["']""", path.read_text())
    }
    set_now = {key for key, _ in server_options(ServiceLimits()) + channel_options(5.0)}
    assert "grpc.http2.min_ping_interval_without_data_ms" in set_now and set_now <= keys
    unknown = sorted(key for key in keys if key.encode() + b"\0" not in library)
    assert not unknown, f"option keys gRPC does not know: {unknown}"


def test_a_suspect_replica_snapshot_without_a_service_to_ask_keeps_the_live_connection() -> None:
    """A replica's snapshot shows the peer older than the connected one, and the
    service does not answer: the live connection is returned (and asked about
    again next time), not replaced by the replica's record."""

    agent = _Connected()
    current = _record(1, revision=40, epoch=6)
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current, ConnectError("down")])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    cached = directory.resolve("peer", None, None)
    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))
    added = len(agent.added)
    assert directory.resolve("peer", cached, None) is cached
    assert len(agent.added) == added and "peer" in directory._stale and service.calls == 2
    assert agent.replaced == []  # not on the suspect snapshot's word


def test_the_services_own_event_after_a_suspect_snapshot_is_acted_on() -> None:
    """Only the suspect snapshot is held back: the service's watch showing the
    peer restart again (epoch 7) closes the old connection at once, as ever."""

    agent = _Connected()
    current = _record(1, revision=40, epoch=6)
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    directory._watcher.current_stream = (2, reader)  # type: ignore[union-attr]
    directory._watcher.snapshotting = True  # type: ignore[union-attr]
    directory._on_event(_event(_record(1, revision=7, epoch=5)))  # suspect: held back
    directory._watcher.current_stream = (3, service)  # moved to the service again
    directory._on_event(_event(_record(1, revision=41, epoch=7)))  # its snapshot: the peer restarted
    assert agent.replaced == [7] and "peer" not in directory._unverified


def test_a_lagging_replicas_later_changes_of_a_suspect_peer_are_held_back_too() -> None:
    """A replica that is behind replays older changes after its snapshot: the
    change of the old incarnation's regions (epoch 5) that follows its suspect
    snapshot does not close the connection to epoch 6 either; once it shows
    epoch 6, the record the agent knew, it has caught up."""

    agent = _Connected()
    current = _record(1, revision=40, epoch=6)
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))  # suspect snapshot
    directory._on_event(_event(_record(2, revision=8, epoch=5)))  # the old incarnation's change, replayed
    assert agent.replaced == [] and "peer" in directory._unverified and directory._known["peer"] == 6
    directory._on_event(_event(_record(1, revision=9, epoch=6)))  # caught up: what the agent knew
    assert agent.replaced == [] and "peer" not in directory._unverified


def test_a_suspect_snapshot_the_service_agrees_with_is_acted_on_at_once() -> None:
    """The peer really restarted (epoch 7) while the watch moved to the replica:
    after the snapshot the service is asked apart, agrees, and the old
    connection is closed then, not only at the next lookup. Where it does not
    agree (the replica is behind), the mark stays."""

    agent = _Connected()
    current, restarted = _record(1, revision=40, epoch=6), _record(1, revision=41, epoch=7)
    reader, service = _Reader([None]), _Reader([current, current, restarted])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)  # asked of the service: the reader has nothing
    for shown in (_record(1, revision=7, epoch=5), _record(1, revision=8, epoch=7)):
        directory._watcher.current_stream = (2, reader)  # type: ignore[union-attr]
        directory._watcher.snapshotting = True  # type: ignore[union-attr]
        directory._on_event(_event(shown))
        assert directory._to_verify == {"peer"}
        suspects, directory._to_verify = directory._to_verify, set()
        directory._verify(suspects)  # as the thread started at SYNCED does
    # Epoch 5: the service said 6, so held. Epoch 7: the service said 7, so acted on.
    assert agent.replaced == [7] and "peer" not in directory._unverified and directory._known["peer"] == 7


def test_a_suspect_peer_takes_the_services_answer_and_is_released_when_the_replica_catches_up() -> None:
    """The replica's snapshot shows epoch 5 while the agent knew 6 and the service
    already has 7: the service's answer is acted on (the connection to 6 closed),
    and once the replica shows 7 it is trusted again, so its next change (a
    restart to 8) is acted on as well. Held forever before: 7 was not what the
    agent knew, and every later change stayed behind the mark."""

    agent = _Connected()
    current = _record(1, revision=40, epoch=6)
    reader, service = (
        _Reader([_record(1, revision=7, epoch=5)]),
        _Reader([current, _record(1, revision=41, epoch=7)]),
    )
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))
    suspects, directory._to_verify = directory._to_verify, set()
    directory._verify(suspects)  # the service says 7
    assert agent.replaced == [7] and directory._known["peer"] == 7 and "peer" in directory._unverified
    directory._on_event(_event(_record(1, revision=8, epoch=7)))  # the replica caught up
    assert "peer" not in directory._unverified
    directory._on_event(_event(_record(1, revision=9, epoch=8)))  # and the peer restarts again
    assert agent.replaced == [7, 8]


def test_a_held_peers_change_shown_by_the_replica_is_asked_of_the_service() -> None:
    """After a suspect snapshot, a change the replica shows of the peer may be a
    replay (held) or real: the service is asked about it, and where it agrees the
    change is acted on."""

    agent = _Connected()
    current, restarted = _record(1, revision=40, epoch=6), _record(1, revision=41, epoch=7)
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current, restarted])
    directory = _directory(agent, reader, service)
    asked: list[set[str]] = []
    directory._verify_later = asked.append  # type: ignore[method-assign]
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))
    directory._to_verify = set()  # (that snapshot's own check is another test's)
    directory._on_event(_event(_record(1, revision=8, epoch=7)))  # held, and asked about
    assert asked == [{"peer"}] and agent.replaced == []
    directory._verify(asked[0])
    assert agent.replaced == [7] and "peer" not in directory._unverified


def test_a_change_the_services_watch_showed_is_what_a_replica_snapshot_is_compared_with() -> None:
    """The peer restarted with other regions while the watch followed the service;
    a replica that shows that same record later is not suspect (before, only a
    lookup's record counted as what the agent knew)."""

    agent = _Connected()
    current, restarted = _record(1, revision=40, epoch=6), _record(2, revision=41, epoch=7)
    reader, service = _Reader([_record(1, revision=7, epoch=5)]), _Reader([current])
    directory = _directory(agent, reader, service)
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    directory._on_event(_event(restarted))  # the service's watch: a restart, other regions
    assert agent.replaced == [7]
    _replica_snapshot(directory, reader, _record(2, revision=12, epoch=7))
    assert "peer" not in directory._unverified and directory._to_verify == set()


def test_the_verify_thread_goes_on_after_an_error() -> None:
    """An error while acting on the service's answer (closing the old connection
    failed) is logged: the one thread that asks must not die with the flag that
    says it is at work still set, or nothing would be asked again."""

    directory = _directory(_Agent(), _Reader([None]))
    calls: list[set[str]] = []

    def failing(names: set[str]) -> None:
        calls.append(names)
        raise OSError("closing the old connection failed")

    directory._verify = failing  # type: ignore[method-assign]
    directory._verify_pending, directory._verifying = {"peer"}, True
    directory._verify_pending_names()
    assert calls == [{"peer"}] and directory._verifying is False


def test_the_services_answer_makes_a_lookup_under_way_ask_again_and_a_delete_matches() -> None:
    """The service's answer in _verify counts as a change (a lookup that got an
    older answer meanwhile asks again); and a replica that shows the held peer
    deleted, as the service says, is trusted with it again."""

    agent = _Connected()
    current = _record(1, revision=40, epoch=6)
    reader, service = (
        _Reader([_record(1, revision=7, epoch=5)]),
        _Reader([current, _record(1, 41, epoch=7), None]),
    )
    directory = _directory(agent, reader, service)
    directory._verify_later = lambda names: None  # type: ignore[method-assign]
    directory._watcher.current_stream = (1, service)  # type: ignore[union-attr]
    directory._on_event(_event(current))
    directory.resolve("peer", None, None)
    _replica_snapshot(directory, reader, _record(1, revision=7, epoch=5))
    changes = directory._changes["peer"]
    directory._verify({"peer"})  # the service says 7
    assert directory._changes["peer"] == changes + 1 and "peer" in directory._unverified
    gone = metadata_pb2.WatchAgentsResponse(type=metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE)
    gone.record.CopyFrom(_record(1, revision=8, epoch=7))
    directory._on_event(gone)  # the replica: deleted (held)
    directory._verify({"peer"})  # the service: not registered either
    assert "peer" not in directory._unverified
