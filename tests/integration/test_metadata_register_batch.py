"""RegisterAgents: several registrations in one call, each answered on its own,
on the real service over loopback gRPC; and the client's Registrations of one
process sending what waits together."""

from __future__ import annotations

import asyncio
import functools
import threading

import grpc
import pytest

from kvx.errors import MetadataError
from kvx.metadata.client import MetadataClient, MetadataOptions, NameHeldError, Registration, _Registrar
from kvx.metadata.service import MAX_REGISTRATIONS_PER_CALL, MetadataServer, ServiceLimits, ThreadedServer
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record, stub

pytestmark = native_pass_only

_record = functools.partial(agent_record, role=metadata_pb2.ROLE_DECODE)
TOKEN = "batch-token-0123456789"
OK, HELD, INVALID = 0, grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _request(name, lease_id=0, epoch=7, **fields):
    return metadata_pb2.RegisterAgentRequest(record=_record(name, epoch), lease_id=lease_id, **fields)


def _batch(address, requests, metadata=None):
    return stub(address).RegisterAgents(
        metadata_pb2.RegisterAgentsRequest(requests=requests), timeout=10, metadata=metadata
    )


def _calls(srv, method):
    value = srv.server.metrics.registry.get_sample_value(
        "kvx_metadata_request_seconds_count", {"method": method}
    )
    return value or 0.0


def _registrations(srv):
    return srv.server.metrics.registry.get_sample_value("kvx_metadata_registrations_total") or 0


def test_each_registration_of_a_batch_is_answered_on_its_own(service):
    held = stub(service.address).RegisterAgent(_request("held"), timeout=10).lease_id
    bad = _request("bad")
    bad.record.epoch = 0  # refused: an epoch must be set
    answer = _batch(
        service.address,
        [
            _request("new-a"),
            _request("held", epoch=8),  # another registrant, without the lease: refused
            bad,
            _request("held", lease_id=held, epoch=9),  # its holder replaces it
            _request("twice"),
            _request("twice", epoch=10),  # the second of one batch holds no lease either
        ],
    )
    codes = [result.code for result in answer.results]
    assert codes == [OK, HELD, INVALID, OK, OK, HELD], [r.message for r in answer.results]
    refused = answer.results[1]
    assert "held by a live registration" in refused.message and 0 < refused.retry_after_ms <= 10_000
    assert answer.results[5].retry_after_ms > 0
    assert not answer.results[1].HasField("response") and "epoch must be set" in answer.results[2].message
    leases = [answer.results[i].response.lease_id for i in (0, 3, 4)]
    assert all(leases) and len(set(leases) | {held}) == 4 and answer.results[0].response.ttl_s == 10
    client = MetadataClient(service.address)
    assert [client.get(n).epoch for n in ("new-a", "held", "twice")] == [7, 9, 7]
    assert client.get("bad") is None
    assert _registrations(service) == 4  # "held" twice, "new-a", "twice"
    # The client's view: an error per refused registration, the answers in order.
    again = client.register_many([_request("held", epoch=11), _request("new-b")])
    assert isinstance(again[0], NameHeldError) and 0.1 <= again[0].retry_after_s <= 10
    assert isinstance(again[1], metadata_pb2.RegisterAgentResponse) and again[1].lease_id
    client.close()


def test_an_oversized_batch_is_refused_whole(service):
    too_many = [_request(f"n{i}") for i in range(MAX_REGISTRATIONS_PER_CALL + 1)]
    with pytest.raises(grpc.RpcError) as info:
        _batch(service.address, too_many)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_REGISTRATIONS_PER_CALL}" in info.value.details()
    # Past the service's receive limit (a record may be 256 KiB; three are too many).
    big = []
    for i in range(3):
        request = _request(f"big{i}")
        request.record.engine_info["pad"] = "x" * 4000
        for key in range(60):
            request.record.labels[f"k{key}"] = "y" * 4000
        big.append(request)
    with pytest.raises(grpc.RpcError) as info:
        _batch(service.address, big)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert MetadataClient(service.address).list() == []
    # Neither hurt the service: a full batch still goes through.
    full = _batch(service.address, too_many[:-1])
    assert [result.code for result in full.results] == [OK] * MAX_REGISTRATIONS_PER_CALL


