"""The admin REST API of the metadata service, against a real server.

Agents are registered through the real gRPC API; the REST API is driven
with httpx. Every test runs under a deadline (pytest-timeout) and every
network call has its own timeout.
"""

from __future__ import annotations

import gc
import itertools
import logging
import re
import select
import socket
import time

import grpc
import httpx
import pytest

import kvx
from kvx.metadata.service import MetadataServer, ServiceLimits, ThreadedServer
from kvx.metadata.store import MemoryStore, StoreError
from kvx.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import native_pass_only

pytestmark = [pytest.mark.timeout(60), native_pass_only]

TOKEN = "t0ken-admin-7f3a91"
GRPC_TOKEN = "t0ken-grpc-0c55e2"
HTTP_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 10.0
_epochs = itertools.count(0x1000)


@pytest.fixture
def make_server():
    """Starts ThreadedServers (gRPC + admin on loopback, free ports); stops them at teardown."""
    started: list[ThreadedServer] = []

    def make(**kwargs) -> ThreadedServer:
        kwargs.setdefault("admin_listen", "127.0.0.1:0")
        threaded = ThreadedServer(MetadataServer("127.0.0.1:0", **kwargs), start_timeout_s=20)
        started.append(threaded)
        return threaded

    yield make
    for threaded in started:
        threaded.stop()


@pytest.fixture
def server(make_server):
    return make_server(admin_token=TOKEN)


