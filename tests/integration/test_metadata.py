"""The metadata service (memory store) with real gRPC calls, real agents and
agents in other processes."""

import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvx
from kvx.metadata.client import MetadataClient, Watcher
from kvx.metadata.service import MetadataServer, ServiceLimits, ThreadedServer, TlsConfig
from kvx.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import wait_until

Event = metadata_pb2.WatchAgentsResponse


@pytest.fixture
def service():
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        yield srv


def _record(name, epoch=7, started=1000, role=metadata_pb2.ROLE_PREFILL, **labels):
    rec = metadata_pb2.AgentRecord(name=name, epoch=epoch, role=role, labels=labels, started_unix_ms=started)
    rec.metadata.name, rec.metadata.epoch = name, epoch
    return rec


def _stub(address):
    return metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(address))


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _until(predicate, timeout_s=10.0):
    return wait_until(predicate, timeout_s, (kvx.ConnectError,))


def test_bad_registrations_get_clear_codes_and_change_nothing(service):
    stub = _stub(service.address)
    big = _record("big")
    big.engine_info["blob"] = "x" * 300_000
    many = _record("many")
    for i in range(5000):
        many.metadata.regions.add(id=i + 1, size_bytes=1)
    mismatched = _record("mismatch")
    mismatched.metadata.epoch = 99
    cases = {
        "invalid agent name": _record("bad name!"),
        "epoch must be set": _record("zero", epoch=0),
        "started_unix_ms": _record("nostart", started=0),
        "must equal": mismatched,
        "regions; at most": many,
    }
    for message, rec in cases.items():
        code, details = _code(
            lambda rec=rec: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=rec))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    code, _ = _code(lambda: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=big)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    code, details = _code(
        lambda: stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("t"), ttl_s=1))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in details
    assert not stub.ListAgents(metadata_pb2.ListAgentsRequest()).records


def test_an_older_epoch_cannot_take_a_live_name(service):
    stub = _stub(service.address)
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=2, started=2000)))
    code, details = _code(
        lambda: stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=1, started=1000))
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale" in details
    assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record.epoch == 2
    # A later start (a restart) replaces it; the same epoch refreshes it.
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=3, started=3000)))
    stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=_record("p", epoch=3, started=3000, zone="a"))
    )
    rec = stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record
    assert rec.epoch == 3 and rec.labels["zone"] == "a"


def test_lease_expiry_deletes_the_record_and_watchers_see_it(service):
    stub = _stub(service.address)
    events = []
    client = MetadataClient(service.address)
    watcher = Watcher(client, events.append)
    assert watcher.synced.wait(5)
    start = time.monotonic()
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("short"), ttl_s=2))
    assert _until(lambda: any(e.type == Event.EVENT_TYPE_DELETE for e in events), 5)
    assert time.monotonic() - start < 3.5
    deleted = [e for e in events if e.type == Event.EVENT_TYPE_DELETE][0]
    assert deleted.record.name == "short" and deleted.record.epoch == 7
    code, _ = _code(lambda: stub.GetAgent(metadata_pb2.GetAgentRequest(name="short")))
    assert code == grpc.StatusCode.NOT_FOUND
    watcher.stop()
    client.close()


def test_watch_sends_the_snapshot_then_changes(service):
    stub = _stub(service.address)
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("a", role=metadata_pb2.ROLE_PREFILL)))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("b", role=metadata_pb2.ROLE_DECODE)))
    stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(role=metadata_pb2.ROLE_PREFILL), timeout=10)
    first = [next(stream), next(stream)]
    assert [(e.type, e.record.name) for e in first] == [
        (Event.EVENT_TYPE_PUT, "a"),
        (Event.EVENT_TYPE_SYNCED, ""),
    ]
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("c", role=metadata_pb2.ROLE_DECODE)))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("d", role=metadata_pb2.ROLE_PREFILL)))
    stub.UnregisterAgent(metadata_pb2.UnregisterAgentRequest(name="a"))
    later = [next(stream), next(stream)]
    assert [(e.type, e.record.name) for e in later] == [
        (Event.EVENT_TYPE_PUT, "d"),
        (Event.EVENT_TYPE_DELETE, "a"),
    ]
    stream.cancel()


