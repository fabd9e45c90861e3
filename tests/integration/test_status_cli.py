"""``kvx agents``, ``kvx status`` and ``kvx drain`` as a user runs them, against a
real metadata service and real HTTP servers on loopback.

``Daemon`` below serves the admin API of a kvx daemon (/v1/status, /metrics,
POST /v1/drain) as the daemons' contract writes it; the hostile servers trickle
bytes forever or send 100 MiB, and ``kvx status`` must still finish by its
deadline."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvx.metadata.client import MetadataClient
from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.v1 import agent_pb2, metadata_pb2
from tests import conftest

pytest.importorskip("httpx")

# These commands read HTTP and gRPC, never the byte path: they run in the KVX_NATIVE=1 pass only.
pytestmark = pytest.mark.skipif(
    conftest.NATIVE == "0", reason="kvx status/agents/drain run in the KVX_NATIVE=1 pass: no byte path here"
)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ADMIN_TOKEN = "admin-token-0123456789abcdef"
# Generous: the machine may be loaded; a command that hangs is stopped here.
COMMAND_TIMEOUT_S = 120


def kvx(*args, timeout=COMMAND_TIMEOUT_S):
    return subprocess.run(
        [sys.executable, "-m", "kvx.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def registry(service):
    client = MetadataClient(service.address)
    epochs = iter(range(0x1000, 0x2000))

    def register(name, role=metadata_pb2.ROLE_PREFILL, endpoints=(), **engine_info):
        epoch = next(epochs)
        record = metadata_pb2.AgentRecord(
            name=name, epoch=epoch, role=role, engine_info=engine_info, started_unix_ms=1000
        )
        record.metadata.name, record.metadata.epoch = name, epoch
        for backend, address in endpoints:
            record.metadata.endpoints.add(backend=backend, address=address)
        client.register(record, ttl_s=120)

    yield register
    client.close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    return str(path)


class Daemon:
    """The admin API of one kvx daemon, per the contract: /v1/status, /metrics
    (kvx_transfer_bytes_total growing by ``bytes_per_s``), POST /v1/drain with the
    bearer token; after a drain it reports draining for ``drain_polls`` answers,
    then ``drained`` (or, with ``exit_on_drain``, stops listening)."""

    def __init__(self, name="prefill-0", role="prefill", token=ADMIN_TOKEN, **options):
        self.name, self.role, self.token = name, role, token
        self.state = options.get("state", "ready")
        self.bytes_per_s = options.get("bytes_per_s", 1_000_000)
        self.drain_polls = options.get("drain_polls", 3)
        self.exit_on_drain = options.get("exit_on_drain", False)
        self.status_extra = options.get("status_extra", {})
        self.metrics_body = options.get("metrics_body")
        self.started = time.monotonic()
        self.polls_since_drain = 0
        self.drain_calls = 0
        self.get_authorizations = []  # the Authorization header of each GET (None: none)
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body, content_type="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                daemon.get_authorizations.append(self.headers.get("Authorization"))
                if self.path == "/v1/status":
                    self._send(200, daemon.status())
                elif self.path == "/metrics":
                    self._send(200, daemon.metrics().encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                if self.path != "/v1/drain":
                    self._send(404, {"detail": "Not Found"})
                elif daemon.token is None:
                    self._send(403, {"detail": "drain over HTTP needs --admin-token-file"})
                elif self.headers.get("Authorization") != f"Bearer {daemon.token}":
                    self._send(401, {"detail": "bad or missing admin token"})
                else:
                    daemon.drain_calls += 1
                    daemon.state = "draining"
                    self._send(202, {"draining": True})
                    if daemon.exit_on_drain:
                        threading.Thread(target=daemon.stop, daemon=True).start()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def total_bytes(self):
        return int((time.monotonic() - self.started) * self.bytes_per_s)

    def status(self):
        if self.state == "draining":
            self.polls_since_drain += 1
            if self.polls_since_drain > self.drain_polls:
                self.state = "drained"
        status = {
            "name": self.name,
            "role": self.role,
            "engine": "synthetic",
            "state": self.state,
            "ready": self.state == "ready",
            "draining": self.state in ("draining", "drained"),
            "reason": "" if self.state == "ready" else self.state,
            "uptime_s": max(0.001, time.monotonic() - self.started),
            "version": "0.1",
            "api_url": "http://127.0.0.1:1",
            "admin_url": self.url,
            "metadata": "127.0.0.1:1",
            "agent": {"name": self.name, "endpoint": "127.0.0.1:2", "epoch": 123},
            "peers": [{"name": "decode-0", "backend": "tcp", "backend_reason": "x", "alive": True}],
            "regions": [{"id": 1, "bytes": 1048576, "memory": "host", "remote_access": True}],
            "in_flight": {"requests": 0, "transfers": 0},
            "recent_transfers": [],
            "leases": {"held": 0, "expired_total": 0},
            "totals": {
                "requests": 10,
                "requests_failed": 2,
                "transfers": 10,
                "transfers_failed": 1,
                "bytes": self.total_bytes(),
                "blocks_verified": 160,
            },
        }
        status.update(self.status_extra)
        return status

    def metrics(self):
        if self.metrics_body is not None:
            return self.metrics_body
        return (
            "# HELP kvx_transfer_bytes_total Bytes moved.\n"
            "# TYPE kvx_transfer_bytes_total counter\n"
            f'kvx_transfer_bytes_total{{op="read",backend="tcp",peer_role="decode",outcome="ok"}} '
            f"{float(self.total_bytes())}\n"
            'kvx_transfer_bytes_total{op="read",backend="tcp",peer_role="decode",outcome="failed"} 5e12\n'
        )

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def daemons():
    made = []

    def make(**kwargs):
        daemon = Daemon(**kwargs)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        with contextlib.suppress(OSError):
            daemon.stop()


class Hostile:
    """A server on loopback that answers every connection with ``behaviour``:
    ``trickle`` (headers, then one byte every 0.2 s, for as long as the client
    listens) or ``flood`` (a 100 MiB body with no length, as fast as it goes)."""

    def __init__(self, behaviour, lifetime_s=300.0):
        self.behaviour = behaviour
        self.stopped = threading.Event()
        self.sent_bytes = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.deadline = time.monotonic() + lifetime_s
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            conn.settimeout(5)
            try:
                if self.behaviour == "trickle":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                    while not self.stopped.is_set() and time.monotonic() < self.deadline:
                        conn.sendall(b"X-Slow: a\r\n")
                        self.sent_bytes += 11
                        time.sleep(0.2)
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
                    chunk = b"0" * (1 << 20)
                    for _ in range(100):
                        conn.sendall(chunk)
                        self.sent_bytes += len(chunk)
            except OSError:
                pass

    def stop(self):
        self.stopped.set()
        self.sock.close()


@pytest.fixture
def hostile():
    made = []

    def make(behaviour):
        server = Hostile(behaviour)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


# --- kvx agents --------------------------------------------------------------------------------


def test_agents_lists_every_record_with_its_fields(service, registry):
    registry(
        "prefill-0",
        endpoints=[(agent_pb2.BACKEND_TCP, "10.0.0.1:7100")],
        engine="synthetic",
        api_url="http://10.0.0.1:8100",
        draining="0",
    )
    registry("decode-0", role=metadata_pb2.ROLE_DECODE, engine="vllm", draining="1")
    registry("tool", role=metadata_pb2.ROLE_OTHER)
    result = kvx("agents", "--metadata", service.address)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "EPOCH", "ENDPOINTS", "ENGINE", "API_URL", "DRAINING", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["prefill-0"][:7] == [
        "prefill-0",
        "prefill",
        "0x1000",
        "tcp=10.0.0.1:7100",
        "synthetic",
        "http://10.0.0.1:8100",
        "no",
    ]
    assert rows["prefill-0"][7].endswith("s")
    assert rows["decode-0"][1:7] == ["decode", "0x1001", "-", "vllm", "-", "yes"]
    assert [line.split()[0] for line in lines[1:]] == ["prefill-0", "decode-0", "tool"]

    only = kvx("agents", "--metadata", service.address, "--role", "decode", "--json")
    assert only.returncode == 0, only.stderr
    data = json.loads(only.stdout)
    assert [a["name"] for a in data["agents"]] == ["decode-0"]
    agent = data["agents"][0]
    assert agent["role"] == "decode" and agent["epoch"] == 0x1001 and agent["draining"] is True
    assert agent["engine"] == "vllm" and agent["registered_unix_ms"] > 0 and agent["age_s"] >= 0


def test_agents_strips_terminal_escapes_from_records(service, registry):
    """A registrant controls engine_info: its escape sequences must not reach the terminal."""
    registry("evil", engine="\x1b[2J\x1b]0;pwned\x07synthetic", api_url="http://x\x1b[31m")
    result = kvx("agents", "--metadata", service.address)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "?[2J?]0;pwned?synthetic" in result.stdout


def test_agents_says_when_the_metadata_service_is_unreachable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = kvx("agents", "--metadata", f"127.0.0.1:{port}", timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 1
    assert "kvx agents: ConnectError: metadata service at 127.0.0.1:" in result.stderr


# --- kvx status --------------------------------------------------------------------------------


def test_status_shows_each_daemon_its_peers_rate_and_failures(service, registry, daemons):
    prefill = daemons(name="prefill-0", role="prefill", bytes_per_s=2_000_000)
    decode = daemons(name="decode-0", role="decode", bytes_per_s=0)
    registry("prefill-0", engine="synthetic", admin_url=prefill.url)
    registry("decode-0", role=metadata_pb2.ROLE_DECODE, engine="synthetic", admin_url=decode.url + "/")
    registry("plain-agent")  # no admin_url: not a daemon
    result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["summary"] == {"instances": 2, "ready": 2}
    by_name = {i["name"]: i for i in report["instances"]}
    assert set(by_name) == {"prefill-0", "decode-0"}
    p = by_name["prefill-0"]
    assert p["health"] == "ready" and p["role"] == "prefill" and p["admin_url"] == prefill.url
    assert p["peers"] == [{"name": "decode-0", "backend": "tcp", "alive": True}]
    assert p["totals"]["transfers_failed"] == 1 and p["totals"]["requests_failed"] == 2
    # Two samples of kvx_transfer_bytes_total (outcome ok only) half a second apart.
    assert p["transfer_rate_source"] == "metrics"
    assert 0.5e6 < p["transfer_rate_bytes_per_s"] < 8e6
    assert by_name["decode-0"]["transfer_rate_bytes_per_s"] == 0.0

    table = kvx("status", "--metadata", service.address, "--interval-s", "0")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "2 instances, 2 ready" in lines[0]
    header = lines[1].split()
    assert header == [
        "ROLE",
        "NAME",
        "HEALTH",
        "ENGINE",
        "PEERS",
        "RATE",
        "XFER_FAIL",
        "REQ_FAIL",
        "ADMIN_URL",
    ]
    row = lines[2].split()
    assert row[:5] == ["prefill", "prefill-0", "ready", "synthetic", "decode-0=tcp"]
    assert row[-4:] == ["avg", "1", "2", prefill.url]  # --interval-s 0: the average since start


def test_status_exit_code_is_1_unless_every_daemon_is_ready(service, registry, daemons):
    ready = daemons(name="prefill-0")
    draining = daemons(name="decode-0", role="decode", state="draining", drain_polls=10**6)
    registry("prefill-0", admin_url=ready.url)
    registry("decode-0", role=metadata_pb2.ROLE_DECODE, admin_url=draining.url)
    result = kvx("status", "--metadata", service.address, "--interval-s", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 instances, 1 ready" in result.stdout
    assert "decode-0: draining" in result.stdout

    empty_service = ThreadedServer(MetadataServer("127.0.0.1:0"))
    try:
        empty = kvx("status", "--metadata", empty_service.address)
    finally:
        empty_service.stop()
    assert empty.returncode == 1 and "no daemons registered" in empty.stdout


def test_status_finishes_by_its_deadline_against_hostile_daemons(service, registry, daemons, hostile):
    """Admin URLs are untrusted: one trickles header bytes forever, one floods 100 MiB,
    one is a closed port. status still answers by its deadline, shows each unreachable
    with why, and reports the good daemon."""
    good = daemons(name="prefill-0")
    trickle, flood = hostile("trickle"), hostile("flood")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registry("prefill-0", admin_url=good.url)
    registry("decode-trickle", role=metadata_pb2.ROLE_DECODE, admin_url=trickle.url)
    registry("decode-flood", role=metadata_pb2.ROLE_DECODE, admin_url=flood.url)
    registry("decode-closed", role=metadata_pb2.ROLE_DECODE, admin_url=closed)
    start = time.monotonic()
    result = kvx("status", "--metadata", service.address, "--json", "--timeout-s", "4", "--interval-s", "0.5")
    elapsed_s = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    # The trickle lives for minutes: finishing at all proves the deadline; the bound is loose
    # (interpreter start-up on a loaded machine) but far below the trickle's lifetime.
    assert elapsed_s < 60, elapsed_s
    assert trickle.sent_bytes > 0 and flood.sent_bytes > 0
    by_name = {i["name"]: i for i in json.loads(result.stdout)["instances"]}
    assert by_name["prefill-0"]["health"] == "ready"
    assert by_name["decode-trickle"]["health"] == "unreachable"
    assert by_name["decode-trickle"]["error"] == "no complete answer before the deadline"
    assert by_name["decode-flood"]["health"] == "unreachable"
    assert "more than 4194304 bytes" in by_name["decode-flood"]["error"]
    assert by_name["decode-closed"]["health"] == "unreachable"
    assert "ConnectError" in by_name["decode-closed"]["error"]


def test_status_sends_the_admin_token_only_when_given(service, registry, daemons, token_file):
    daemon = daemons()
    registry("prefill-0", admin_url=daemon.url)
    assert kvx("status", "--metadata", service.address, "--interval-s", "0.2").returncode == 0
    assert len(daemon.get_authorizations) == 3 and set(daemon.get_authorizations) == {None}
    daemon.get_authorizations.clear()
    result = kvx("status", "--metadata", service.address, "--admin-token-file", token_file)
    assert result.returncode == 0, result.stderr
    assert set(daemon.get_authorizations) == {f"Bearer {ADMIN_TOKEN}"}


def test_status_does_not_believe_a_junk_metrics_page(service, registry, daemons):
    """4 MiB of samples (thousands of series, or one endless line): no rate from them,
    the average of /v1/status instead."""
    line = 'kvx_transfer_bytes_total{op="read",outcome="ok"} 1e9\n'
    many = daemons(name="prefill-0", metrics_body=line * (4_000_000 // len(line)))
    endless = daemons(
        name="decode-0", role="decode", metrics_body="kvx_transfer_bytes_total{" + "a" * 4_000_000
    )
    registry("prefill-0", admin_url=many.url)
    registry("decode-0", role=metadata_pb2.ROLE_DECODE, admin_url=endless.url)
    result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    for instance in json.loads(result.stdout)["instances"]:
        assert instance["transfer_rate_source"] == "average", instance
        assert instance["transfer_rate_bytes_per_s"] < 1e8


def test_transfer_bytes_reads_the_counter_as_prometheus_client_writes_it():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from kvx._status import transfer_bytes

    registry = CollectorRegistry()
    counter = Counter("kvx_transfer_bytes", "b", ["op", "backend", "peer_role", "outcome"], registry=registry)
    counter.labels("read", "tcp", "decode", "ok").inc(100)
    counter.labels("write", "shm", 'a"}b', "ok").inc(23)
    counter.labels("read", "tcp", "decode", "failed").inc(7)
    assert transfer_bytes(generate_latest(registry)) == 123.0
    assert transfer_bytes(b"kvx_transfer_bytes_total 5 1700000000000\n") == 5.0
    for junk in (b"", b"kvx_transfer_bytes_total NaN\n", b"kvx_transfer_bytes_total -1\n", b"x" * 1000):
        assert transfer_bytes(junk) is None, junk


def test_status_refuses_admin_urls_that_are_not_http(service, registry, daemons, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"state": "ready", "ready": true, "name": "root:x:0:0"}')
    good = daemons(name="prefill-0")
    registry("prefill-0", admin_url=good.url)
    registry("decode-file", role=metadata_pb2.ROLE_DECODE, admin_url=f"file://{secret}")
    registry("decode-gopher", role=metadata_pb2.ROLE_DECODE, admin_url="gopher://127.0.0.1:70/")
    registry("decode-creds", role=metadata_pb2.ROLE_DECODE, admin_url="http://user:pw@127.0.0.1:1")
    result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0")
    assert result.returncode == 1
    by_name = {i["name"]: i for i in json.loads(result.stdout)["instances"]}
    assert by_name["prefill-0"]["health"] == "ready"
    assert {i["role"] for i in by_name.values()} == {"prefill", "decode"}
    for name, why in [
        ("decode-file", "scheme 'file': only http:// and https:// are followed"),
        ("decode-gopher", "scheme 'gopher'"),
        ("decode-creds", "user name or password"),
    ]:
        assert by_name[name]["health"] == "refused", by_name[name]
        assert why in by_name[name]["error"]
    assert "root:x" not in result.stdout

    table = kvx("status", "--metadata", service.address, "--interval-s", "0")
    assert "decode-file" in table.stdout and "refused" in table.stdout


def test_status_strips_terminal_escapes_from_daemon_answers(service, registry, daemons):
    evil = daemons(
        name="prefill-0",
        state="draining",
        drain_polls=10**6,
        status_extra={
            "engine": "\x1b]0;owned\x07synthetic",
            "reason": "\x1b[2Jwiped",
            "name": "decode-9",
            "role": "decode",
            "peers": [{"name": "d\x1b[31m", "backend": "tcp\r\n", "alive": True}],
        },
    )
    registry("prefill-0", admin_url=evil.url)
    result = kvx("status", "--metadata", service.address, "--interval-s", "0")
    assert result.returncode == 1
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\r" not in result.stdout
    assert "?[2Jwiped" in result.stdout
    # The record's name and role stand, not what the daemon claims.
    assert result.stdout.splitlines()[2].split()[:2] == ["prefill", "prefill-0"]


def test_status_shows_a_daemon_with_a_malformed_status_as_unreachable(service, registry, daemons):
    bad = daemons(name="prefill-0", status_extra={"state": "on fire"})
    nested = daemons(name="decode-0", role="decode")
    nested.status = lambda: json.loads("[" * 50 + "]" * 50)  # valid JSON, not an object
    registry("prefill-0", admin_url=bad.url)
    registry("decode-0", role=metadata_pb2.ROLE_DECODE, admin_url=nested.url)
    result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0")
    assert result.returncode == 1
    by_name = {i["name"]: i for i in json.loads(result.stdout)["instances"]}
    assert by_name["prefill-0"]["health"] == "unreachable"
    assert "state 'on fire' is not one of" in by_name["prefill-0"]["error"]
    assert "not a JSON object" in by_name["decode-0"]["error"]


# --- kvx drain ---------------------------------------------------------------------------------


def test_drain_with_wait_returns_once_the_daemon_is_drained(daemons, token_file):
    daemon = daemons(drain_polls=3)
    result = kvx("drain", "--admin", daemon.url, "--token-file", token_file, "--wait", "--timeout-s", "30")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{daemon.url}: drained"
    assert daemon.drain_calls == 1 and daemon.polls_since_drain >= 4

    other = daemons(name="decode-0")
    result = kvx("drain", "--admin", other.url, "--token-file", token_file)
    assert result.returncode == 0 and result.stdout.strip() == f"{other.url}: draining"
    assert other.state == "draining"


def test_drain_counts_a_daemon_that_exited_as_done(daemons, token_file):
    daemon = daemons(exit_on_drain=True, drain_polls=10**6)
    result = kvx("drain", "--admin", daemon.url, "--token-file", token_file, "--wait", "--timeout-s", "30")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{daemon.url}: exited"


def test_drain_with_a_wrong_token_fails_clearly(daemons, tmp_path):
    daemon = daemons()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-admin-token-at-all")
    result = kvx("drain", "--admin", daemon.url, "--token-file", str(wrong), "--wait")
    assert result.returncode == 1
    assert "refused the admin token (HTTP 401)" in result.stderr
    assert "--admin-token-file" in result.stderr
    assert daemon.state == "ready" and daemon.drain_calls == 0

    tokenless = daemons(token=None)
    result = kvx("drain", "--admin", tokenless.url, "--token-file", str(wrong))
    assert result.returncode == 1 and "HTTP 403" in result.stderr and "SIGTERM" in result.stderr


def test_drain_times_out_with_a_message(daemons, token_file):
    daemon = daemons(drain_polls=10**6)
    result = kvx("drain", "--admin", daemon.url, "--token-file", token_file, "--wait", "--timeout-s", "2")
    assert result.returncode == 1
    assert "is still draining after 2 s" in result.stderr


def test_drain_against_a_trickling_server_stops_at_its_timeout(hostile, token_file):
    trickle = hostile("trickle")
    start = time.monotonic()
    result = kvx("drain", "--admin", trickle.url, "--token-file", token_file, "--timeout-s", "3")
    assert time.monotonic() - start < 60
    assert result.returncode == 1 and "no answer within 3 s" in result.stderr


def test_drain_refuses_urls_that_are_not_http(token_file, tmp_path):
    for url, why in [
        (f"file://{tmp_path}", "only http:// and https:// are followed"),
        ("127.0.0.1:9100", "only http:// and https://"),
        ("http://127.0.0.1:9100/?x=1", "query or fragment"),
    ]:
        result = kvx("drain", "--admin", url, "--token-file", token_file)
        assert result.returncode == 1 and why in result.stderr, result.stderr


@pytest.mark.slow
def test_status_and_drain_with_real_daemons(service, tmp_path, token_file):
    """kvx prefill and kvx decode (synthetic engine) as processes: status sees both
    ready and decode's peer, drain --wait returns once the daemon is gone, exit 0."""
    import httpx

    secret = tmp_path / "secret"
    secret.write_text("cluster-secret-0123456789abcdef\n")
    procs = {}
    try:
        for role in ("prefill", "decode"):
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "kvx", role, "--metadata", service.address, "--secret-file", str(secret),
                 "--name", f"{role}-real", "--api-port", "0", "--admin-port", "0", "--agent-port", "0",
                 "--admin-token-file", token_file, "--drain-grace-s", "0.5"],
                env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0")
            report = json.loads(result.stdout)
            if result.returncode == 0 and report["summary"] == {"instances": 2, "ready": 2}:
                break
            assert time.monotonic() < deadline, result.stdout + result.stderr
            time.sleep(0.5)
        by_name = {i["name"]: i for i in report["instances"]}
        status = {n: httpx.get(i["admin_url"] + "/v1/status", timeout=10).json() for n, i in by_name.items()}
        body = {"prompt": "the quick brown fox jumps over the lazy dog " * 5, "max_tokens": 3}
        first = httpx.post(
            status["prefill-real"]["api_url"] + "/v1/completions",
            json={**body, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=30,
        ).json()
        second = httpx.post(
            status["decode-real"]["api_url"] + "/v1/completions",
            json={**body, "kv_transfer_params": first["kv_transfer_params"]},
            timeout=30,
        )
        assert second.status_code == 200, second.text
        result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0")
        decode = {i["name"]: i for i in json.loads(result.stdout)["instances"]}["decode-real"]
        assert [p["name"] for p in decode["peers"]] == ["prefill-real"] and decode["totals"]["transfers"] == 1

        admin = by_name["prefill-real"]["admin_url"]
        result = kvx("drain", "--admin", admin, "--token-file", token_file, "--wait", "--timeout-s", "60")
        assert result.returncode == 0, result.stdout + result.stderr
        assert procs["prefill"].wait(30) == 0
        result = kvx("status", "--metadata", service.address, "--json", "--interval-s", "0")
        assert [i["name"] for i in json.loads(result.stdout)["instances"]] == ["decode-real"]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
