"""GetAgent, the lookup path, against a real service on loopback: the encoded
answers it keeps per record never carry a lease id, never outlive the record
they were made from, and go through the same checks (token, request bytes)
as every other call."""

import functools
import time

import grpc
import pytest

import kvx
from kvx.metadata.service import SERVICE_NAME, MetadataServer, ThreadedServer
from kvx.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record

pytestmark = native_pass_only

_record = functools.partial(agent_record, role=metadata_pb2.ROLE_DECODE, started=1)

TOKEN = "lookup-token-0123456789"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _raw_get(channel, name, metadata=None) -> bytes:
    """GetAgent's answer as the bytes that crossed the wire."""
    call = channel.unary_unary(f"/{SERVICE_NAME}/GetAgent")  # no serializers: bytes as they are
    return call(metadata_pb2.GetAgentRequest(name=name).SerializeToString(), timeout=10, metadata=metadata)


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _no_lease_in(answer: bytes, *leases: int) -> metadata_pb2.AgentRecord:
    record = metadata_pb2.GetAgentResponse.FromString(answer).record
    assert "lease_id" not in [field.name for field, _ in record.ListFields()]
    for lease in leases:
        # Nowhere in the bytes, in any encoding a field could carry it in.
        for encoded in (_varint(lease), lease.to_bytes(8, "little"), str(lease).encode()):
            assert encoded not in answer, (hex(lease), answer)
    return record


def test_get_agent_answers_never_carry_a_lease_id(service):
    """The lease id is the registrant's only credential: GetAgent answers leave it
    out, also when the registering client put one into the record it sent."""
    channel = grpc.insecure_channel(service.address)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    reply = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("d", 3, 1, 2), ttl_s=30))
    planted = _record("d", 4, 1, 2, 3)
    planted.lease_id = 0x0123456789ABCDEF  # also never echoed back
    again = stub.RegisterAgent(
        metadata_pb2.RegisterAgentRequest(record=planted, lease_id=reply.lease_id, ttl_s=30)
    )
    record = _no_lease_in(_raw_get(channel, "d"), reply.lease_id, again.lease_id, planted.lease_id)
    assert (record.epoch, record.revision) == (4, again.revision)
    assert [r.id for r in record.metadata.regions] == [1, 2, 3]
    assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="d")).record.lease_id == 0
    channel.close()


def test_get_agent_answers_the_current_record_at_once(service):
    """No answer outlives its record: a re-registration (new epoch, new regions) is
    answered by the very next lookup, an unregistered or expired name is NOT_FOUND,
    and every lookup is counted in the request metrics."""
    metrics = service.server.metrics.registry

    def lookups():
        return metrics.get_sample_value("kvx_metadata_request_seconds_count", {"method": "GetAgent"}) or 0

    channel = grpc.insecure_channel(service.address)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    first = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("p", 1, 1), ttl_s=30))
    before = lookups()
    got = stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record
    assert (got.epoch, [r.id for r in got.metadata.regions], got.revision) == (1, [1], first.revision)
    for epoch in range(2, 7):
        regions = range(epoch, epoch + 3)
        reply = stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(
                record=_record("p", epoch, *regions, zone=f"z{epoch}"), lease_id=first.lease_id, ttl_s=30
            )
        )
        got = stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")).record
        assert (got.epoch, got.labels["zone"], got.revision) == (epoch, f"z{epoch}", reply.revision)
        assert [r.id for r in got.metadata.regions] == list(regions)
        first = reply
    assert stub.UnregisterAgent(
        metadata_pb2.UnregisterAgentRequest(name="p", lease_id=first.lease_id)
    ).existed
    code, details = _code(lambda: stub.GetAgent(metadata_pb2.GetAgentRequest(name="p")))
    assert code == grpc.StatusCode.NOT_FOUND and "'p'" in details

    # Expiry: a lease not renewed takes its record, and its answer, with it.
    stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("short", 9, 1), ttl_s=2))
    assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="short")).record.epoch == 9
    assert wait_until(
        lambda: (
            _status(lambda: stub.GetAgent(metadata_pb2.GetAgentRequest(name="short")))
            == grpc.StatusCode.NOT_FOUND
        ),
        10,
    )
    code, _ = _code(lambda: stub.GetAgent(metadata_pb2.GetAgentRequest(name="never-registered")))
    assert code == grpc.StatusCode.NOT_FOUND
    back = stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=_record("short", 10, 5), ttl_s=30))
    got = stub.GetAgent(metadata_pb2.GetAgentRequest(name="short")).record
    assert (got.epoch, [r.id for r in got.metadata.regions], got.revision) == (10, [5], back.revision)
    assert lookups() - before >= 10
    channel.close()


