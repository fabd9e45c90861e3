"""``kvx prefill`` and ``kvx decode`` (the synthetic engine) behind ``kvx proxy``.

Real processes on loopback: an in-process metadata service, daemons and the
proxy as ``python -m kvx`` children found through it (every port is 0 and
read back from the daemons' records). Answers are checked against
``expected_answer``: decode derives them from the KV it READ from prefill, so
a wrong byte anywhere changes them. Every child is killed when its test ends,
whatever happened.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvx.agent import Agent
from kvx.daemon.shapes import PRESETS
from kvx.daemon.synthetic import MAX_BODY_BYTES, expected_answer
from kvx.descs import Descs
from kvx.errors import ConnectError, KvxError
from kvx.metadata.client import MetadataClient, MetadataOptions
from kvx.metadata.mirror import MirrorStore
from kvx.metadata.service import MetadataServer, ThreadedServer
from tests import conftest
from tests.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
SHAPE = PRESETS["tiny"]
BLOCK_TOKENS = 16
NUM_BLOCKS = 256  # 4 MiB of tiny KV: quick to start; a prompt of at most 4096 words
START_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0
SECRET = b"daemon-test-secret-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVX_") or k == "KVX_NATIVE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _tail(path: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


class Daemon:
    def __init__(self, name: str, role: str, proc: subprocess.Popen, log: Path) -> None:
        self.name, self.role, self.proc, self.log = name, role, proc, log
        self.api_url = self.admin_url = ""

    def status(self) -> dict[str, Any]:
        return httpx.get(self.admin_url + "/v1/status", timeout=HTTP_TIMEOUT_S).json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.admin_url + "/metrics", timeout=HTTP_TIMEOUT_S).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


def metric(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


class Cluster:
    """A metadata service, daemons and a proxy; ``close`` kills whatever still runs."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.secret = tmp / "secret"
        self.secret.write_bytes(SECRET)
        self.admin_token = tmp / "admin-token"
        self.admin_token.write_text(ADMIN_TOKEN)
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        self.metadata = ThreadedServer(MetadataServer("127.0.0.1:0"))
        self.client = MetadataClient(self.metadata.address)
        self.daemons: dict[str, Daemon] = {}
        self.proxy_url = ""
        self.replica: ThreadedServer | None = None

    def start_replica(self) -> str:
        """A read replica of the metadata service (kvx metadata --store mirror://)."""
        store = MirrorStore(self.metadata.address, MetadataOptions())
        self.replica = ThreadedServer(MetadataServer("127.0.0.1:0", store))
        return self.replica.address

    def get(self, name: str) -> Any:
        """The record of ``name`` (None when there is none).

        An idle client's channel can be closed by the service (GOAWAY "too many
        pings": the client pings every 5 s, more often than a gRPC server allows
        by default), and the first call after that fails: it is asked again.
        """
        for attempt in range(3):
            try:
                return self.client.get(name)
            except ConnectError:
                if attempt == 2:
                    raise
                time.sleep(0.5)
        return None

    def spawn(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(log, "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(out)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvx", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(env),
            cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def start(self, role: str, name: str, *extra: str) -> Daemon:
        args = [role, "--metadata", self.metadata.address, "--secret-file", str(self.secret), "--name", name,
                "--api-port", "0", "--admin-port", "0", "--agent-port", "0",
                "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_TOKENS), *extra]  # fmt: skip
        log = self.tmp / f"{name}.log"
        daemon = Daemon(name, role, self.spawn(args, log), log)
        self.daemons[name] = daemon
        return daemon

    def wait_ready(self, *daemons: Daemon) -> None:
        for d in daemons:

            def ready(d: Daemon = d) -> bool:
                assert d.proc.poll() is None, f"{d.name} exited {d.proc.returncode}:\n{_tail(d.log)}"
                record = self.get(d.name)
                if record is None or "admin_url" not in record.engine_info:
                    return False
                d.api_url, d.admin_url = record.engine_info["api_url"], record.engine_info["admin_url"]
                return httpx.get(d.admin_url + "/readyz", timeout=5).status_code == 200

            assert wait_until(ready, START_TIMEOUT_S, tolerate=(httpx.HTTPError, KvxError)), _tail(d.log)

    def start_proxy(self) -> str:
        port = _free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        log = self.tmp / "proxy.log"
        self.proxy = self.spawn(
            ["proxy", "--metadata", self.metadata.address, "--listen", f"127.0.0.1:{port}",
             "--refresh-s", "0.5", "--cooldown-s", "5"],
            log,
        )  # fmt: skip
        self.wait_proxy_sees()
        return self.proxy_url

    def wait_proxy_sees(self) -> None:
        """Until the proxy routes to exactly the daemons that run and are not draining."""
        want = {
            role: sorted(d.api_url for d in self.daemons.values() if d.role == role and d.proc.poll() is None)
            for role in ("prefill", "decode")
        }

        def sees() -> bool:
            assert self.proxy.poll() is None, _tail(self.tmp / "proxy.log")
            health = httpx.get(self.proxy_url + "/healthz", timeout=5).json()
            return all(sorted(i["url"] for i in health[role]) == urls for role, urls in want.items())

        assert wait_until(sees, START_TIMEOUT_S, tolerate=(httpx.HTTPError,)), _tail(self.tmp / "proxy.log")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for out in self._logs:
            out.close()
        self.client.close()
        if self.replica is not None:
            self.replica.stop()
        self.metadata.stop()


@pytest.fixture
def make_cluster(tmp_path_factory):
    clusters: list[Cluster] = []

    def make() -> Cluster:
        cluster = Cluster(tmp_path_factory.mktemp("cluster"))
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two prefills (p0 takes POST /v1/drain with a token) and two decodes behind a
    proxy; d1 looks its peers up at a read replica of the metadata service."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        replica = c.start_replica()
        daemons = [
            c.start("prefill", "p0", "--admin-token-file", str(c.admin_token)),
            c.start("prefill", "p1"),
            c.start("decode", "d0"),
            c.start("decode", "d1", "--metadata-read", replica),
        ]
        c.wait_ready(*daemons)
        c.start_proxy()
        yield c
    finally:
        c.close()


# -- requests --------------------------------------------------------------------


def words(n: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1 << 20)}" for _ in range(n))


def answer_tokens(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"t(\d+)", text)]


def complete(url: str, prompt: Any, max_tokens: int, stream: bool = False, **extra: Any) -> tuple[int, Any]:
    """(status, the answer's tokens) or (status, the error body)."""
    body = {"model": "x", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        if response.status_code != 200:
            return response.status_code, response.text
        return 200, answer_tokens(response.json()["choices"][0]["text"])
    text, status = [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as response:
        status = response.status_code
        if status != 200:
            return status, response.read().decode(errors="replace")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return 599, event
                text.append(event["choices"][0]["text"])
    return 200, answer_tokens("".join(text))


def expected(prompt: Any, max_tokens: int) -> list[int]:
    return expected_answer(prompt, SHAPE, BLOCK_TOKENS, max_tokens)


def kv_bytes(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS * SHAPE.token_bytes


def prefilled(prefill: Daemon, prompt: str) -> dict[str, Any]:
    """kv_transfer_params of a prefill that holds ``prompt``'s KV for a remote decode."""
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(prefill.api_url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def serves(cluster: Cluster, n: int = 4) -> None:
    """The proxy answers ``n`` requests correctly (on every daemon, for n >= 2)."""
    rng = random.Random(n)
    for _ in range(n):
        prompt = words(rng.randint(1, 100), rng)
        assert complete(cluster.proxy_url, prompt, 4) == (200, expected(prompt, 4))


# -- the tests -------------------------------------------------------------------

# Tests that do not move KV run in the KVX_NATIVE=1 pass only (the suite runs twice in CI).
native_pass_only = pytest.mark.skipif(
    conftest.NATIVE == "0", reason="runs in the KVX_NATIVE=1 pass: it does not touch the byte path"
)


def test_the_proxy_spreads_requests_and_every_answer_is_right(cluster):
    before = {name: d.status()["totals"]["requests"] for name, d in cluster.daemons.items()}
    rng = random.Random(1)
    jobs = [(words(n, rng), rng.randint(1, 24), i % 4 == 0) for i, n in enumerate([1, 600, 15, 16, 17, 33])]
    jobs += [(words(rng.randint(1, 600), rng), rng.randint(1, 24), rng.random() < 0.3) for _ in range(34)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: complete(cluster.proxy_url, *job), jobs))
    for (prompt, max_tokens, stream), answer in zip(jobs, got, strict=True):
        assert answer == (200, expected(prompt, max_tokens)), (len(prompt.split()), stream, answer)
    served = {name: d.status()["totals"]["requests"] - before[name] for name, d in cluster.daemons.items()}
    assert all(served.values()), served
    assert sum(served.values()) == 2 * len(jobs), served  # a prefill and a decode each


def test_a_decode_reading_at_a_replica_finds_its_peers_there(cluster):
    def lookups(srv: ThreadedServer) -> float:
        value = srv.server.metrics.registry.get_sample_value(
            "kvx_metadata_request_seconds_count", {"method": "GetAgent"}
        )
        return value or 0.0

    assert cluster.replica is not None
    d1 = cluster.daemons["d1"]
    rng = random.Random(5)
    for _ in range(40):  # until d1 has served one (the proxy spreads them)
        before = d1.status()["totals"]["requests"]
        prompt = words(20, rng)
        assert complete(cluster.proxy_url, prompt, 4) == (200, expected(prompt, 4))
        if d1.status()["totals"]["requests"] > before:
            break
    else:
        raise AssertionError("the proxy sent d1 nothing in 40 requests")
    # d1's agent resolved its prefill peer at the replica; its record stayed at the service.
    assert lookups(cluster.replica) >= 1
    assert cluster.get("d1") is not None


def test_metrics_count_exactly_the_kv_that_moved(cluster):
    decodes = [d for d in cluster.daemons.values() if d.role == "decode"]
    prefills = [d for d in cluster.daemons.values() if d.role == "prefill"]
    before = [d.metrics() for d in decodes]
    rng = random.Random(2)
    lengths = [1, 16, 17, 250, 600] + [rng.randint(1, 400) for _ in range(7)]
    for i, n in enumerate(lengths):
        prompt = words(n, rng)
        assert complete(cluster.proxy_url, prompt, 3, stream=i % 3 == 0) == (200, expected(prompt, 3))
    after = [d.metrics() for d in decodes]

    def grown(name: str, **labels: str) -> float:
        return sum(
            metric(a, name, **labels) - metric(b, name, **labels) for a, b in zip(after, before, strict=True)
        )

    assert grown("kvx_transfer_bytes_total", op="read", outcome="ok") == sum(map(kv_bytes, lengths))
    assert grown("kvx_transfers_total", op="read", outcome="ok") == len(lengths)
    assert grown("kvx_transfers_total", outcome="failed") == 0
    blocks = sum(-(-n // BLOCK_TOKENS) for n in lengths) * SHAPE.layers * SHAPE.planes
    assert grown("kvx_blocks_verified_total") == blocks
    assert grown("kvx_verify_failures_total") == 0
    # Every done note arrived: prefill holds nothing, and its pool is whole again.
    for p in prefills:
        assert wait_until(lambda p=p: metric(p.metrics(), "kvx_leases_held") == 0, 20), p.status()
        assert p.status()["pool"]["free_blocks"] == NUM_BLOCKS
        assert metric(p.metrics(), "kvx_leases_expired_total") == 0


def test_sigterm_drains_under_load_and_no_request_fails(make_cluster):
    c = make_cluster()
    p0, p1 = c.start("prefill", "p0"), c.start("prefill", "p1", "--drain-timeout-s", str(DRAIN_TIMEOUT_S))
    d0, d1 = c.start("decode", "d0"), c.start("decode", "d1", "--drain-timeout-s", str(DRAIN_TIMEOUT_S))
    c.wait_ready(p0, p1, d0, d1)
    c.start_proxy()
    results: list[tuple[int, bool, Any]] = []
    stop = threading.Event()

    def load(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set() and len(results) < 10_000:
            prompt, stream = words(rng.randint(1, 300), rng), rng.random() < 0.3
            try:
                status, got = complete(c.proxy_url, prompt, 4, stream)
            except httpx.HTTPError as exc:
                status, got = -1, repr(exc)
            results.append((status, got == expected(prompt, 4), got))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        loaders = [pool.submit(load, seed) for seed in range(3)]
        try:
            assert wait_until(lambda: len(results) >= 20, 30), results[-3:]
            served = {d.name: d.status()["totals"]["requests"] for d in (p1, d1)}
            assert all(served.values()), served  # the two to drain had work
            p1.proc.send_signal(signal.SIGTERM)
            d1.proc.send_signal(signal.SIGTERM)
            for d in (p1, d1):
                try:
                    code = d.proc.wait(DRAIN_TIMEOUT_S + 10)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{d.name} did not stop within its drain timeout:\n{_tail(d.log)}")
                assert code == 0, f"{d.name} exited {code}:\n{_tail(d.log)}"
                assert "drained in" in _tail(d.log), _tail(d.log)
            at_exit = len(results)
            # The survivors go on serving everything.
            assert wait_until(lambda: len(results) >= at_exit + 20, 30), results[-3:]
        finally:
            stop.set()
            for loader in loaders:
                loader.result(HTTP_TIMEOUT_S + 10)
    failed = [r for r in results if r[:2] != (200, True)]
    assert not failed, (
        f"{len(failed)} of {len(results)} failed, e.g. {failed[:3]}\n{_tail(c.tmp / 'proxy.log')}"
    )
    assert c.get("p1") is None and c.get("d1") is None
    assert c.get("p0") is not None and c.get("d0") is not None
    c.wait_proxy_sees()
    serves(c)


@native_pass_only
def test_a_prefill_killed_mid_request_fails_it_quickly_and_others_serve(make_cluster):
    c = make_cluster()
    fast, slow = c.start("prefill", "p0"), c.start("prefill", "p1", "--prefill-tokens-per-s", "200")
    decode = c.start("decode", "d0")
    c.wait_ready(fast, slow, decode)
    c.start_proxy()
    prompt = words(2000, random.Random(4))  # 10 s of prefill on the slow one
    pool = concurrent.futures.ThreadPoolExecutor(6)
    try:
        # Round robin: one of the first two requests lands on the slow prefill.
        sent = [pool.submit(complete, c.proxy_url, prompt, 2)]
        assert wait_until(lambda: slow.status()["in_flight"]["requests"] == 1 or sent[-1].done(), 20)
        if slow.status()["in_flight"]["requests"] == 0:
            sent.append(pool.submit(complete, c.proxy_url, prompt, 2))
            assert wait_until(lambda: slow.status()["in_flight"]["requests"] == 1, 20)
        slow.proc.kill()
        killed_at = time.monotonic()
        for future in sent:
            status, got = future.result(30)
            # A success is right only if it was served elsewhere (the proxy does not retry a sent leg).
            assert status in (502, 503, 504) or (status, got) == (200, expected(prompt, 2)), (status, got)
        assert time.monotonic() - killed_at < 30
        assert any(f.result()[0] != 200 for f in sent)  # the request on the killed one failed
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert slow.proc.wait(10) == -signal.SIGKILL
    # Its record stays until its lease runs out; the proxy skips it once it cannot connect.
    serves(c, 6)
    assert fast.status()["leases"]["held"] == 0 or wait_until(lambda: fast.status()["leases"]["held"] == 0)


def _timed(url: str, prompt: str, sent_at: float) -> tuple[float, int, Any]:
    status, got = complete(url, prompt, 2)
    return time.monotonic() - sent_at, status, got


@native_pass_only
def test_prefill_compute_is_one_server_first_come_first_served(make_cluster):
    """--prefill-tokens-per-s is one simulated accelerator: concurrent prompts queue
    (they would all finish after one service time on a server per request), and
    a short prompt sent behind a long one waits for it (shortest-first or shared
    service would finish it first)."""
    c = make_cluster()
    rate = 100.0  # tokens per second: a word is a token
    prefill = c.start("prefill", "p0", "--prefill-tokens-per-s", str(rate))
    c.wait_ready(prefill)
    rng = random.Random(11)
    n, service_s = 5, 30 / rate
    pool = concurrent.futures.ThreadPoolExecutor(n)
    try:
        start = time.monotonic()
        prompts = [words(30, rng) for _ in range(n)]
        futures = [pool.submit(_timed, prefill.api_url, p, start) for p in prompts]
        done = sorted((f.result(60) for f in futures), key=lambda r: r[0])
        assert all(status == 200 for _, status, _ in done), done
        assert sorted(got for _, _, got in done) == sorted(expected(p, 2) for p in prompts)
        times = [t for t, _, _ in done]
        # One server: the i-th completion comes about i service times in.
        assert times[-1] >= (n - 1) * service_s * 0.8, times
        assert all(b - a >= service_s * 0.5 for a, b in zip(times, times[1:], strict=False)), times
        assert times[-1] < n * service_s + 30, times

        long, short = words(150, rng), words(10, rng)  # 1.5 s, then 0.1 s
        start = time.monotonic()
        first = pool.submit(_timed, prefill.api_url, long, start)
        time.sleep(0.5)  # it is computing: the short one arrives behind it
        second = pool.submit(_timed, prefill.api_url, short, start)
        (t_long, s_long, got_long), (t_short, s_short, got_short) = first.result(60), second.result(60)
        assert (s_long, got_long, s_short, got_short) == (200, expected(long, 2), 200, expected(short, 2))
        assert t_short > t_long, (t_long, t_short)
        assert t_short >= (150 + 10) / rate * 0.8, t_short
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


BAD_SETTINGS = [
    ("drain_timeout_s", ["--drain-timeout-s", "-1"], {}, None),
    ("model_shape", ["--model-shape", "gpt-17"], {}, None),
    ("lease_s", [], {"KVX_LEASE_S": "abc"}, None),
    ("no_such_setting", [], {}, "no_such_setting: 3\n"),
    ("secret_file", ["--secret-file", "/nonexistent/secret"], {}, None),
    ("admin_port", ["--admin-port", "PORT_IN_USE"], {}, None),
    ("api_port", ["--api-port", "PORT_IN_USE"], {}, None),
]


@native_pass_only
def test_bad_settings_fail_at_start_and_name_the_setting(make_cluster):
    c = make_cluster()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    started = {}
    try:
        for setting, flags, env, config in BAD_SETTINGS:
            extra = [port if f == "PORT_IN_USE" else f for f in flags]
            if config is not None:
                (c.tmp / "bad.yaml").write_text(config)
                extra += ["--config", str(c.tmp / "bad.yaml")]
            args = ["prefill", "--metadata", c.metadata.address, "--name", "bad", "--secret-file", str(c.secret),
                    "--agent-port", "0", "--admin-port", "0", "--api-port", "0", *extra]  # fmt: skip
            started[setting] = (time.monotonic(), c.spawn(args, c.tmp / f"{setting}.log", env))
        for setting, (t0, proc) in started.items():
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{setting}: still running:\n{_tail(c.tmp / f'{setting}.log')}")
            out = _tail(c.tmp / f"{setting}.log")
            assert code != 0, out
            assert setting in out, out
            # Not a speed test: a bad setting must not wait for anything (10 s alone; seven at once here).
            assert time.monotonic() - t0 < 20, out
    finally:
        busy.close()
    assert c.get("bad") is None  # none of them registered


@native_pass_only
def test_admin_drain_needs_the_token(cluster):
    p0, d0 = cluster.daemons["p0"], cluster.daemons["d0"]
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": ADMIN_TOKEN}):
        response = httpx.post(p0.admin_url + "/v1/drain", headers=headers, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 401, response.text
    response = httpx.post(
        d0.admin_url + "/v1/drain", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 403, response.text  # d0 has no --admin-token-file
    for d in (p0, d0):
        assert httpx.get(d.admin_url + "/readyz", timeout=HTTP_TIMEOUT_S).status_code == 200
        assert d.status()["draining"] is False
        assert cluster.get(d.name).engine_info["draining"] == "0"
    serves(cluster)


def test_forged_transfer_params_harm_nobody(cluster):
    p0, d0 = cluster.daemons["p0"], cluster.daemons["d0"]
    rng = random.Random(6)
    prompt = words(40, rng)  # 3 blocks
    params = prefilled(p0, prompt)
    before = d0.metrics()

    def decode(**forged: Any) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": {**params, **forged}}
        return httpx.post(d0.api_url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)

    for forged in (
        {"remote_block_ids": [NUM_BLOCKS, NUM_BLOCKS + 1, (1 << 32) - 1]},  # past prefill's pool
        {"remote_block_ids": [-1, 0, 1]},
        {"remote_block_ids": list(range(100_000))},
        {"remote_block_ids": "0,1,2"},
        {"remote_engine_id": "../../etc"},
        {"remote_engine_id": 7},
        {"remote_num_tokens": 10**9},
        {"kvx_region": 99},
        {"kvx_lease": "x" * 32},
    ):
        response = decode(**forged)
        assert response.status_code == 400, (forged if len(str(forged)) < 200 else "100k ids", response.text)
    # Nothing was read for them, and the real KV is still held and whole.
    after = d0.metrics()
    assert metric(after, "kvx_transfers_total") == metric(before, "kvx_transfers_total")
    assert p0.status()["leases"]["held"] == 1
    response = decode()
    assert response.status_code == 200, response.text
    assert answer_tokens(response.json()["choices"][0]["text"]) == expected(prompt, 2)
    assert wait_until(lambda: p0.status()["leases"]["held"] == 0)
    serves(cluster)


def test_a_done_note_with_a_foreign_token_frees_nothing(cluster, tmp_path):
    p0 = cluster.daemons["p0"]
    rng = random.Random(7)
    prompts = [words(20, rng), words(20, rng)]
    a, b = (prefilled(p0, prompt) for prompt in prompts)
    assert p0.status()["leases"]["held"] == 2
    agent = Agent("intruder", auth_secret=SECRET, metadata=cluster.metadata.address, backend="tcp")
    try:
        peer = agent.connect("p0")
        # a's request id with b's token, then b's own note: once b is freed, a's has been handled.
        peer.notify(b"done %s %s" % (a["remote_request_id"].encode(), b["kvx_lease"].encode())).wait(10)
        peer.notify(b"done %s %s" % (b["remote_request_id"].encode(), b["kvx_lease"].encode())).wait(10)
        assert wait_until(lambda: p0.status()["leases"]["held"] == 1)
        # Nor can it read past the pool: the client-side check is skipped, p0's agent refuses.
        region = peer.region(a["kvx_region"])
        local = np.zeros(4096, np.uint8)
        mine = agent.register(local)
        sizes, flags, devices = peer._table
        peer._table = (np.full_like(sizes, 1 << 62), flags, devices)

        with pytest.raises(KvxError):
            peer.read(
                Descs.build(mine, [0], [4096]), Descs.build(region.id, [region.size_bytes], [4096])
            ).wait(10)
    finally:
        agent.close()
    # a's KV is still there for its decode.
    body = {"prompt": prompts[0], "max_tokens": 2, "kv_transfer_params": a}
    response = httpx.post(
        cluster.daemons["d1"].api_url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    assert answer_tokens(response.json()["choices"][0]["text"]) == expected(prompts[0], 2)
    assert wait_until(lambda: p0.status()["leases"]["held"] == 0)
    serves(cluster)


def _raw_post(url: str, head_length: int | None, body: bytes | None = None) -> bytes:
    """POST /v1/completions on a raw socket: a declared length (or chunked), then the
    answer, while a second thread keeps sending up to 64 MiB of body."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT_S)
    length = f"Content-Length: {head_length}" if head_length is not None else "Transfer-Encoding: chunked"
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: kvx\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\n{length}\r\n\r\n"
    )
    sent = [0]

    def send() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(head.encode())
            if body is not None:
                sock.sendall(body)
                return
            piece = b" " * 65536
            chunk = b"%x\r\n%s\r\n" % (len(piece), piece) if head_length is None else piece
            while sent[0] < 64 * 2**20:
                sock.sendall(chunk)
                sent[0] += len(piece)

    with concurrent.futures.ThreadPoolExecutor(1) as pool, sock:
        sender = pool.submit(send)
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # the rest of a refused body is not read
            while data := sock.recv(65536):
                answer += data
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sender.result(HTTP_TIMEOUT_S)
    assert sent[0] < 32 * 2**20, f"the daemon read on: {sent[0]} bytes sent"
    return answer


def test_bad_bodies_are_refused_and_bounded(cluster):
    d0, p1 = cluster.daemons["d0"], cluster.daemons["p1"]
    for url in (d0.api_url, p1.api_url):
        for length in (50 * 2**20, None):  # announced, or chunked with no length
            answer = _raw_post(url, length)
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
            assert b"over %d bytes" % MAX_BODY_BYTES in answer, answer[:300]
        for body in (b"not json", b"\x80\xff{", b"[1, 2]", b"[" * 100_000, b'{"prompt": 3}'):
            answer = _raw_post(url, len(body), body)
            assert answer.startswith(b"HTTP/1.1 400 "), (body[:20], answer[:300])
    # A prompt over the pool's capacity: 400 from prefill, straight or through the proxy.
    huge = words(NUM_BLOCKS * BLOCK_TOKENS + 1, random.Random(8))
    for url in (p1.api_url, cluster.proxy_url):
        status, text = complete(url, huge, 1)
        assert status == 400 and "--num-blocks" in text, (status, text)
    for d in cluster.daemons.values():
        assert httpx.get(d.admin_url + "/readyz", timeout=HTTP_TIMEOUT_S).status_code == 200
        assert d.status()["pool"]["free_blocks"] == NUM_BLOCKS or d.role == "prefill"
    serves(cluster)
