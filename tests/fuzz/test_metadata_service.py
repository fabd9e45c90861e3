"""Property test of the metadata gRPC service (in-process, loopback, memory
store): whatever bytes or field values a request carries, the answer is a
response or a status that says what is wrong (INVALID_ARGUMENT, NOT_FOUND,
FAILED_PRECONDITION, ...), never UNKNOWN or INTERNAL, and the service keeps
serving. Inputs are derandomized (reproducible); KVX_FUZZ_RUNS raises the
number of examples per test.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvx.metadata.service import SERVICE_NAME, MetadataServer, ThreadedServer
from kvx.v1 import agent_pb2, metadata_pb2
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only

EXAMPLES = int(os.environ.get("KVX_FUZZ_RUNS", "0")) or 60
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    # A module-scoped service; inputs filtered by whether they decode.
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)
# Statuses that mean the service failed, not the request.
FAILED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
UNARY = {
    "RegisterAgent": metadata_pb2.RegisterAgentRequest,
    "RegisterAgents": metadata_pb2.RegisterAgentsRequest,
    "UnregisterAgent": metadata_pb2.UnregisterAgentRequest,
    "GetAgent": metadata_pb2.GetAgentRequest,
    "ListAgents": metadata_pb2.ListAgentsRequest,
}


@pytest.fixture(scope="module")
def service():
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        channel = grpc.insecure_channel(srv.address)
        yield srv, channel
        channel.close()


def _raw(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    """Sends ``data`` as the request bytes; the status code of the answer."""
    call = channel.unary_unary(f"/{SERVICE_NAME}/{method}")  # no serializers: bytes as they are
    try:
        call(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _decodes(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:
        return False
    return True


def _still_serves(channel: grpc.Channel) -> None:
    """A plain lookup is answered, with NOT_FOUND: the service did not fall over."""
    assert _raw(channel, "GetAgent", metadata_pb2.GetAgentRequest(name="nobody").SerializeToString()) == (
        grpc.StatusCode.NOT_FOUND
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def _wire(draw, depth: int = 2) -> bytes:
    """Protobuf-shaped bytes: fields 1 to 12 of every wire type, known or not,
    with nested messages, so that most of them decode into some request."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 6))):
        number, kind = draw(st.integers(1, 12)), draw(st.sampled_from([0, 1, 2, 2, 5]))
        out += _varint(number << 3 | kind)
        if kind == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif kind == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif kind == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            body = draw(_wire(depth - 1)) if depth and draw(st.booleans()) else draw(st.binary(max_size=40))
            out += _varint(len(body)) + body
    return bytes(out)


_request_bytes = st.one_of(_wire(), st.binary(max_size=512))


@pytest.mark.parametrize("method", sorted(UNARY))
@FUZZ
@given(data=_request_bytes)
def test_request_bytes_that_decode_get_a_status_that_says_what_is_wrong(service, method, data):
    _, channel = service
    assume(_decodes(UNARY[method], data))
    code = _raw(channel, method, data)
    assert code not in FAILED, f"{method} answered {code} to {data!r}"


@pytest.mark.parametrize("method", sorted(UNARY))
@FUZZ
@given(data=_request_bytes)
def test_request_bytes_that_do_not_decode_get_invalid_argument(service, method, data):
    _, channel = service
    assume(not _decodes(UNARY[method], data))
    code = _raw(channel, method, data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method} answered {code} to {data!r}"


_text = st.text(max_size=80)
_u64 = st.integers(0, 2**64 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_i32 = st.integers(-(2**31), 2**31 - 1)
_labels = st.dictionaries(st.text(max_size=300), st.text(max_size=300), max_size=70)


@st.composite
def _records(draw) -> metadata_pb2.AgentRecord:
    name = draw(st.one_of(st.sampled_from(["agent-a", "agent-b"]), _text))
    epoch = draw(st.one_of(st.just(7), _u64))
    md = agent_pb2.AgentMetadata(
        name=draw(st.one_of(st.just(name), _text)),
        epoch=draw(st.one_of(st.just(epoch), _u64)),
        protocol_version=draw(st.integers(0, 2**32 - 1)),
    )
    for _ in range(draw(st.integers(0, 3))):
        md.regions.add(id=draw(st.integers(0, 2**32 - 1)), size_bytes=draw(_u64))
    return metadata_pb2.AgentRecord(
        name=name,
        epoch=epoch,
        metadata=md,
        labels=draw(_labels),
        role=draw(_i32),
        engine_info=draw(_labels),
        lease_id=draw(_i64),
        started_unix_ms=draw(st.one_of(st.just(int(time.time() * 1000)), _i64)),
    )


@FUZZ
@given(record=_records(), ttl_s=st.one_of(st.just(0), _i32))
def test_register_with_any_field_values(service, record, ttl_s):
    _, channel = service
    request = metadata_pb2.RegisterAgentRequest(record=record, ttl_s=ttl_s)
    code = _raw(channel, "RegisterAgent", request.SerializeToString())
    assert code not in FAILED, f"RegisterAgent answered {code} to {request}"
    for method, message in (
        ("GetAgent", metadata_pb2.GetAgentRequest(name=record.name)),
        ("UnregisterAgent", metadata_pb2.UnregisterAgentRequest(name=record.name, epoch=record.epoch)),
    ):
        code = _raw(channel, method, message.SerializeToString())
        assert code not in FAILED, f"{method} answered {code} to {message}"


@FUZZ
@given(
    role=_i32,
    labels=_labels,
    page_size=_i32,
    page_token=st.one_of(_text, st.sampled_from(["YWdlbnQtYQ==", "YWdlbnQtYQ", "!!", "\udcff"])),
)
def test_list_with_any_field_values(service, role, labels, page_size, page_token):
    _, channel = service
    try:
        request = metadata_pb2.ListAgentsRequest(
            role=role, labels=labels, page_size=page_size, page_token=page_token
        )
        data = request.SerializeToString()
    except (ValueError, UnicodeEncodeError):
        assume(False)  # protobuf refuses to build it: nothing reaches the service
    code = _raw(channel, "ListAgents", data)
    assert code not in FAILED, f"ListAgents answered {code} to {request}"


@FUZZ
@given(page_size=st.integers(2**31, 2**64 - 1))
def test_list_with_a_page_size_past_int32(service, page_size):
    """On the wire page_size is an int32: larger varints are cut to 32 bits and
    answered like any int32 (negative: INVALID_ARGUMENT). The admin REST API's
    page_size, which builds the request itself, is another path."""
    _, channel = service
    data = b"\x18" + _varint(page_size)  # field 3 (page_size), varint
    code = _raw(channel, "ListAgents", data)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), f"page_size {page_size}: {code}"


