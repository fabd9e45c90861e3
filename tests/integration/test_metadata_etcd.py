"""The metadata service on a real etcd: nothing lost on restart, not-ready
while etcd is down, several replicas serving one cluster."""

import contextlib
import functools
import logging
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvx
from kvx.metadata.client import MetadataClient, NameHeldError, Registration, Watcher
from kvx.metadata.etcd import EtcdStore
from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until
from tests.integration.metadata_util import agent_record

pytestmark = [pytest.mark.slow, native_pass_only]

_record = functools.partial(agent_record, epoch=5, role=metadata_pb2.ROLE_OTHER, started=1)


def _until(predicate, timeout_s=10.0):
    return wait_until(predicate, timeout_s, (kvx.ConnectError, grpc.RpcError))


def _serving(address):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return (
        health.Check(health_pb2.HealthCheckRequest(service="kvx.v1.MetadataService"), timeout=2).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_service_restart_loses_nothing_with_etcd(etcd_server):
    server = ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url)))
    address = server.address
    opts = kvx.MetadataOptions(lease_ttl_s=4)
    with kvx.Agent("prefill-e", metadata=address, role="prefill", metadata_options=opts) as agent:
        agent.register(np.zeros(4096, np.uint8))
        before = MetadataClient(address).get("prefill-e")
        server.stop()
        server = ThreadedServer(MetadataServer(address, EtcdStore(etcd_server.url)))
        try:
            after = MetadataClient(address).get("prefill-e")  # served at once: the record lived in etcd
            assert after is not None and after.epoch == before.epoch and len(after.metadata.regions) == 1
            time.sleep(5)  # past the lease TTL: the agent's keep-alives reached the new service
            renewed = MetadataClient(address).get("prefill-e")
            # Renewed, not registered again: its lease lived in etcd, and a keep-alive stream
            # that failed while the service was away no longer drops the process's leases
            # (which cost every agent a registration, an etcd write, per service restart).
            assert renewed is not None and renewed.revision == before.revision
        finally:
            agent.close()
            server.stop()


def test_etcd_outage_makes_the_service_not_ready_until_it_returns(etcd_server, caplog):
    with ThreadedServer(
        MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, timeout_s=1.0), admin_listen="127.0.0.1:0")
    ) as srv:
        admin = f"http://{srv.server.admin_address}"
        assert _serving(srv.address) and httpx.get(f"{admin}/readyz", timeout=5).status_code == 200
        MetadataClient(srv.address).register(_record("kept"), ttl_s=60)
        etcd_server.stop()
        assert _until(lambda: not _serving(srv.address), 10)
        assert httpx.get(f"{admin}/readyz", timeout=5).status_code == 503
        client = MetadataClient(srv.address, kvx.MetadataOptions(timeout_s=3))
        with caplog.at_level(logging.WARNING, logger="kvx.metadata.service"):
            for call in (lambda: client.get("kept"), lambda: client.register(_record("new"), ttl_s=60)):
                with pytest.raises(kvx.ConnectError, match="metadata store unavailable") as refused:
                    call()
                # etcd's address and its errors are for the service's log, not for any caller.
                assert str(etcd_server.client_port) not in str(refused.value), refused.value
        assert f"127.0.0.1:{etcd_server.client_port}" in caplog.text
        etcd_server.start()
        assert _until(lambda: _serving(srv.address), 15)
        assert httpx.get(f"{admin}/readyz", timeout=5).status_code == 200
        assert MetadataClient(srv.address).get("kept") is not None


def test_service_starts_not_ready_when_etcd_is_down(etcd_server):
    etcd_server.stop()
    with ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, timeout_s=1.0))) as srv:
        assert not _serving(srv.address)
        etcd_server.start()
        assert _until(lambda: _serving(srv.address), 15)


def test_two_replicas_on_one_etcd(etcd_server):
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url))) as a,
        ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url))) as b,
    ):
        events = []
        watcher = Watcher(MetadataClient(b.address), events.append)
        assert watcher.synced.wait(10)
        with (
            kvx.Agent("via-a", metadata=a.address, role="decode") as agent,
            kvx.Agent("reader", metadata=b.address) as reader,
        ):
            record = MetadataClient(b.address).get("via-a")
            assert record is not None and record.epoch == agent.epoch
            assert _until(
                lambda: any(
                    e.record.name == "via-a" and e.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT
                    for e in events
                ),
                5,
            )
            assert reader.connect("via-a").epoch == agent.epoch  # found through the other replica
        assert _until(
            lambda: any(
                e.record.name == "via-a" and e.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_DELETE
                for e in events
            ),
            5,
        )
        watcher.stop()


