"""GetAgent, the lookup path, against a real service on loopback: the encoded
answers it keeps per record never carry a lease id, never outlive the record
they were made from, and go through the same checks (token, request bytes)
as every other call."""

import functools

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