def admin(threaded: ThreadedServer, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.Client(
        base_url=f"http://{threaded.server.admin_address}", headers=headers, timeout=HTTP_TIMEOUT_S
    )


def stub(threaded: ThreadedServer):
    channel = grpc.insecure_channel(threaded.address)
    return channel, metadata_pb2_grpc.MetadataServiceStub(channel)


def register(
    threaded: ThreadedServer,
    name: str,
    role: int = metadata_pb2.ROLE_PREFILL,
    token: str | None = None,
    **labels: str,
) -> int:
    """Registers ``name``; its lease id."""
    epoch = next(_epochs)
    record = metadata_pb2.AgentRecord(
        name=name, epoch=epoch, role=role, started_unix_ms=int(time.time() * 1000)
    )
    record.labels.update(labels)
    record.metadata.name, record.metadata.epoch = name, epoch
    channel, client = stub(threaded)
    auth = (("authorization", f"Bearer {token}"),) if token else None
    with channel:
        return client.RegisterAgent(
            metadata_pb2.RegisterAgentRequest(record=record, ttl_s=60), timeout=RPC_TIMEOUT_S, metadata=auth
        ).lease_id


def register_five(threaded: ThreadedServer) -> None:
    """Three prefill agents (two in zone a) and two decode agents."""
    register(threaded, "p0", metadata_pb2.ROLE_PREFILL, zone="a", model="m1")
    register(threaded, "p1", metadata_pb2.ROLE_PREFILL, zone="a", model="m2")
    register(threaded, "p2", metadata_pb2.ROLE_PREFILL, zone="b", model="m1")
    register(threaded, "d0", metadata_pb2.ROLE_DECODE, zone="a", model="m1")
    register(threaded, "d1", metadata_pb2.ROLE_DECODE, zone="b", model="m1")


def names(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [agent["name"] for agent in response.json()["agents"]]


def test_health_and_readiness(server):
    assert re.fullmatch(r"127\.0\.0\.1:\d+", server.server.admin_address)
    assert not server.server.admin_address.endswith(":0")
    with admin(server) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "store": "memory"}


class _DownStore(MemoryStore):
    """A store that never answers readiness and fails listing while ``down``."""

    down = True

    async def ready(self) -> bool:
        return not self.down

    async def list_page(self, after, limit):
        if self.down:
            raise StoreError("connection refused (test)")
        return await super().list_page(after, limit)


def test_unready_store_gives_503(make_server, caplog):
    threaded = make_server(store=_DownStore(), admin_token=TOKEN)
    with admin(threaded) as http, caplog.at_level(logging.WARNING, logger="kvx.metadata.service"):
        assert http.get("/healthz").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        listed = http.get("/v1/agents")
        assert listed.status_code == 503 and "unavailable" in listed.json()["detail"]
        # The store's own words are for the service's log, not for a caller.
        assert "connection refused (test)" not in listed.json()["detail"]
    assert "connection refused (test)" in caplog.text


def test_list_filters_by_role_and_labels(server):
    register_five(server)
    with admin(server) as http:
        assert sorted(names(http.get("/v1/agents"))) == ["d0", "d1", "p0", "p1", "p2"]
        assert names(http.get("/v1/agents", params={"role": "prefill"})) == ["p0", "p1", "p2"]
        assert names(http.get("/v1/agents", params={"role": "decode"})) == ["d0", "d1"]
        assert names(http.get("/v1/agents", params={"role": "other"})) == []
        assert names(http.get("/v1/agents", params={"label": "zone=a"})) == ["d0", "p0", "p1"]
        both = http.get(
            "/v1/agents", params=[("label", "zone=a"), ("label", "model=m1"), ("role", "prefill")]
        )
        assert names(both) == ["p0"]
        agent = http.get("/v1/agents", params={"role": "decode", "label": "zone=b"}).json()["agents"][0]
    assert agent["name"] == "d1" and agent["role"] == "ROLE_DECODE"
    assert agent["labels"] == {"zone": "b", "model": "m1"}
    assert agent["metadata"]["name"] == "d1" and int(agent["epoch"]) >= 0x1000
    assert "lease_id" not in agent and int(agent["registered_unix_ms"]) > 0


def test_list_pagination_follows_tokens(server):
    register_five(server)
    seen, token, pages = [], "", 0
    with admin(server) as http:
        while True:
            params = {"page_size": 2, **({"page_token": token} if token else {})}
            response = http.get("/v1/agents", params=params)
            page = names(response)
            assert 1 <= len(page) <= 2
            seen += page
            pages += 1
            token = response.json()["next_page_token"]
            if not token:
                break
            assert pages < 10, "pagination does not end"
    assert pages == 3
    assert seen == sorted(["d0", "d1", "p0", "p1", "p2"])


@pytest.mark.parametrize(
    "params, words",
    [
        ({"role": "bogus"}, "role"),
        ({"page_size": "many"}, "page_size"),
        ({"page_size": -1}, "page_size"),
        ({"label": "zone"}, "key=value"),
        ({"label": "=a"}, "key=value"),
        ([("label", "zone=a"), ("label", "zone=b")], "twice"),
        ({"page_token": "%%not-a-token%%"}, "page_token"),
        ({"page_size": 2**31}, "page_size"),
        ({"page_size": 2**64}, "page_size"),
    ],
)
def test_bad_list_parameters_give_400(server, params, words):
    with admin(server) as http:
        response = http.get("/v1/agents", params=params)
    assert response.status_code == 400, response.text
    assert words in response.json()["detail"]


def test_get_one_agent_and_404(server):
    register(server, "p0", metadata_pb2.ROLE_PREFILL, zone="a")
    with admin(server) as http:
        found = http.get("/v1/agents/p0")
        assert found.status_code == 200
        assert found.json()["name"] == "p0" and found.json()["labels"] == {"zone": "a"}
        missing = http.get("/v1/agents/nobody")
        assert missing.status_code == 404 and "nobody" in missing.json()["detail"]


def test_evict_needs_the_admin_token(server):
    register(server, "p0")
    register(server, "p1")
    with admin(server) as http:
        anonymous = http.delete("/v1/agents/p0")
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"] == "Bearer"
        assert http.delete("/v1/agents/p0", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert http.delete("/v1/agents/p0", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        assert http.get("/v1/agents/p0").status_code == 200  # still there
    with admin(server, TOKEN) as http:
        evicted = http.delete("/v1/agents/p0")
        assert evicted.status_code == 200 and evicted.json() == {"evicted": True}
        assert http.get("/v1/agents/p0").status_code == 404
        assert http.delete("/v1/agents/p0").json() == {"evicted": False}
        assert names(http.get("/v1/agents")) == ["p1"]
    channel, client = stub(server)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            client.GetAgent(metadata_pb2.GetAgentRequest(name="p0"), timeout=RPC_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert (
            client.GetAgent(metadata_pb2.GetAgentRequest(name="p1"), timeout=RPC_TIMEOUT_S).record.name
            == "p1"
        )


def test_evict_is_refused_without_a_configured_token(make_server):
    threaded = make_server()  # no admin_token
    register(threaded, "p0")
    for token in (None, "anything"):
        with admin(threaded, token) as http:
            response = http.delete("/v1/agents/p0")
        assert response.status_code == 403, response.text
        assert "admin token" in response.json()["detail"]
    with admin(threaded) as http:
        assert http.get("/v1/agents/p0").status_code == 200  # reads stay open


def test_reads_can_require_the_token(make_server):
    threaded = make_server(admin_token=TOKEN, admin_reads_need_token=True)
    register(threaded, "p0")
    with admin(threaded) as http:
        for path in ("/v1/agents", "/v1/agents/p0", "/metrics"):
            response = http.get(path)
            assert response.status_code == 401, path
            assert response.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/agents", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200
    with admin(threaded, TOKEN) as http:
        assert names(http.get("/v1/agents")) == ["p0"]
        assert http.get("/v1/agents/p0").status_code == 200
        assert http.get("/metrics").status_code == 200
    with admin(threaded) as http:
        spec = http.get("/openapi.json").json()
    assert spec["paths"]["/v1/agents"]["get"]["security"] == [{"HTTPBearer": []}]


def test_metrics_match_what_was_registered(server):
    register_five(server)
    with admin(server) as http:
        response = http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = response.text
        assert 'kvx_metadata_agents{role="prefill"} 3.0' in text.splitlines()
        assert 'kvx_metadata_agents{role="decode"} 2.0' in text.splitlines()
        assert 'kvx_metadata_agents{role="other"} 0.0' in text.splitlines()
        assert "kvx_metadata_registrations_total 5.0" in text.splitlines()
        assert 'kvx_metadata_request_seconds_count{method="RegisterAgent"} 5.0' in text.splitlines()
        assert "kvx_metadata_store_ready 1.0" in text.splitlines()
        assert 'kvx_metadata_watch_streams{slots="agent"} 0.0' in text.splitlines()
        assert 'kvx_metadata_watch_streams{slots="replica"} 0.0' in text.splitlines()
        http.delete("/v1/agents/p0", headers={"Authorization": f"Bearer {TOKEN}"})
        after = http.get("/metrics").text.splitlines()
    assert 'kvx_metadata_agents{role="prefill"} 2.0' in after


def _gc_pauses(lines: list[str]) -> tuple[float, float]:
    """The count and the sum of full collections in a /metrics text."""
    values = {}
    for line in lines:
        for part in ("count", "sum"):
            if line.startswith(f'kvx_metadata_gc_pause_seconds_{part}{{generation="2"}} '):
                values[part] = float(line.split()[-1])
    return values["count"], values["sum"]


def test_metrics_time_the_cycle_collector_while_serving(server):
    """A full collection holds the event loop that answers lookups: /metrics
    shows each, by generation, for as long as the server serves and no longer."""
    callback = server.server.metrics.gc_pauses._callback
    assert callback in gc.callbacks
    with admin(server) as http:
        count, total = _gc_pauses(http.get("/metrics").text.splitlines())
        gc.collect()
        gc.collect()
        after = http.get("/metrics").text.splitlines()
    count_after, total_after = _gc_pauses(after)
    assert count_after >= count + 2 and total_after > total
    assert 'kvx_metadata_gc_pause_seconds_bucket{generation="2",le="+Inf"} ' + str(count_after) in after
    server.stop()
    assert callback not in gc.callbacks  # it goes with the server


def test_openapi_and_docs(server):
    with admin(server) as http:
        spec = http.get("/openapi.json")
        assert spec.status_code == 200
        spec = spec.json()
        docs = http.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert spec["info"]["title"] == "kvx metadata admin" and spec["info"]["version"] == kvx.__version__
    assert {"/healthz", "/readyz", "/v1/agents", "/v1/agents/{name}", "/metrics"} <= set(spec["paths"])
    assert set(spec["paths"]["/v1/agents/{name}"]) == {"get", "delete"}
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["paths"]["/v1/agents/{name}"]["delete"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in spec["paths"]["/v1/agents"]["get"]  # reads are open on this server


def test_admin_port_in_use_is_a_clear_error(server):
    taken = server.server.admin_address
    with pytest.raises(OSError, match="admin API cannot listen"):
        ThreadedServer(
            MetadataServer("127.0.0.1:0", admin_listen=taken, admin_token=TOKEN), start_timeout_s=20
        )


# Regressions from the security review.


def test_reads_need_a_token_when_the_grpc_token_is_set(make_server):
    """Reads show what GetAgent shows: with a gRPC token they are no longer open. The admin
    token and the gRPC token both read; only the admin token evicts."""
    threaded = make_server(admin_token=TOKEN, token=GRPC_TOKEN)
    register(threaded, "p0", token=GRPC_TOKEN)
    with admin(threaded) as http:
        for path in ("/v1/agents", "/v1/agents/p0", "/metrics"):
            assert http.get(path).status_code == 401, path
        assert http.get("/v1/agents", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200
    for token in (TOKEN, GRPC_TOKEN):
        with admin(threaded, token) as http:
            assert names(http.get("/v1/agents")) == ["p0"]
            assert http.get("/v1/agents/p0").status_code == 200
            assert http.get("/metrics").status_code == 200
    with admin(threaded, GRPC_TOKEN) as http:
        assert http.delete("/v1/agents/p0").status_code == 403  # agents do not evict
        assert http.get("/v1/agents/p0").status_code == 200


def test_no_read_api_tells_a_lease_id(server):
    """A leaked lease id kept a killed agent's record alive past its ttl: lease ids are
    the registrant's alone now, in no answer of the admin API or of gRPC reads."""
    lease = register(server, "p0")
    channel, client = stub(server)
    with channel, admin(server) as http:
        listed, one = http.get("/v1/agents"), http.get("/v1/agents/p0")
        for response in (listed, one):
            assert response.status_code == 200
            assert "lease_id" not in response.text and str(lease) not in response.text
        assert (
            client.GetAgent(metadata_pb2.GetAgentRequest(name="p0"), timeout=RPC_TIMEOUT_S).record.lease_id
            == 0
        )
        assert [
            r.lease_id
            for r in client.ListAgents(metadata_pb2.ListAgentsRequest(), timeout=RPC_TIMEOUT_S).records
        ] == [0]
        watch = client.WatchAgents(metadata_pb2.WatchAgentsRequest(), timeout=RPC_TIMEOUT_S)
        first = next(watch)
        watch.cancel()
        assert first.record.name == "p0" and first.record.lease_id == 0


def test_names_the_admin_api_cannot_route_are_refused(server):
    with admin(server, TOKEN) as http:
        for path in ("/v1/agents/p%0A", "/v1/agents/bad%20name"):
            assert http.get(path).status_code == 400, path
            assert http.delete(path).status_code == 400, path


class _CountingStore(MemoryStore):
    """Counts the records the store hands out per call, the largest count at once."""

    largest = 0

    async def list_page(self, after, limit):
        page = await super().list_page(after, limit)
        self.largest = max(self.largest, len(page))
        return page


def test_listing_copies_a_page_not_the_registry(make_server):
    """The review's attack, smaller: GET /v1/agents?page_size=1000 used to copy every record
    in the registry. Now a call copies a chunk at a time, and a page is bounded in records
    and in bytes."""
    store = _CountingStore()
    threaded = make_server(
        store=store, admin_token=TOKEN, limits=ServiceLimits(max_page_size=50, max_page_bytes=64 * 1024)
    )
    for i in range(120):
        register(threaded, f"a{i:03d}", blob="x" * 200)
    with admin(threaded) as http:
        first = http.get("/v1/agents", params={"page_size": 1000})
        assert len(names(first)) == 50 and first.json()["next_page_token"]
        assert 0 < store.largest <= 100, store.largest  # never the whole registry
        assert names(http.get("/v1/agents", params={"page_size": 1000, "label": "blob=none"})) == []
    store.largest = 0
    big = ServiceLimits(max_page_bytes=4096)
    fat = make_server(limits=big)
    for i in range(20):
        register(fat, f"f{i:02d}", **{f"b{j}": "y" * 200 for j in range(5)})
    with admin(fat) as http:
        seen, token = [], ""
        for _ in range(20):
            response = http.get(
                "/v1/agents", params={"page_size": 1000, **({"page_token": token} if token else {})}
            )
            page = names(response)
            assert 1 <= len(page) <= 4, page  # a page stops at the byte bound
            seen += page
            token = response.json()["next_page_token"]
            if not token:
                break
    assert seen == [f"f{i:02d}" for i in range(20)]


def test_a_client_trickling_its_headers_is_cut_off(make_server, monkeypatch):
    """Slowloris against the admin API, which shares its process and file
    descriptors with the gRPC service: uvicorn alone kept a client sending
    its headers a line at a time connected for good. Now the headers are
    due within a deadline (10 s; 1 s here), and health answers meanwhile."""
    import kvx._http

    monkeypatch.setattr(kvx._http, "HEADER_TIMEOUT_S", 1.0)
    threaded = make_server()
    host, port = threaded.server.admin_address.rsplit(":", 1)
    started = time.monotonic()
    with (
        socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT_S) as sock,
        admin(threaded) as client,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvx\r\n")
        closed = False
        while not closed and time.monotonic() - started < 15:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                closed = select_closed(sock)
            except OSError:
                closed = True
            assert client.get("/healthz").status_code == 200
            time.sleep(0.2)
    assert closed and time.monotonic() - started < 10


def select_closed(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    return sock.recv(65536) == b""