def test_list_filters_and_pages(service):
    stub = _stub(service.address)
    for i in range(7):
        role = metadata_pb2.ROLE_DECODE if i % 2 else metadata_pb2.ROLE_PREFILL
        stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(
                record=_record(f"agent-{i}", role=role, model="m" if i < 5 else "n")
            )
        )
    names, token = [], ""
    while True:
        page = stub.ListAgents(
            metadata_pb2.ListAgentsRequest(
                role=metadata_pb2.ROLE_PREFILL, labels={"model": "m"}, page_size=1, page_token=token
            )
        )
        names += [r.name for r in page.records]
        token = page.next_page_token
        if not token:
            break
    assert names == ["agent-0", "agent-2", "agent-4"]
    code, _ = _code(lambda: stub.ListAgents(metadata_pb2.ListAgentsRequest(page_token="%%%")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(MetadataClient(service.address).list()) == 7


def test_health_and_reflection_are_on(service):
    channel = grpc.insecure_channel(service.address)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "kvx.v1.MetadataService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(
        reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    assert "kvx.v1.MetadataService" in [s.name for s in reply.list_services_response.service]


def test_agents_register_resolve_and_follow_restarts(service):
    with (
        kvx.Agent("prefill-0", metadata=service.address, role="prefill", labels={"model": "tiny"}) as prefill,
        kvx.Agent("decode-0", metadata=service.address, role="decode") as decode,
    ):
        pool = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
        prefill.register(pool)
        local = np.zeros(4096, np.uint8)
        region = decode.register(local)
        peer = decode.connect("prefill-0")
        peer.read(region.descs(0, 4096), peer.regions[0].descs(0, 4096)).wait(5)
        assert local.tobytes() == pool[:4096].tobytes()
        assert decode.connect("prefill-0") is peer  # cached
        extra = prefill.register(np.full(4096, 9, np.uint8))  # a new region: resolved again, same peer
        assert _until(lambda: len(decode.connect("prefill-0").regions) == 2, 5)
        assert decode.connect("prefill-0") is peer and peer.region(extra.id)
        rec = MetadataClient(service.address).get("prefill-0")
        assert (
            rec.role == metadata_pb2.ROLE_PREFILL
            and rec.labels["model"] == "tiny"
            and rec.started_unix_ms > 0
        )
        with pytest.raises(kvx.ConnectError, match="no agent named 'nobody'"):
            decode.connect("nobody")

        prefill.close()  # unregisters
        assert MetadataClient(service.address).get("prefill-0") is None
        with kvx.Agent("prefill-0", metadata=service.address, role="prefill") as reborn:
            reborn.register(np.full(4096, 5, np.uint8))
            assert _until(lambda: not peer.alive, 5), "the old peer should be closed by the watch"
            peer2 = decode.connect("prefill-0")
            assert peer2.epoch == reborn.epoch != peer.epoch
            peer2.read(region.descs(0, 4096), peer2.regions[0].descs(0, 4096)).wait(5)
            assert (local == 5).all()


def test_agents_come_back_after_the_service_restarts():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    opts = kvx.MetadataOptions(lease_ttl_s=3)
    agents = [kvx.Agent(f"a{i}", metadata=address, metadata_options=opts) for i in range(3)]
    try:
        server.stop()
        time.sleep(0.5)
        server = ThreadedServer(MetadataServer(address))  # same port, empty memory store
        client = MetadataClient(address)
        start = time.monotonic()
        assert _until(lambda: len(client.list()) == 3, 10)
        assert time.monotonic() - start < 5
        assert agents[0].connect("a1").epoch == agents[1].epoch
    finally:
        for agent in agents:
            agent.close()
        server.stop()


def test_a_dead_agent_process_disappears_when_its_lease_expires(service, make_worker):
    worker = make_worker("prefill-w", metadata=service.address, role="prefill", lease_ttl_s=2)
    client = MetadataClient(service.address)
    assert client.get("prefill-w") is not None
    worker.kill()
    assert _until(lambda: client.get("prefill-w") is None, 6)


def test_unreachable_service_is_a_clear_error():
    with pytest.raises(kvx.ConnectError, match="unavailable"):
        kvx.Agent("lonely", metadata="127.0.0.1:9", metadata_options=kvx.MetadataOptions(timeout_s=1))


def test_token_is_required_when_configured():
    with ThreadedServer(MetadataServer("127.0.0.1:0", token="grpc-token-0123456789")) as srv:
        code, details = _code(lambda: _stub(srv.address).ListAgents(metadata_pb2.ListAgentsRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        with pytest.raises(kvx.MetadataError, match="token"):
            kvx.Agent("no-token", metadata=srv.address)
        opts = kvx.MetadataOptions(token="grpc-token-0123456789")
        with kvx.Agent("with-token", metadata=srv.address, metadata_options=opts):
            assert [r.name for r in MetadataClient(srv.address, opts).list()] == ["with-token"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvx-test-ca",
    )
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return d


def test_tls_with_client_certificates(pki):
    tls = TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), client_ca=str(pki / "ca.pem"))
    with ThreadedServer(MetadataServer("127.0.0.1:0", tls=tls)) as srv:
        address = srv.address.replace("127.0.0.1", "localhost")
        good = kvx.MetadataOptions(
            tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key")
        )
        with kvx.Agent("secure", metadata=address, metadata_options=good):
            assert [r.name for r in MetadataClient(address, good).list()] == ["secure"]
        no_cert = kvx.MetadataOptions(tls_ca=str(pki / "ca.pem"), timeout_s=2)
        with pytest.raises((kvx.ConnectError, kvx.MetadataError)):
            MetadataClient(address, no_cert).list()
        with pytest.raises(kvx.ConnectError):  # plaintext against TLS
            MetadataClient(srv.address, kvx.MetadataOptions(timeout_s=2)).list()


def test_concurrent_registrations_of_one_name_leave_one_winner(service):
    stub = _stub(service.address)
    results = []

    def register(epoch):
        try:
            stub.RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=_record("race", epoch=epoch, started=epoch))
            )
            results.append(epoch)
        except grpc.RpcError as exc:
            results.append(exc.code())

    threads = [threading.Thread(target=register, args=(e,)) for e in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 8, "a registration did not return"
    # Whatever the order, the agent that started last (epoch 8) holds the name: it replaces
    # any older record, and an older one is refused once it is in. It cannot run out of
    # retries either: each race it loses is another epoch's one successful write, at most 7.
    assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="race")).record.epoch == 8
    assert 8 in results
    refused = [r for r in results if isinstance(r, grpc.StatusCode)]
    assert set(refused) <= {grpc.StatusCode.FAILED_PRECONDITION}, results  # stale, never ABORTED
    assert len(stub.ListAgents(metadata_pb2.ListAgentsRequest()).records) == 1


