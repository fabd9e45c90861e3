"""Read replicas of the memory store (``kvx metadata --store mirror://PRIMARY``),
against real services on loopback: the copy follows the primary's changes,
refuses every write, resynchronises after the primary restarts, stops
answering once it is stale, and needs the primary's token."""

import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvx
from kvx.errors import ConfigError
from kvx.metadata.client import MetadataClient, MetadataOptions, Watcher
from kvx.metadata.mirror import MirrorStore, parse_mirror_url
from kvx.metadata.service import MetadataServer, ServiceLimits, ThreadedServer
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

TOKEN = "mirror-token-0123456789"


def _mirror(primary: str, token: str | None = None, stale_s: float = 10.0, **server) -> ThreadedServer:
    store = MirrorStore(primary, MetadataOptions(token=token), stale_s=stale_s)
    return ThreadedServer(MetadataServer("127.0.0.1:0", store, token=token, **server))


def _get(address: str, name: str, token: str | None = None):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    return stub(address).GetAgent(metadata_pb2.GetAgentRequest(name=name), timeout=5, metadata=metadata)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _epoch_at(address: str, name: str) -> int | None:
    try:
        return _get(address, name).record.epoch
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def _register(address: str, name: str, epoch: int = 7, ttl_s: int = 30, lease_id: int = 0):
    return stub(address).RegisterAgent(
        metadata_pb2.RegisterAgentRequest(
            record=agent_record(name, epoch, 1), ttl_s=ttl_s, lease_id=lease_id
        ),
        timeout=5,
    )


def _serving(address: str) -> int:
    channel = grpc.insecure_channel(address)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    finally:
        channel.close()


def _names_put() -> tuple[list[str], Callable[[metadata_pb2.WatchAgentsResponse], None]]:
    """A watch callback, and the list of the names it saw put, in order."""
    seen: list[str] = []

    def on_event(event: metadata_pb2.WatchAgentsResponse) -> None:
        if event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT:
            seen.append(event.record.name)

    return seen, on_event