@FUZZ
@given(
    lease_ids=st.lists(_i64, min_size=1, max_size=4),
    watch=_wire(),
)
def test_keep_alive_and_watch_with_any_values(service, lease_ids, watch):
    _, channel = service
    keep_alive = channel.stream_stream(
        f"/{SERVICE_NAME}/KeepAlive",
        request_serializer=metadata_pb2.KeepAliveRequest.SerializeToString,
        response_deserializer=metadata_pb2.KeepAliveResponse.FromString,
    )
    try:
        for _ in keep_alive(iter(metadata_pb2.KeepAliveRequest(lease_id=i) for i in lease_ids), timeout=10):
            pass
    except grpc.RpcError as exc:
        assert exc.code() not in FAILED, f"KeepAlive({lease_ids}) answered {exc.code()}"
    assume(_decodes(metadata_pb2.WatchAgentsRequest, watch))
    stream = channel.unary_stream(f"/{SERVICE_NAME}/WatchAgents")(watch, timeout=10)
    try:
        first = metadata_pb2.WatchAgentsResponse.FromString(next(stream))
        assert first.type in (first.EVENT_TYPE_PUT, first.EVENT_TYPE_SYNCED)
    except grpc.RpcError as exc:
        assert exc.code() not in FAILED, f"WatchAgents({watch!r}) answered {exc.code()}"
    finally:
        stream.cancel()


@FUZZ
@given(
    lease_id=_i64,
    batch=st.one_of(st.lists(_i64, max_size=8), st.lists(_i64, min_size=1020, max_size=1030)),
)
def test_keep_alive_batches_with_any_ids(service, lease_id, batch):
    """A batch is answered with a ttl per id (none of these ids was granted: 0),
    or refused with INVALID_ARGUMENT exactly when it is too long or holds an id <= 0."""
    _, channel = service
    keep_alive = channel.stream_stream(
        f"/{SERVICE_NAME}/KeepAlive",
        request_serializer=metadata_pb2.KeepAliveRequest.SerializeToString,
        response_deserializer=metadata_pb2.KeepAliveResponse.FromString,
    )
    request = metadata_pb2.KeepAliveRequest(lease_id=lease_id, lease_ids=batch)
    refused = len(batch) + (lease_id != 0) > 1024 or any(i <= 0 for i in batch)
    try:
        answers = list(keep_alive(iter([request]), timeout=10))
    except grpc.RpcError as exc:
        assert refused and exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code()}: {exc.details()}"
    else:
        assert not refused and len(answers) == 1
        assert answers[0].ttl_s == 0 and list(answers[0].ttls_s) == [0] * len(batch)


@given(names=st.lists(_text, max_size=20), extra=st.integers(0, 4100))
def test_watch_of_any_names(service, names, extra):
    """Any list of names is watched, or refused with INVALID_ARGUMENT (bad names,
    more than 4,096); the stream starts with the named snapshot (no names: all)."""
    _, channel = service
    names = names + [f"n{i}" for i in range(extra)]
    request = metadata_pb2.WatchAgentsRequest(names=names)
    stream = channel.unary_stream(
        f"/{SERVICE_NAME}/WatchAgents",
        request_serializer=metadata_pb2.WatchAgentsRequest.SerializeToString,
        response_deserializer=metadata_pb2.WatchAgentsResponse.FromString,
    )(request, timeout=10)
    try:
        first = next(stream)
        assert len(names) <= 4096
        assert first.type == first.EVENT_TYPE_SYNCED or not names or first.record.name in names
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"WatchAgents({names[:5]!r}...) answered {exc.code()}"
        )
    finally:
        stream.cancel()


def test_the_service_still_serves_after_all_that(service):
    _, channel = service
    _still_serves(channel)