def test_service_limits_are_configurable():
    limits = ServiceLimits(max_regions=2)
    with ThreadedServer(MetadataServer("127.0.0.1:0", limits=limits)) as srv:
        rec = _record("r")
        for i in range(3):
            rec.metadata.regions.add(id=i + 1, size_bytes=1)
        code, _ = _code(
            lambda: _stub(srv.address).RegisterAgent(metadata_pb2.RegisterAgentRequest(record=rec))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT


# Regressions from review.


def test_filtered_watch_sees_a_record_leave_its_view(service):
    stub = _stub(service.address)
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("a", epoch=1, started=1, model="x")))
    stream = stub.WatchAgents(metadata_pb2.WatchAgentsRequest(labels={"model": "x"}), timeout=10)
    assert [next(stream).type, next(stream).type] == [Event.EVENT_TYPE_PUT, Event.EVENT_TYPE_SYNCED]
    # "a" restarts with another model: for this watcher it is gone.
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("a", epoch=2, started=2, model="y")))
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("b", epoch=1, started=1, model="x")))
    event = next(stream)
    assert (event.type, event.record.name) == (Event.EVENT_TYPE_DELETE, "a")
    event = next(stream)
    assert (event.type, event.record.name) == (Event.EVENT_TYPE_PUT, "b")
    stream.cancel()


def test_lease_ids_are_not_reused_after_a_restart():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    old = MetadataClient(address).register(_record("x"), ttl_s=30).lease_id
    server.stop()
    server = ThreadedServer(MetadataServer(address))
    try:
        MetadataClient(address).register(_record("y"), ttl_s=30)
        reply = next(_stub(address).KeepAlive(iter([metadata_pb2.KeepAliveRequest(lease_id=old)]), timeout=5))
        assert reply.ttl_s == 0  # the old id names nothing on the new service
    finally:
        server.stop()


def test_a_registration_the_service_refuses_is_rolled_back():
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", limits=ServiceLimits(max_regions=1))) as srv,
        kvx.Agent("small", metadata=srv.address) as agent,
    ):
        agent.register(np.zeros(64, np.uint8))
        with pytest.raises(kvx.MetadataError, match="at most 1"):
            agent.register(np.zeros(64, np.uint8))
        assert len(agent.regions) == 1
        assert len(MetadataClient(srv.address).get("small").metadata.regions) == 1


def test_registering_memory_does_not_block_while_the_service_is_down():
    server = ThreadedServer(MetadataServer("127.0.0.1:0"))
    address = server.address
    with kvx.Agent("patient", metadata=address, metadata_options=kvx.MetadataOptions(lease_ttl_s=3)) as agent:
        server.stop()
        assert _until(lambda: agent._directory.registration.lease_id is None, 10)
        start = time.monotonic()
        agent.register(np.zeros(64, np.uint8))
        assert time.monotonic() - start < 0.5
        server = ThreadedServer(MetadataServer(address))
        try:

            def published():
                record = MetadataClient(address).get("patient")
                return record is not None and len(record.metadata.regions) == 1

            assert _until(published, 10)
        finally:
            server.stop()


def test_tls_key_without_certificate_is_a_config_error():
    with pytest.raises(kvx.ConfigError, match="go together"):
        MetadataClient("127.0.0.1:1", kvx.MetadataOptions(tls_key="/tmp/key.pem"))