def test_an_unauthenticated_batch_registers_nothing():
    with ThreadedServer(MetadataServer("127.0.0.1:0", token=TOKEN)) as srv:
        for metadata in (None, [("authorization", "Bearer wrong-token-0123456789")]):
            with pytest.raises(grpc.RpcError) as info:
                _batch(srv.address, [_request("a"), _request("b")], metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _registrations(srv) == 0
        good = _batch(srv.address, [_request("a")], metadata=[("authorization", f"Bearer {TOKEN}")])
        assert good.results[0].code == OK


def _gated(server):
    """The servicer's registrations held at a gate until the test opens it, so that
    the client's other registrations queue behind the first call."""
    servicer = server.servicer
    register = servicer.register
    gate = threading.Event()

    async def held(request):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return await register(request)

    servicer.register = held
    return gate


def _start_together(srv, names, options):
    """Starts a Registration per name (each with its own client, as each agent has), the
    first alone, the rest once it is in flight and held at the gate. Returns them, their
    starting threads, the errors their start() raised (by name) and their registrar."""
    regs = [Registration(MetadataClient(srv.address, options), lambda n=name: _record(n)) for name in names]
    registrar = regs[0]._registrar
    assert all(reg._registrar is registrar for reg in regs)
    errors: dict[str, BaseException] = {}

    def start(reg, name):
        try:
            reg.start()
        except MetadataError as exc:
            errors[name] = exc

    threads = [
        threading.Thread(target=start, args=(reg, name), daemon=True)
        for reg, name in zip(regs, names, strict=True)
    ]
    threads[0].start()
    assert wait_until(lambda: registrar._sending, 10)
    for thread in threads[1:]:
        thread.start()
    assert wait_until(lambda: len(registrar._queue) == len(names) - 1, 10)
    return regs, threads, errors, registrar


def test_registrations_waiting_together_go_in_one_call():
    server = MetadataServer("127.0.0.1:0")
    gate = _gated(server)
    with ThreadedServer(server) as srv:
        names = [f"tp-{rank}" for rank in range(12)]
        regs, threads, _, _ = _start_together(srv, names, MetadataOptions())
        try:
            gate.set()
            for thread in threads:
                thread.join(15)
            assert all(reg.lease_id for reg in regs)
            assert (_calls(srv, "RegisterAgent"), _calls(srv, "RegisterAgents")) == (1, 1)
            assert len({reg.lease_id for reg in regs}) == 12 and _registrations(srv) == 12
            client = MetadataClient(srv.address)
            assert sorted(record.name for record in client.list()) == sorted(names)
            client.close()
        finally:
            for reg in regs:
                reg.stop()
                reg.client.close()


def test_a_refused_registration_in_a_batch_fails_only_its_own_start():
    server = MetadataServer("127.0.0.1:0")
    gate = _gated(server)
    with ThreadedServer(server) as srv:
        # "taken" is held by someone else's live lease (ttl 300 s).
        gate.set()
        assert stub(srv.address).RegisterAgent(_request("taken", epoch=99, ttl_s=300), timeout=10).lease_id
        gate.clear()
        names = ["first", "second", "taken", "third"]
        regs, threads, errors, _ = _start_together(srv, names, MetadataOptions())
        try:
            gate.set()
            for i in (0, 1, 3):
                threads[i].join(15)
            assert [bool(reg.lease_id) for reg in regs] == [True, True, False, True] and not errors
            assert _calls(srv, "RegisterAgents") == 1
            # Its start() waits for the holder's lease to run out (300 s unless renewed).
            assert threads[2].is_alive() and MetadataClient(srv.address).get("taken").epoch == 99
            regs[2].stop()
            threads[2].join(10)
            assert "held by a live registration" in str(errors["taken"])
        finally:
            for reg in regs:
                reg.stop()
                reg.client.close()


def test_a_service_without_register_agents_gets_one_call_each():
    server = MetadataServer("127.0.0.1:0", limits=ServiceLimits())
    gate = _gated(server)

    async def unimplemented(request, context):  # what a service older than the call answers
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    server.servicer.RegisterAgents = unimplemented
    with ThreadedServer(server) as srv:
        names = [f"old-{rank}" for rank in range(5)]
        regs, threads, _, registrar = _start_together(srv, names, MetadataOptions())
        try:
            gate.set()
            for thread in threads:
                thread.join(15)
            assert all(reg.lease_id for reg in regs) and registrar._batches is False
            assert _calls(srv, "RegisterAgent") == 5 and _registrations(srv) == 5
        finally:
            for reg in regs:
                reg.stop()
                reg.client.close()


def test_registrars_are_shared_by_target_and_options_and_go_with_their_registrations():
    a = MetadataClient("127.0.0.1:1", MetadataOptions())
    b = MetadataClient("127.0.0.1:1", MetadataOptions(read_target="127.0.0.1:2"))
    c = MetadataClient("127.0.0.1:1", MetadataOptions(token="another-token-0123456789"))
    try:
        assert _Registrar.of(a) is _Registrar.of(b)  # where reads go does not matter
        kept = _Registrar.of(a)
        assert _Registrar.of(c) is not kept
        key = ("127.0.0.1:1", MetadataOptions())
        del kept
        assert key not in _Registrar._registry  # nobody holds it: gone
    finally:
        for client in (a, b, c):
            client.close()


def test_a_registration_stopped_while_it_waits_is_not_left_behind():
    server = MetadataServer("127.0.0.1:0")
    gate = _gated(server)
    with ThreadedServer(server) as srv:
        names = ["kept-0", "gone-1", "kept-2"]
        regs, threads, errors, _ = _start_together(srv, names, MetadataOptions())
        try:
            regs[1].stop()  # its registration is queued behind the first call: nothing to unregister yet
            gate.set()
            for thread in threads:
                thread.join(15)
            client = MetadataClient(srv.address)
            # It landed after stop(), and was unregistered then: only the others remain.
            assert wait_until(lambda: sorted(r.name for r in client.list()) == ["kept-0", "kept-2"], 10)
            assert _registrations(srv) == 3 and not errors
            client.close()
        finally:
            for reg in regs:
                reg.stop()
                reg.client.close()


def test_entries_past_the_calls_deadline_are_not_made():
    """A registration made after its caller gave up would hold its name under a lease
    nobody knows: the entries the deadline leaves no time for are not made, and the
    call is answered before its deadline."""
    server = MetadataServer("127.0.0.1:0")
    register = server.servicer.register

    async def slow(request):
        await asyncio.sleep(0.3)
        return await register(request)

    server.servicer.register = slow
    with ThreadedServer(server) as srv:
        answer = stub(srv.address).RegisterAgents(
            metadata_pb2.RegisterAgentsRequest(requests=[_request(f"late-{i}") for i in range(8)]),
            timeout=1.2,
        )
        codes = [result.code for result in answer.results]
        made = codes.count(OK)
        # 0.3 s each while at least 0.5 s of the 1.2 s is left: two or three, not eight;
        # the rest answered in time, as not made.
        assert 1 <= made <= 3 and codes == [OK] * made + [grpc.StatusCode.UNAVAILABLE.value[0]] * (8 - made)
        assert "deadline" in answer.results[-1].message
        assert _registrations(srv) == made
        assert len(MetadataClient(srv.address).list()) == made