def test_a_mirror_copies_the_records_and_follows_every_change(service):
    first = _register(service.address, "before", 3)  # in the mirror's first snapshot
    with _mirror(service.address) as mirror:
        assert wait_until(lambda: _epoch_at(mirror.address, "before") == 3, tolerate=(grpc.RpcError,))
        answer = _get(mirror.address, "before").record
        assert answer.lease_id == 0 and answer.metadata.name == "before"
        assert [r.id for r in answer.metadata.regions] == [1]

        _register(service.address, "after", 5)
        assert wait_until(lambda: _epoch_at(mirror.address, "after") == 5)
        second = _register(service.address, "before", 4, lease_id=first.lease_id)  # re-registered, new epoch
        assert wait_until(lambda: _epoch_at(mirror.address, "before") == 4)
        stub(service.address).UnregisterAgent(
            metadata_pb2.UnregisterAgentRequest(name="before", lease_id=second.lease_id), timeout=5
        )
        code, _ = _code(
            lambda: stub(service.address).UnregisterAgent(
                metadata_pb2.UnregisterAgentRequest(name="after"), timeout=5
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert wait_until(lambda: _epoch_at(mirror.address, "before") is None)
        assert _epoch_at(mirror.address, "after") == 5  # its unregistration without the lease was refused

        # A lease that runs out at the primary takes the record out of the copy too.
        _register(service.address, "short", 9, ttl_s=2)
        assert wait_until(lambda: _epoch_at(mirror.address, "short") == 9)
        assert wait_until(lambda: _epoch_at(mirror.address, "short") is None, timeout_s=10)

        listed = MetadataClient(mirror.address).list()
        assert [record.name for record in listed] == ["after"]
        assert _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_mirror_refuses_every_write_and_names_its_primary(service):
    with _mirror(service.address) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        calls = {
            "RegisterAgent": lambda: _register(mirror.address, "w"),
            "RegisterAgents": lambda: stub(mirror.address).RegisterAgents(
                metadata_pb2.RegisterAgentsRequest(
                    requests=[metadata_pb2.RegisterAgentRequest(record=agent_record("w", 1, 1))]
                ),
                timeout=5,
            ),
            "UnregisterAgent": lambda: stub(mirror.address).UnregisterAgent(
                metadata_pb2.UnregisterAgentRequest(name="w", lease_id=1), timeout=5
            ),
            "KeepAlive": lambda: list(
                stub(mirror.address).KeepAlive(iter([metadata_pb2.KeepAliveRequest(lease_id=1)]), timeout=5)
            ),
        }
        for method, call in calls.items():
            code, details = _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, method
            assert service.address in details and "read replica" in details, details
        assert mirror.server.store._records == {}  # nothing written to the copy
        assert _epoch_at(service.address, "w") is None  # and nothing forwarded


def test_an_agent_looks_its_peers_up_at_the_read_replica(service):
    """MetadataOptions.read_target: registration and renewals at the service,
    lookups and the watch at the replica."""

    def lookups(srv: ThreadedServer) -> float:
        value = srv.server.metrics.registry.get_sample_value(
            "kvx_metadata_request_seconds_count", {"method": "GetAgent"}
        )
        return value or 0.0

    with _mirror(service.address) as mirror:
        options = MetadataOptions(read_target=mirror.address)
        with (
            kvx.Agent("mirror-a", metadata=service.address, metadata_options=options) as a,
            kvx.Agent("mirror-b", metadata=service.address, metadata_options=options) as b,
        ):
            assert wait_until(lambda: _epoch_at(mirror.address, "mirror-b") == b.epoch)
            before = lookups(service)
            peer = a.connect("mirror-b")
            assert peer.epoch == b.epoch
            assert lookups(mirror) >= 1 and lookups(service) == before
            assert wait_until(lambda: mirror.server.servicer.watch_streams >= 1)
            assert service.server.servicer.watch_streams == 1  # the mirror's own, no agent's


def test_a_mirror_resynchronises_after_the_primary_restarts():
    primary = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = primary.address
    try:
        _register(address, "stays", 1)
        _register(address, "goes", 2)
        with _mirror(address) as mirror:
            assert wait_until(lambda: _epoch_at(mirror.address, "goes") == 2, tolerate=(grpc.RpcError,))
            events: list = []
            watch = stub(mirror.address).WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30)
            for event in watch:
                events.append(event)
                if event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED:
                    break

            primary.stop()
            # Within stale_s the copy still answers, as it was.
            assert _epoch_at(mirror.address, "goes") == 2
            primary = ThreadedServer(MetadataServer(address))  # same port, empty memory store
            _register(address, "stays", 1)
            _register(address, "new", 3)
            store = mirror.server.store
            assert wait_until(
                lambda: store.resyncs >= 1 and _epoch_at(mirror.address, "new") == 3, timeout_s=15
            )
            assert _epoch_at(mirror.address, "goes") is None
            assert _epoch_at(mirror.address, "stays") == 1

            # The mirror's own watcher saw the difference: "goes" deleted, "new" put,
            # "stays" (registered again: a new registration time) put, never deleted.
            changes = []
            for event in watch:
                changes.append((event.type, event.record.name))
                if {("goes", metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE)} <= {
                    (name, kind) for kind, name in changes
                } and any(name == "new" for _, name in changes):
                    break
            watch.cancel()
            assert (metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE, "goes") in changes
            assert (metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT, "new") in changes
            assert (metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE, "stays") not in changes
    finally:
        primary.stop()


def test_a_mirror_that_lost_its_primary_answers_nothing_once_stale():
    primary = ThreadedServer(MetadataServer("127.0.0.1:0"))
    try:
        _register(primary.address, "p", 1)
        with _mirror(primary.address, stale_s=1) as mirror:
            assert wait_until(lambda: _epoch_at(mirror.address, "p") == 1, tolerate=(grpc.RpcError,))
            watch = stub(mirror.address).WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=30)
            assert next(watch).record.name == "p"
            assert next(watch).type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED
            primary.stop()
            with pytest.raises(grpc.RpcError) as info:
                next(watch)  # cut off once stale, not left waiting on a copy that no longer moves
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            code, details = _code(lambda: _get(mirror.address, "p"))
            assert code == grpc.StatusCode.UNAVAILABLE and "lost the primary" in details
            assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        primary.stop()


def test_a_mirror_without_the_primary_token_copies_nothing_and_says_so():
    """The primary's token guards its records from a mirror as from any client;
    an unsynchronised mirror answers UNAVAILABLE, never 'not found'."""
    with ThreadedServer(MetadataServer("127.0.0.1:0", token=TOKEN)) as primary:
        metadata = [("authorization", f"Bearer {TOKEN}")]
        stub(primary.address).RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=agent_record("secret", 1, 1), ttl_s=30),
            timeout=5,
            metadata=metadata,
        )
        wrong = "not-the-token-0123456789"
        with _mirror(primary.address, token=wrong) as mirror:
            time.sleep(1.0)  # several attempts at the primary, each refused
            assert mirror.server.store._records == {}
            code, details = _code(lambda: _get(mirror.address, "secret", wrong))
            assert code == grpc.StatusCode.UNAVAILABLE and "not copied" in details
        with _mirror(primary.address, token=TOKEN) as mirror:
            assert wait_until(
                lambda: _get(mirror.address, "secret", TOKEN).record.epoch == 1, tolerate=(grpc.RpcError,)
            )
            # The mirror asks its own clients for the token too.
            code, _ = _code(lambda: _get(mirror.address, "secret"))
            assert code == grpc.StatusCode.UNAUTHENTICATED