def test_get_agent_needs_the_token_and_well_formed_requests():
    with ThreadedServer(MetadataServer("127.0.0.1:0", token=TOKEN)) as srv:
        channel = grpc.insecure_channel(srv.address)
        good = (("authorization", f"Bearer {TOKEN}"),)
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        reply = stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_record("t", 1, 1), ttl_s=30), metadata=good
        )
        for metadata in (
            None,
            (("authorization", "Bearer wrong-token-0123456789"),),
            (("authorization", TOKEN),),
        ):
            code, details = _code(lambda metadata=metadata: _raw_get(channel, "t", metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details, metadata
            # Not even whether the name exists is told without the token.
            code, _ = _code(lambda metadata=metadata: _raw_get(channel, "nobody", metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        _no_lease_in(_raw_get(channel, "t", good), reply.lease_id)
        code, _ = _code(lambda: _raw_get(channel, "nobody", good))
        assert code == grpc.StatusCode.NOT_FOUND

        call = channel.unary_unary(f"/{SERVICE_NAME}/GetAgent")
        for garbage in (b"\xff\xff\xff\xff\x0f", b"\x0a\x05ab", b"\x0a\x02\xff\xfe"):
            code, _ = _code(lambda garbage=garbage: call(garbage, timeout=10))
            assert code == grpc.StatusCode.UNAUTHENTICATED  # the token is checked first
            code, details = _code(lambda garbage=garbage: call(garbage, timeout=10, metadata=good))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details, garbage
        with pytest.raises(kvx.MetadataError, match="token"):
            kvx.Agent("no-token", metadata=srv.address)
        assert stub.GetAgent(metadata_pb2.GetAgentRequest(name="t"), metadata=good).record.epoch == 1
        channel.close()


def _raw_get_many(channel, names, metadata=None) -> bytes:
    """GetAgents' answer as the bytes that crossed the wire."""
    call = channel.unary_unary(f"/{SERVICE_NAME}/GetAgents")
    return call(metadata_pb2.GetAgentsRequest(names=names).SerializeToString(), timeout=10, metadata=metadata)


def _big(name: str, epoch: int) -> metadata_pb2.AgentRecord:
    """A record of about 12 KiB: three full engine_info values."""
    record = _record(name, epoch, 1)
    for key in ("a", "b", "c"):
        record.engine_info[key] = key * 4000
    return record


def test_get_agents_answers_each_name_in_order_as_get_agent_does(service):
    """One call answers several names: each found name's record exactly as GetAgent
    answers it (no lease id), in the order asked, a name no agent has left out; a
    client looks up any number of names in calls of MAX_LOOKUPS_PER_CALL."""
    from kvx.metadata.client import MAX_LOOKUPS_PER_CALL, MetadataClient

    metrics = service.server.metrics.registry

    def calls(method):
        return metrics.get_sample_value("kvx_metadata_request_seconds_count", {"method": method}) or 0

    channel = grpc.insecure_channel(service.address)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    leases = []
    for i in range(70):
        reply = stub.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=_record(f"m{i}", 100 + i, i, i + 1), ttl_s=30)
        )
        leases.append(reply.lease_id)
    names = ["m3", "nobody", "m0", "m69"]
    raw = _raw_get_many(channel, names)
    answer = metadata_pb2.GetAgentsResponse.FromString(raw)
    assert answer.answered == len(names)
    assert [r.name for r in answer.records] == ["m3", "m0", "m69"]
    for record in answer.records:
        alone = metadata_pb2.GetAgentResponse(record=record).SerializeToString()
        assert alone == _raw_get(channel, record.name)  # the very bytes GetAgent sends
        _no_lease_in(alone, *leases)
    assert metadata_pb2.GetAgentsResponse.FromString(_raw_get_many(channel, [])).answered == 0

    client = MetadataClient(service.address)
    before_many, before_one = calls("GetAgents"), calls("GetAgent")
    asked = [f"m{i}" for i in range(70)] + ["nobody", "m5"] + [f"m{i}" for i in range(60)]
    got = client.get_many(asked)
    assert [r.epoch if r is not None else None for r in got] == [
        None if name == "nobody" else 100 + int(name[1:]) for name in asked
    ]
    assert all(r is None or r.lease_id == 0 for r in got)
    # Each name asked once: 71 names, two calls.
    assert calls("GetAgents") - before_many == -(-len(set(asked)) // MAX_LOOKUPS_PER_CALL) == 2
    assert calls("GetAgent") == before_one
    client.close()
    channel.close()


def test_get_agents_is_bounded_and_checked_like_every_call():
    """The attacks: more names than the bound, a name no agent may have, no token,
    garbage bytes. And an answer stops at the page byte bound (always answering one
    name, however large its record), the client asking again for the rest."""
    from kvx.metadata.client import MAX_LOOKUPS_PER_CALL, MetadataClient, MetadataOptions
    from kvx.metadata.service import ServiceLimits

    limits = ServiceLimits(max_page_bytes=30_000)
    with ThreadedServer(MetadataServer("127.0.0.1:0", token=TOKEN, limits=limits)) as srv:
        channel = grpc.insecure_channel(srv.address)
        good = (("authorization", f"Bearer {TOKEN}"),)
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        for i in range(5):
            stub.RegisterAgent(
                metadata_pb2.RegisterAgentRequest(record=_big(f"b{i}", i + 1), ttl_s=30), metadata=good
            )

        too_many = [f"b{i % 5}" for i in range(MAX_LOOKUPS_PER_CALL + 1)]
        code, details = _code(lambda: _raw_get_many(channel, too_many, good))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_LOOKUPS_PER_CALL}" in details
        for bad in ("", "a/b", "x" * 129, "b0\n"):
            code, details = _code(lambda bad=bad: _raw_get_many(channel, ["b0", bad], good))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid agent name" in details, bad
        # A name twice would be answered twice: 64 copies of a large record for one name.
        code, details = _code(lambda: _raw_get_many(channel, ["b0", "b1", "b0"], good))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "twice" in details
        for metadata in (None, (("authorization", "Bearer wrong-token-0123456789"),)):
            code, _ = _code(lambda metadata=metadata: _raw_get_many(channel, ["b0", "nobody"], metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        call = channel.unary_unary(f"/{SERVICE_NAME}/GetAgents")
        for garbage in (b"\xff\xff\xff\xff\x0f", b"\x0a\x05ab"):
            code, details = _code(lambda garbage=garbage: call(garbage, timeout=10, metadata=good))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details, garbage

        # About 12 KiB a record, 30,000 bytes a page: two records, then the rest.
        answer = metadata_pb2.GetAgentsResponse.FromString(
            _raw_get_many(channel, ["b0", "nobody", "b1", "b2", "b3"], good)
        )
        assert (answer.answered, [r.name for r in answer.records]) == (3, ["b0", "b1"])
        tight = ServiceLimits(max_page_bytes=1000)
        srv.server.servicer.limits = tight  # smaller than one record: one name an answer
        answer = metadata_pb2.GetAgentsResponse.FromString(_raw_get_many(channel, ["b4", "b0"], good))
        assert (answer.answered, [r.name for r in answer.records]) == (1, ["b4"])
        srv.server.servicer.limits = limits
        client = MetadataClient(srv.address, MetadataOptions(token=TOKEN))
        got = client.get_many(["b4", "b3", "nobody", "b2", "b1", "b0"])
        assert [r.epoch if r else None for r in got] == [5, 4, None, 3, 2, 1]
        client.close()
        channel.close()


def test_a_service_without_get_agents_is_asked_one_name_at_a_time(monkeypatch):
    """A service older than GetAgents answers UNIMPLEMENTED: the client looks each
    name up with GetAgent for ONE_BY_ONE_S, and gets the same answer; then it tries
    GetAgents again (the service may have been upgraded since)."""
    from concurrent import futures

    from kvx.metadata import client as client_mod
    from kvx.metadata.client import MetadataClient

    monkeypatch.setattr(client_mod, "ONE_BY_ONE_S", 1.0)
    tried_many: list[int] = []

    def get_agents(request: bytes, context) -> bytes:
        tried_many.append(1)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    records = {name: _record(name, 7, 1) for name in ("x0", "x1")}
    asked: list[str] = []

    def get_agent(request: bytes, context) -> bytes:
        name = metadata_pb2.GetAgentRequest.FromString(request).name
        asked.append(name)
        if name not in records:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no agent {name!r}")
        return metadata_pb2.GetAgentResponse(record=records[name]).SerializeToString()

    old = grpc.server(futures.ThreadPoolExecutor(2))
    old.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    "GetAgent": grpc.unary_unary_rpc_method_handler(get_agent),
                    "GetAgents": grpc.unary_unary_rpc_method_handler(get_agents),
                },
            )
        ]
    )
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    try:
        client = MetadataClient(f"127.0.0.1:{port}")
        assert [r.name if r else None for r in client.get_many(["x1", "nobody", "x0"])] == ["x1", None, "x0"]
        assert [r.name if r else None for r in client.get_many(["x0", "x0"])] == ["x0", "x0"]
        assert asked == ["x1", "nobody", "x0", "x0"] and len(tried_many) == 1
        time.sleep(1.1)
        assert [r.name if r else None for r in client.get_many(["x1"])] == ["x1"]
        assert len(tried_many) == 2  # asked again once the minute (here a second) was over
        client.close()
    finally:
        old.stop(None)