def test_a_names_watch_through_another_replica(etcd_server):
    """Replica b watches only "named" for a client, while the agents register
    through replica a: b's snapshot and changes hold that name only."""
    prefix = f"/kvx-names-{time.monotonic_ns()}/"
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, prefix=prefix))) as a,
        ThreadedServer(MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, prefix=prefix))) as b,
    ):
        Event = metadata_pb2.WatchAgentsResponse
        with kvx.Agent("named", metadata=a.address) as first, kvx.Agent("other", metadata=a.address):
            events: list = []
            watcher = Watcher(MetadataClient(b.address), events.append, names=["named", "absent"])
            assert watcher.synced.wait(10)
            assert [(e.type, e.record.name, e.record.epoch) for e in events] == [
                (Event.EVENT_TYPE_PUT, "named", first.epoch),
                (Event.EVENT_TYPE_SYNCED, "", 0),
            ]
            del events[:]
            with kvx.Agent("unwatched", metadata=a.address):
                pass
        with kvx.Agent("absent", metadata=a.address) as later:
            assert _until(lambda: len(events) >= 2, 10)
        assert _until(lambda: len(events) >= 3, 10)
        watcher.stop()
        assert sorted((e.type, e.record.name) for e in events) == [
            (Event.EVENT_TYPE_PUT, "absent"),
            (Event.EVENT_TYPE_DELETE, "absent"),
            (Event.EVENT_TYPE_DELETE, "named"),
        ]
        assert all(e.record.lease_id == 0 for e in events) and later.epoch


def _refused_for_a_held_name(client, request):
    """The refusal of ``request`` for a held name; None while the service is not ready."""
    answer = client.register_many([request])[0]
    return answer if isinstance(answer, NameHeldError) else None


def test_a_restarted_agent_gets_its_name_back_though_etcd_restarts_while_it_waits(etcd_server):
    """The agent died with the replica that renewed its lease; its restart asks
    another replica, which does not renew that lease and answers etcd's remaining
    time for it. etcd restarts during the wait and sets that time back to the full
    etcd ttl (as a leader change does): the name is still held when the wait ends,
    and the agent waits once more instead of giving up."""
    backstop_s = 10
    with (
        ThreadedServer(
            MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, backstop_s=backstop_s))
        ) as first,
        contextlib.closing(MetadataClient(first.address)) as registrant,
    ):
        registrant.register(_record("phoenix", epoch=5), ttl_s=2)
    # The replica stopped with the agent: the lease stays in etcd until its backstop runs out.
    with ThreadedServer(
        MetadataServer("127.0.0.1:0", EtcdStore(etcd_server.url, backstop_s=backstop_s, timeout_s=2.0))
    ) as second:
        client = MetadataClient(second.address)
        request = metadata_pb2.RegisterAgentRequest(record=_record("phoenix", epoch=7))
        [held] = client.register_many([request])
        assert isinstance(held, NameHeldError) and held.etcd_term > 0, held
        starter_client = MetadataClient(second.address, kvx.MetadataOptions(lease_ttl_s=2))
        registration = Registration(starter_client, lambda: _record("phoenix", epoch=6))
        errors: list[BaseException] = []

        def start() -> None:
            try:
                registration.start()
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        began = time.monotonic()
        starter = threading.Thread(target=start)
        starter.start()
        try:
            # Restart etcd well before the lease runs out there, so its time is reset.
            time.sleep(max(0.0, held.retry_after_s - 4))
            etcd_server.stop()
            etcd_server.start()
            # etcd's time for the lease starts again, in a new term (which tells the agent so).
            refusals: list[NameHeldError] = []
            assert _until(
                lambda: refusals.append(_refused_for_a_held_name(client, request)) or refusals[-1], 15
            )
            assert refusals[-1].etcd_term > held.etcd_term, (held.etcd_term, refusals[-1].etcd_term)
            starter.join(held.retry_after_s + backstop_s + 30)
            assert not starter.is_alive() and not errors, errors
            assert client.get("phoenix").epoch == 6
            # It waited past etcd's first answer: the reset lease held the name that long.
            assert time.monotonic() - began > held.retry_after_s + 1
        finally:
            registration.stop()
            starter_client.close()
            client.close()