def test_mirror_urls_name_one_primary():
    assert parse_mirror_url("mirror://10.0.0.5:50051") == "10.0.0.5:50051"
    assert parse_mirror_url("mirror://[::1]:50051") == "[::1]:50051"
    for bad in (
        "mirror://",
        "mirror://host",
        "mirror://a:1,b:2",
        "etcd://a:1",
        "mirror://:1",
        "mirror://h:x",
    ):
        with pytest.raises(ConfigError):
            parse_mirror_url(bad)


def test_a_resync_republishes_only_what_changed():
    """A new snapshot's copy of a record the mirror holds is no change: its
    watchers see nothing, and its revision stays."""
    import asyncio

    async def run() -> None:
        store = MirrorStore("127.0.0.1:1")
        store._following = store._synced_once = True  # as after a first snapshot
        record = agent_record("same", 2, 1)
        record.registered_unix_ms = 123
        store._put(record)
        revision = (await store.get("same")).revision
        watch = store.watch()
        assert (await watch.__anext__()).record.name == "same"
        assert (await watch.__anext__()).type.value == "synced"
        again = agent_record("same", 2, 1)
        again.registered_unix_ms = 123
        again.revision = 99  # the primary's revision is not the copy's
        store._put(again)
        changed = agent_record("same", 3, 1)
        store._put(changed)
        event = await asyncio.wait_for(watch.__anext__(), 5)
        assert event.record.epoch == 3 and event.revision == revision + 1
        await watch.aclose()

    asyncio.run(run())


def test_a_mirror_holds_no_more_than_its_limits(service):
    """The primary's stream is input from the network: a copy that would pass the
    replica's --max-agents is not served, and says why."""
    _register(service.address, "one", 1)
    _register(service.address, "two", 2)
    store = MirrorStore(service.address, stale_s=10, max_agents=1)
    with ThreadedServer(MetadataServer("127.0.0.1:0", store)) as mirror:
        time.sleep(1.0)  # several attempts, each stopped at the bound
        # Nothing is kept of an attempt cut short, and nothing is served.
        assert store._records == {} and not store._synced_once
        code, details = _code(lambda: _get(mirror.address, "one"))
        assert code == grpc.StatusCode.UNAVAILABLE and "not copied" in details
    with _mirror(service.address) as mirror:  # the same registry within the default bounds
        assert wait_until(lambda: _epoch_at(mirror.address, "two") == 2, tolerate=(grpc.RpcError,))


def test_an_agent_whose_reads_move_to_a_restarted_replica_keeps_resolving(service):
    """Each replica counts revisions of its own: when an agent's reads move to a
    restarted replica (or another one), its lookups there are not refused as older
    than what it saw before, also before its watch has moved; and a change made
    while no replica followed shows in the new replica's snapshot."""
    import numpy as np

    mirror = ThreadedServer(MetadataServer("127.0.0.1:0", MirrorStore(service.address)))
    address = mirror.address
    try:
        for i in range(30):  # the replica's counter runs ahead of a restarted one's
            _register(service.address, f"pad-{i}", 1)
        options = MetadataOptions(read_target=address)
        with (
            kvx.Agent("move-a", metadata=service.address, metadata_options=options) as a,
            kvx.Agent("move-b", metadata=service.address, metadata_options=options) as b,
        ):
            b.register(np.zeros(4096, np.uint8))
            assert wait_until(lambda: len(_get(address, "move-b").record.metadata.regions) == 1)
            assert len(a.connect("move-b").regions) == 1
            directory = a._directory
            assert directory is not None
            mirror.stop()
            b.register(np.zeros(4096, np.uint8))  # while no replica follows the primary
            mirror = ThreadedServer(MetadataServer(address, MirrorStore(service.address)))
            assert wait_until(lambda: _serving(address) == health_pb2.HealthCheckResponse.SERVING)
            a.connect("move-b")  # at once: the agent's watch may not have moved yet
            # The new replica's snapshot reaches the agent's watch and shows the change.
            assert wait_until(lambda: mirror.server.servicer.watch_streams >= 1, timeout_s=15)
            assert wait_until(lambda: len(a.connect("move-b").regions) == 2, timeout_s=15)
            assert "move-b" not in directory._stale
    finally:
        mirror.stop()