def test_an_answer_of_names_not_asked_is_refused():
    """A GetAgents answer is checked against the names asked: a record of a name not
    asked (or out of order), or a count of names answered that is out of range, is an
    error, not a record handed to the caller under another name."""
    from kvx.metadata.client import _match

    def answer(answered, *names):
        return metadata_pb2.GetAgentsResponse(answered=answered, records=[_record(n, 1) for n in names])

    assert [r.name if r else None for r in _match(["a", "b", "c"], answer(3, "a", "c"), "t")] == [
        "a",
        None,
        "c",
    ]
    assert [r.name if r else None for r in _match(["a", "b", "c"], answer(2, "b"), "t")] == [None, "b"]
    for bad in (answer(3, "c", "a"), answer(2, "a", "c"), answer(3, "evil"), answer(0), answer(4, "a")):
        with pytest.raises(kvx.MetadataError, match="GetAgents answered"):
            _match(["a", "b", "c"], bad, "t")


def test_names_a_read_replica_lacks_are_asked_of_the_service():
    """read_many_through: one GetAgents call to the replica, one to the service for the
    names the replica lacks (or for all, when the replica does not answer)."""
    from kvx.metadata.client import MetadataClient, read_many_through

    with (
        ThreadedServer(MetadataServer("127.0.0.1:0")) as replica,
        ThreadedServer(MetadataServer("127.0.0.1:0")) as primary,
    ):
        for address, epochs in ((replica.address, {"r0": 1}), (primary.address, {"r0": 2, "r1": 2})):
            stub = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(address))
            for name, epoch in epochs.items():
                stub.RegisterAgent(
                    metadata_pb2.RegisterAgentRequest(record=_record(name, epoch, 1), ttl_s=30)
                )

        def calls(srv):
            registry = srv.server.metrics.registry
            return (
                registry.get_sample_value("kvx_metadata_request_seconds_count", {"method": "GetAgents"}) or 0
            )

        reader, service = MetadataClient(replica.address, reader=True), MetadataClient(primary.address)
        got = read_many_through(reader, service, ["r0", "r1", "nobody"])
        assert [(r.name, r.epoch) if r else None for r in got] == [("r0", 1), ("r1", 2), None]
        assert (calls(replica), calls(primary)) == (1, 1)
        assert [r.epoch for r in read_many_through(service, service, ["r0", "r1"])] == [2, 2]
        reader.close()
        dead = MetadataClient(f"127.0.0.1:{_closed_port()}", reader=True)
        got = read_many_through(dead, service, ["r0", "nobody"])
        assert [(r.name, r.epoch) if r else None for r in got] == [("r0", 2), None]
        dead.close()
        service.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