def test_a_name_the_replica_lacks_is_asked_of_the_service(service):
    """A replica that has not copied a registration yet (here: one that follows
    another service) is not the last word on a name."""
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0")) as elsewhere,
        _mirror(elsewhere.address) as mirror,
    ):
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        options = MetadataOptions(read_target=mirror.address)
        with (
            kvx.Agent("lack-a", metadata=service.address, metadata_options=options) as a,
            kvx.Agent("lack-b", metadata=service.address) as b,
        ):
            assert a.connect("lack-b").epoch == b.epoch
            with pytest.raises(kvx.ConnectError, match="no agent named 'lack-c'"):
                a.connect("lack-c")


def test_kvx_metadata_runs_a_read_replica(service, tmp_path):
    """The command line: ``--store mirror://`` serves the primary's records; its
    flags without a mirror store, or a malformed URL, are refused at start."""
    import socket
    import subprocess
    import sys

    def kvx_metadata(*flags: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "kvx.cli", "metadata", "--admin-listen", "off", *flags],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )

    for flags, says in (
        (["--mirror-stale-s", "5"], "go with --store mirror://"),
        (["--primary-tls-ca", str(tmp_path / "ca.pem")], "go with --store mirror://"),
        (["--store", "mirror://a:1,b:2"], "one primary service"),
    ):
        proc = kvx_metadata("--listen", "127.0.0.1:0", *flags)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and says in err, (flags, err)

    _register(service.address, "cli", 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    proc = kvx_metadata("--listen", address, "--store", f"mirror://{service.address}")
    try:
        assert wait_until(lambda: _epoch_at(address, "cli") == 4, 30, (grpc.RpcError,))
        code, details = _code(lambda: _register(address, "cli-2"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and service.address in details
    finally:
        proc.terminate()
        proc.wait(10)


def test_agents_watches_filling_the_cap_do_not_cut_a_replica_off():
    """Agents' watches fill the primary's --max-watch-streams: a read replica
    that (re)connects is still served, from slots set aside for replicas.
    Saying so takes a watch of every agent without filters: a caller that
    claims to be a replica with a watch of names, a role or labels is an
    agent. Past the replicas' slots a claim takes an agent's slot, or is
    refused when those are taken too, naming both limits."""
    from kvx.metadata.client import READ_REPLICA_HEADER

    limits = ServiceLimits(max_watch_streams=1, max_replica_watch_streams=1)
    says = [(READ_REPLICA_HEADER, "1")]
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as primary:
        servicer = primary.server.servicer
        _register(primary.address, "a", 3)
        agents = stub(primary.address)

        def watch(request: metadata_pb2.WatchAgentsRequest, metadata=None):
            return agents.WatchAgents(request, metadata=metadata, timeout=120)

        def refused(request: metadata_pb2.WatchAgentsRequest, metadata=None) -> str:
            code, details = _code(lambda: next(watch(request, metadata)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            return details

        agent_watch = watch(metadata_pb2.WatchAgentsRequest(names=["a"]))
        try:
            assert next(agent_watch).record.name == "a"
            assert "--max-watch-streams" in refused(metadata_pb2.WatchAgentsRequest())
            for filtered in (  # a watch with a filter is an agent's, whatever it says
                metadata_pb2.WatchAgentsRequest(names=["a"]),
                metadata_pb2.WatchAgentsRequest(role=metadata_pb2.ROLE_PREFILL),
                metadata_pb2.WatchAgentsRequest(labels={"zone": "z1"}),
            ):
                assert "--max-watch-streams" in refused(filtered, says)
            with _mirror(primary.address) as mirror:
                assert wait_until(lambda: _epoch_at(mirror.address, "a") == 3, tolerate=(grpc.RpcError,))
                assert servicer.replica_watch_streams == 1 and servicer.watch_streams == 2
                details = refused(metadata_pb2.WatchAgentsRequest(), says)  # both kinds of slot taken
                assert "--max-watch-streams" in details and "--max-replica-watch-streams" in details
                # The agent's slot freed: an agent watches again, beside the replica.
                agent_watch.cancel()
                assert wait_until(lambda: servicer.watch_streams == 1)
                agent_watch = watch(metadata_pb2.WatchAgentsRequest(names=["a"]))
                assert next(agent_watch).record.name == "a"
                _register(primary.address, "b", 4)  # the replica still follows
                assert wait_until(lambda: _epoch_at(mirror.address, "b") == 4, tolerate=(grpc.RpcError,))
            assert wait_until(lambda: servicer.replica_watch_streams == 0)
            assert servicer.watch_streams == 1  # the agent's, still open
            # With the agents' slot free and the replicas' taken, a replica takes an agent's.
            agent_watch.cancel()
            assert wait_until(lambda: servicer.watch_streams == 0)
            first = watch(metadata_pb2.WatchAgentsRequest(), says)
            second = watch(metadata_pb2.WatchAgentsRequest(), says)
            try:
                assert next(first).type == next(second).type  # both answered
                assert servicer.replica_watch_streams == 1 and servicer.watch_streams == 2
            finally:
                first.cancel()
                second.cancel()
        finally:
            agent_watch.cancel()


def _free_address() -> str:
    from tests.integration.conftest import _free_port

    return f"127.0.0.1:{_free_port()}"


def test_a_watch_of_a_replica_that_is_down_falls_back_to_the_service_and_returns(service, monkeypatch):
    """A read replica that does not answer must not leave its agents blind to
    changes: their watch moves to the service at once and sees the changes
    there, moves back to the replica once it serves again, and off it again
    when it goes away."""
    from kvx.metadata import client as client_module

    monkeypatch.setattr(client_module, "READER_PROBE_S", 0.2)
    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 0.05)
    replica_address = _free_address()
    seen: list[tuple[str, int]] = []

    def on_event(event: metadata_pb2.WatchAgentsResponse) -> None:
        if event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT:
            seen.append((event.record.name, event.record.epoch))

    reader, primary = MetadataClient(replica_address), MetadataClient(service.address)
    servicer = service.server.servicer
    watcher = Watcher(reader, on_event, names=["a", "b", "c"], fallback=primary)
    try:
        assert watcher.synced.wait(10), "the watch never synced with the replica down"
        assert watcher.source is primary and watcher.current_stream[1] is primary
        _register(service.address, "a", 3)
        assert wait_until(lambda: ("a", 3) in seen)
        store = MirrorStore(service.address, stale_s=10)
        with ThreadedServer(MetadataServer(replica_address, store)):
            # Back on the replica: the service serves only the replica's own watch.
            assert wait_until(lambda: watcher.current_stream[1] is reader and len(store._watchers) == 1, 15)
            assert wait_until(lambda: servicer.watch_streams == 1 and servicer.replica_watch_streams == 1)
            _register(service.address, "b", 4)
            assert wait_until(lambda: ("b", 4) in seen)  # through the replica, whose watch it is
        # The replica gone again: back to the service, and still every change.
        assert wait_until(lambda: watcher.current_stream[1] is primary and servicer.watch_streams == 1)
        _register(service.address, "c", 5)
        assert wait_until(lambda: ("c", 5) in seen)
    finally:
        watcher.stop()
        reader.close()
        primary.close()


def test_a_replica_that_serves_but_refuses_watches_is_asked_less_and_less(service, monkeypatch):
    """A replica whose health says SERVING but which refuses every watch (here: no
    watch slots) must not pull its agents back and forth in step: each return it
    refuses doubles the wait before the next, up to the cap, and the watch stays
    on the service, seeing every change."""
    from kvx.metadata import client as client_module

    monkeypatch.setattr(client_module, "READER_PROBE_S", 0.05)
    monkeypatch.setattr(client_module, "READER_PROBE_MAX_S", 0.4)
    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 0.05)
    seen, on_event = _names_put()

    _register(service.address, "first", 3)
    with _mirror(service.address, limits=ServiceLimits(max_watch_streams=1)) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        holder = stub(mirror.address).WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=60)
        assert next(holder).record.name == "first"  # the replica's one watch slot, taken
        reader, primary = MetadataClient(mirror.address), MetadataClient(service.address)
        watcher = Watcher(reader, on_event, fallback=primary)
        try:
            assert watcher.synced.wait(10)
            assert wait_until(lambda: watcher._probe_s == 0.4, 15), watcher._probe_s
            for i in range(3):
                _register(service.address, f"w{i}", 3)
            assert wait_until(lambda: {"w0", "w1", "w2"} <= set(seen))
        finally:
            watcher.stop()
            holder.cancel()
            reader.close()
            primary.close()


def test_an_agent_whose_replica_is_down_still_sees_its_peers_change(service, monkeypatch):
    """An agent that reads from a replica that is down watches the service meanwhile:
    a peer's new regions reach it. Once the replica answers lookups again (its
    watch not moved back yet), its answers, numbered by another service than the
    watch's, are kept when they are the record the watch showed, not refused as
    behind the service's numbering."""
    import numpy as np

    from kvx.metadata import client as client_module
    from kvx.metadata.directory import _digest

    monkeypatch.setattr(client_module, "READER_PROBE_S", 600.0)  # the watch stays on the service
    for _ in range(40):  # the service's revisions run far ahead of a new replica's
        stub(service.address).UnregisterAgent(
            metadata_pb2.UnregisterAgentRequest(
                name="pad", lease_id=_register(service.address, "pad").lease_id
            ),
            timeout=5,
        )
    replica_address = _free_address()
    options = MetadataOptions(read_target=replica_address)
    with (
        kvx.Agent("down-a", metadata=service.address, metadata_options=options) as a,
        kvx.Agent("down-b", metadata=service.address) as b,
    ):
        directory = a._directory
        assert directory is not None
        assert a.connect("down-b").epoch == b.epoch  # asked of the service: the replica is down
        watcher = directory._watcher
        assert watcher is not None and watcher.current_stream[1] is directory.client
        b.register(np.zeros(4096, np.uint8))
        assert wait_until(lambda: len(a.connect("down-b").regions) == 1)

        with ThreadedServer(MetadataServer(replica_address, MirrorStore(service.address))) as replica:
            b.register(np.zeros(4096, np.uint8))

            def replica_has_both() -> bool:
                record = directory.reader.get("down-b")
                return record is not None and len(record.metadata.regions) == 2

            assert wait_until(replica_has_both, 30, (kvx.ConnectError,))
            copied = directory.reader.get("down-b")
            assert copied is not None
            shown = (metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT, copied.epoch, _digest(copied))
            assert wait_until(lambda: directory._last_event.get("down-b") == shown)  # the service's watch
            assert watcher.current_stream[1] is directory.client
            lookups = replica.server.metrics.registry.get_sample_value(
                "kvx_metadata_request_seconds_count", {"method": "GetAgent"}
            )
            assert len(a.connect("down-b").regions) == 2
            after = replica.server.metrics.registry.get_sample_value(
                "kvx_metadata_request_seconds_count", {"method": "GetAgent"}
            )
            assert after == lookups + 1  # the replica answered, once: not asked again as behind
            assert "down-b" not in directory._stale


def test_a_replica_that_answers_but_drops_each_watch_is_asked_less_and_less(service, monkeypatch):
    """A replica that says SERVING and sends each watch its snapshot, then ends it at
    once (as a replica that keeps losing its primary would), has not kept the watch:
    each return to it doubles the wait before the next, and the changes are seen
    on the service all along."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    from kvx.metadata import client as client_module
    from kvx.v1 import metadata_pb2_grpc

    class Drops(metadata_pb2_grpc.MetadataServiceServicer):
        watches = 0

        def WatchAgents(self, request, context):  # noqa: N802
            Drops.watches += 1
            yield metadata_pb2.WatchAgentsResponse(type=metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED)
            context.abort(grpc.StatusCode.UNAVAILABLE, "lost the primary")

    monkeypatch.setattr(client_module, "READER_PROBE_S", 0.05)
    monkeypatch.setattr(client_module, "READER_PROBE_MAX_S", 0.4)
    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 0.05)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    metadata_pb2_grpc.add_MetadataServiceServicer_to_server(Drops(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # SERVING
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    seen, on_event = _names_put()

    reader, primary = MetadataClient(f"127.0.0.1:{port}"), MetadataClient(service.address)
    watcher = Watcher(reader, on_event, fallback=primary)
    try:
        assert wait_until(lambda: watcher._probe_s == 0.4, 15), watcher._probe_s
        assert wait_until(lambda: watcher.current_stream[1] is primary)
        _register(service.address, "kept", 3)
        assert wait_until(lambda: "kept" in seen)
        # At the cap, a return every 0.2-0.6 s at most (and one reconnection each).
        before = Drops.watches
        time.sleep(1.5)
        assert Drops.watches - before <= 2 * 8, Drops.watches - before
    finally:
        watcher.stop()
        reader.close()
        primary.close()
        server.stop(0)


@pytest.mark.parametrize("kept", [False, True], ids=["new-watch", "kept-watch"])
def test_a_watch_leaving_its_replica_waits_a_random_moment_first(service, monkeypatch, kept):
    """The agents of a replica that dies do not all open a watch at the service at
    once: each waits a random moment of up to READER_MOVE_SPREAD_S first (here
    drawn as the longest), and then watches the service. So does a watch the
    replica had kept (READER_STAYED_S), which tries the replica once more first."""
    from kvx.metadata import client as client_module

    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 1.0)
    if kept:
        monkeypatch.setattr(client_module, "READER_STAYED_S", 0.5)
    draw, drawn = client_module.random.uniform, []

    def longest(low: float, high: float) -> float:
        if (low, high) != (0, 1.0):
            return draw(low, high)
        drawn.append(time.monotonic())
        return high

    monkeypatch.setattr(client_module.random, "uniform", longest)
    with _mirror(service.address) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        reader, primary = MetadataClient(mirror.address), MetadataClient(service.address)
        watcher = Watcher(reader, lambda event: None, names=["x"], fallback=primary)
        try:
            assert watcher.synced.wait(10) and watcher.current_stream[1] is reader
            if kept:
                time.sleep(1.0)
            mirror.stop()
            assert wait_until(lambda: watcher.current_stream[1] is primary, 10)
            moved = time.monotonic()
            assert len(drawn) == 1 and moved - drawn[0] >= 1.0
        finally:
            watcher.stop()
            reader.close()
            primary.close()


def test_restarts_of_a_kept_watch_of_the_replica_do_not_count_as_its_end(service, monkeypatch):
    """A return to the replica that it kept READER_STAYED_S resets the probe's wait,
    even when the watch was restarted for new names (as an agent's is for each
    new peer) more often than that: the replica kept the watch all along, and
    only its last stream was short."""
    from kvx.metadata import client as client_module

    monkeypatch.setattr(client_module, "READER_STAYED_S", 0.9)
    monkeypatch.setattr(client_module, "READER_PROBE_S", 600.0)  # no return during the test
    monkeypatch.setattr(client_module, "READER_PROBE_MAX_S", 10_000.0)
    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 0.05)
    with _mirror(service.address) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        reader, primary = MetadataClient(mirror.address), MetadataClient(service.address)
        watcher = Watcher(reader, lambda event: None, names=["p0"], fallback=primary)
        try:
            assert watcher.synced.wait(10) and watcher.current_stream[1] is reader
            # As the probe leaves a return to the replica (after one doubling).
            with watcher._lock:
                watcher._returning, watcher._probe_s = True, 1200.0
            for i in range(1, 8):  # a new peer every 0.2 s: 1.4 s on the replica in all
                time.sleep(0.2)
                watcher.watch_names([f"p{j}" for j in range(i + 1)])
                assert watcher.synced.wait(5)
            mirror.stop()  # its last stream lived under READER_STAYED_S
            assert wait_until(lambda: watcher.current_stream[1] is primary, 15)
            assert watcher._probe_s == 600.0  # kept: reset, not doubled to 2400
        finally:
            watcher.stop()
            reader.close()
            primary.close()


def _no_firewall() -> str | None:
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return "drops a port's packets with iptables, which needs root (CI runs the suite as root)"
    if shutil.which("iptables") is None:
        return "needs iptables: scripts/test.sh installs it (apt-get install iptables)"
    probe = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return f"iptables cannot be used here (CAP_NET_ADMIN?): {probe.stderr.strip()}"
    return None


def test_a_replica_gone_without_a_word_is_left_within_keepalive(service, monkeypatch):
    """A replica whose packets stop (a host lost, a partition) sends no error: the
    agent's keepalive must notice it, also on a watch that has long sent nothing
    (gRPC stops pinging after two pings without data unless told otherwise,
    and then noticed it only after about a minute). Here the pings are 1.5 s
    apart with a 1 s timeout, the replica drops everything after 5 s of
    quiet, and the watch follows the service within a few seconds."""
    import contextlib
    import subprocess

    from kvx.metadata import client as client_module

    reason = _no_firewall()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(client_module, "KEEPALIVE_S", 1.5)
    monkeypatch.setattr(client_module, "KEEPALIVE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(client_module, "READER_STAYED_S", 600.0)  # not kept: moves at once
    monkeypatch.setattr(client_module, "READER_PROBE_S", 600.0)  # and stays on the service
    monkeypatch.setattr(client_module, "READER_MOVE_SPREAD_S", 0.05)
    seen, on_event = _names_put()

    with _mirror(service.address) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        port = mirror.address.rsplit(":", 1)[1]
        reader = MetadataClient(mirror.address, reader=True)
        primary = MetadataClient(service.address)
        watcher = Watcher(reader, on_event, names=["quiet"], fallback=primary)
        rules = [["INPUT", "-p", "tcp", flag, port, "-j", "DROP"] for flag in ("--dport", "--sport")]
        added: list[list[str]] = []
        try:
            assert watcher.synced.wait(10) and watcher.current_stream[1] is reader
            time.sleep(5)  # three pings without data: past gRPC's default of two
            for rule in rules:
                subprocess.run(["iptables", "-I", *rule], check=True, timeout=20)
                added.append(rule)
            silent = time.monotonic()
            assert wait_until(lambda: watcher.current_stream[1] is primary, 20)
            assert time.monotonic() - silent < 10
            _register(service.address, "quiet", 3)
            assert wait_until(lambda: "quiet" in seen)
        finally:
            for rule in added:
                with contextlib.suppress(subprocess.SubprocessError):
                    subprocess.run(["iptables", "-D", *rule], timeout=20)
            watcher.stop()
            reader.close()
            primary.close()


def test_watches_that_receive_nothing_are_not_cut_off_for_their_pings(service, monkeypatch):
    """A watch sends nothing after its request, and one whose names do not change
    receives nothing either: its client pings to find out whether the connection
    still stands. The service must take those pings (a service that counts them as
    abuse answers GOAWAY "too_many_pings" after its strikes, ending every stream of
    the connection: an agent's watch restarted, a replica took a whole new snapshot).
    Pings here 1.2 s apart, an agent's watch and a replica's watch of its primary, for
    longer than eleven pings."""
    from kvx.metadata import client as client_module
    from kvx.metadata import mirror as mirror_module

    monkeypatch.setattr(client_module, "KEEPALIVE_S", 1.2)
    monkeypatch.setattr(mirror_module, "MIRROR_KEEPALIVE_S", 1.2)
    seen, on_event = _names_put()

    store = MirrorStore(service.address, MetadataOptions())
    with ThreadedServer(MetadataServer("127.0.0.1:0", store)) as mirror:
        assert wait_until(lambda: _serving(mirror.address) == health_pb2.HealthCheckResponse.SERVING)
        client = MetadataClient(service.address)
        watcher = Watcher(client, on_event, names=["quiet"])
        try:
            assert watcher.synced.wait(10)
            stream = watcher.current_stream[0]
            time.sleep(16)  # 13 pings each
            assert (watcher.current_stream[0], store.resyncs) == (stream, 0)
            _register(service.address, "quiet", 3)
            assert wait_until(lambda: "quiet" in seen)
            assert wait_until(lambda: _epoch_at(mirror.address, "quiet") == 3)
            assert (watcher.current_stream[0], store.resyncs) == (stream, 0)
        finally:
            watcher.stop()
            client.close()


def test_a_watcher_gone_without_a_word_gives_its_watch_slot_back(monkeypatch):
    """A client that holds the service's one watch slot and then vanishes (its
    packets dropped, no FIN: a host lost) must not keep the slot: the service's
    own keepalive (here a ping after 1 s of silence, 2 s to answer) finds the
    connection dead, and another client's watch is taken. Without it the slot
    stayed taken for gRPC's default of two hours."""
    import contextlib
    import os
    import shlex
    import subprocess

    from kvx.metadata import service as service_module
    from kvx.v1 import metadata_pb2_grpc

    reason = _no_firewall()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(service_module, "CLIENT_KEEPALIVE_S", 1.0)
    monkeypatch.setattr(service_module, "CLIENT_KEEPALIVE_TIMEOUT_S", 2.0)
    limits = ServiceLimits(max_watch_streams=1)
    request = metadata_pb2.WatchAgentsRequest(names=["quiet"])
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        port = srv.address.rsplit(":", 1)[1]
        gone = grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
        stream = gone.unary_stream(
            "/kvx.v1.MetadataService/WatchAgents",
            request_serializer=metadata_pb2.WatchAgentsRequest.SerializeToString,
            response_deserializer=metadata_pb2.WatchAgentsResponse.FromString,
        )(request)
        assert next(stream).type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED
        listing = subprocess.run(
            ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()
        # Recv-Q, Send-Q, local address, peer address (the service's port).
        local_ports = [line.split()[2].rsplit(":", 1)[1] for line in listing]
        assert len(local_ports) == 1, listing  # the vanishing client's one connection
        tag = f"kvx-test-{os.getpid()}-{port}"  # every rule of this test, found by it to be removed
        rules = [
            [
                "INPUT",
                "-i",
                "lo",
                "-p",
                "tcp",
                flag,
                local_ports[0],
                "-m",
                "comment",
                "--comment",
                tag,
                "-j",
                "DROP",
            ]
            for flag in ("--dport", "--sport")
        ]
        channel = grpc.insecure_channel(srv.address)
        other = metadata_pb2_grpc.MetadataServiceStub(channel)
        try:
            with pytest.raises(grpc.RpcError) as info:  # the slot is taken
                next(other.WatchAgents(request, timeout=5))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for rule in rules:
                subprocess.run(["iptables", "-I", *rule], check=True, timeout=20)

            def watch_taken() -> bool:
                try:
                    return next(other.WatchAgents(request, timeout=5)).type == (
                        metadata_pb2.WatchAgentsResponse.EVENT_TYPE_SYNCED
                    )
                except grpc.RpcError:
                    return False  # RESOURCE_EXHAUSTED while the slot is held (or a loaded host's hiccup)

            assert wait_until(watch_taken, 15)
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                listed = subprocess.run(
                    ["iptables", "-S", "INPUT"], capture_output=True, text=True, timeout=20
                )
                for line in listed.stdout.splitlines():
                    if tag in line:
                        subprocess.run(["iptables", "-D", *shlex.split(line)[1:]], timeout=20)
            stream.cancel()
            gone.close()
            channel.close()
