"""``kvx prefill`` and ``kvx decode`` with ``--engine vllm``: real engines, real daemons.

A metadata service, a prefill daemon and a decode daemon (each supervising
a vLLM engine with KvxConnector) and ``kvx proxy --metadata`` in front, which
finds the engines through the daemons' records alone. The pair's greedy
answers must equal a single engine's token for token (the prefill engine
asked directly, as in test_vllm_pd.py). Then the decode daemon is drained
with SIGTERM and the prefill daemon loses its engine: both must end, and
leave no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ENGINE_START_S, Proc, descendants, engine_env, free_port, vllm_python
from tests.e2e.test_vllm_pd import ORACLE_PAIR, PROMPTS, complete, token_ids

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 20.0
DRAIN_GRACE_S = 5.0
EXIT_S = 120  # a daemon stops its engine (SIGTERM, then SIGKILL after 30 s) and exits within this


class Daemon(Proc):
    def __init__(self, role: str, md: str, model: Path, tmp: Path, secret: Path, token: Path) -> None:
        self.role = role
        self.name_in_metadata = f"e2e-{role}"
        api, admin, agent = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{api}"
        self.admin = f"http://127.0.0.1:{admin}"
        argv = [
            sys.executable,
            "-m",
            "kvx",
            role,
            "--engine",
            "vllm",
            "--engine-python",
            vllm_python(),
            "--name",
            self.name_in_metadata,
            "--metadata",
            md,
            "--secret-file",
            str(secret),
            "--admin-token-file",
            str(token),
            "--api-port",
            str(api),
            "--admin-port",
            str(admin),
            "--agent-port",
            str(agent),
            "--lease-s",
            str(LEASE_S),
            "--drain-grace-s",
            str(DRAIN_GRACE_S),
            "--drain-timeout-s",
            "60",
            "--ready-timeout-s",
            str(ENGINE_START_S),
            "--",
            "--model",
            str(model),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            "1024",
            "--gpu-memory-utilization",
            "0.15",
            "--seed",
            "0",
        ]
        # The engine imports this checkout's kvx (the daemon passes its environment on).
        env = dict(os.environ, **engine_env(), PYTHONPATH=str(REPO))
        super().__init__(role, argv, env, tmp / f"{role}.log")
        self.not_ready: list[dict[str, Any]] = []  # /readyz answers seen while the engine started

    def poll_ready(self) -> bool:
        """One look at /readyz: True once 200; a 503 is kept, to check what it said."""
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
        try:
            resp = httpx.get(self.admin + "/readyz", timeout=5)
        except httpx.HTTPError:
            return False
        if resp.status_code == 200:
            return True
        if len(self.not_ready) < 1000:
            self.not_ready.append({"status": resp.status_code, **resp.json()})
        return False

    def engine_pid(self) -> int:
        """The vLLM server, the daemon's one child."""
        children = [p for p in descendants(self.popen.pid) if _parent(p) == self.popen.pid]
        assert len(children) == 1, children
        return children[0]

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except Exception:
            raise AssertionError(f"{self.name} did not exit within {timeout_s} s:\n{self.tail()}") from None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie is not)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(pids)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("daemons")
    secret, token = tmp / "secret", tmp / "admin-token"
    secret.write_text("e2e-daemon-secret-0123456789abcdef\n")
    token.write_text("e2e-admin-token-0123456789abcdef\n")
    secret.chmod(0o600)
    token.chmod(0o600)
    md_port = free_port()
    md = f"127.0.0.1:{md_port}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    kvx = [sys.executable, "-m", "kvx"]
    metadata = Proc(
        "metadata",
        [*kvx, "metadata", "--listen", md, "--admin-listen", "off"],
        env,
        tmp / "metadata.log",
    )
    procs: list[Proc] = [metadata]
    try:
        daemons = {role: Daemon(role, md, tiny_model, tmp, secret, token) for role in ("prefill", "decode")}
        procs += daemons.values()
        # Both at once, from the start: each /readyz is watched while its engine starts.
        deadline = time.monotonic() + 2 * ENGINE_START_S  # two engines on a small shared machine
        waiting = dict(daemons)
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError("not ready:\n" + "\n".join(d.tail() for d in waiting.values()))
            waiting = {role: d for role, d in waiting.items() if not d.poll_ready()}
            time.sleep(0.5)
        proxy_port = free_port()
        proxy = Proc(
            "proxy",
            [
                *kvx,
                "proxy",
                "--listen",
                f"127.0.0.1:{proxy_port}",
                "--metadata",
                md,
                "--refresh-s",
                "0.5",
                "--timeout-s",
                "120",
            ],
            env,
            tmp / "proxy.log",
        )
        procs.append(proxy)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        _wait(lambda: _routes_to(proxy_url, daemons["prefill"].url, daemons["decode"].url), 60, proxy)
        yield {**daemons, "proxy": proxy_url, "metadata": md, "secret": secret, "token": token}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _routes_to(proxy_url: str, *urls: str) -> bool:
    try:
        resp = httpx.get(proxy_url + "/healthz", timeout=5)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and all(url in resp.text for url in urls)


def _wait(fn, timeout_s: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        if fn():
            return
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout_s} s:\n{proc.tail()}")


def _status(daemon: Daemon) -> dict[str, Any]:
    resp = httpx.get(daemon.admin + "/v1/status", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _daemon_records(md: str) -> dict[str, Any]:
    from kvx.metadata.client import MetadataClient

    client = MetadataClient(md)
    try:
        return {r.name: r for r in client.list(labels={"kvx_daemon": "1"})}
    finally:
        client.close()


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> dict[int, list[int]]:
    """Greedy outputs of one engine alone: the prefill daemon's engine, asked directly."""
    return {i: token_ids(complete(cluster["prefill"].url, p)) for i, p in enumerate(PROMPTS + ORACLE_PAIR)}


def test_ready_only_once_the_engine_is(cluster: dict[str, Any]) -> None:
    records = _daemon_records(cluster["metadata"])
    for role in ("prefill", "decode"):
        daemon: Daemon = cluster[role]
        # While vLLM started, /readyz said 503 and why.
        assert daemon.not_ready, f"{role}: /readyz never answered before it was ready"
        assert all(seen["status"] == 503 and not seen["ready"] for seen in daemon.not_ready)
        assert any("vllm" in seen["reason"] for seen in daemon.not_ready), daemon.not_ready
        assert httpx.get(daemon.admin + "/readyz", timeout=10).status_code == 200
        assert httpx.get(daemon.admin + "/healthz", timeout=10).status_code == 200
        status = _status(daemon)
        assert status["state"] == "ready" and status["engine"] == "vllm" and status["role"] == role
        assert status["api_url"] == daemon.url and status["admin_url"] == daemon.admin
        # Its record, which the proxy routes by.
        info = records[daemon.name_in_metadata].engine_info
        assert info["api_url"] == daemon.url and info["admin_url"] == daemon.admin
        assert info["draining"] == "0" and info["engine"] == "vllm"
        metrics = httpx.get(daemon.admin + "/metrics", timeout=10).text
        assert "kvx_daemon_ready 1.0" in metrics


def test_the_oracle_can_fail(reference: dict[int, list[int]]) -> None:
    n = len(PROMPTS)
    assert reference[n] != reference[n + 1], "the model ignores the context: token equality proves nothing"


def test_pd_through_the_proxy_equals_single_engine(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    decode: Daemon = cluster["decode"]
    before = _external_tokens(decode)
    got = [token_ids(complete(cluster["proxy"], p)) for p in PROMPTS]
    assert got == [reference[i] for i in range(len(PROMPTS))]
    after = _external_tokens(decode)
    assert after - before == sum(len(p) for p in PROMPTS), "the prompt KV did not come through kvx"


def _external_tokens(daemon: Daemon) -> float:
    """Prompt tokens the engine loaded through the connector, from its /metrics."""
    total = 0.0
    for line in httpx.get(daemon.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_sigterm_drains_decode_and_leaves_no_process(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    """Runs after the P/D test: it takes the decode daemon down."""
    decode: Daemon = cluster["decode"]
    family = descendants(decode.popen.pid)
    assert decode.engine_pid() in family
    # A request under way when SIGTERM comes is answered.
    answer: dict[str, Any] = {}
    request = threading.Thread(
        target=lambda: answer.update(resp=complete(decode.url, PROMPTS[5], max_tokens=64)), daemon=True
    )
    request.start()
    os.kill(decode.popen.pid, signal.SIGTERM)
    saw_draining = False
    deadline = time.monotonic() + DRAIN_GRACE_S
    while time.monotonic() < deadline and decode.popen.poll() is None:
        try:
            resp = httpx.get(decode.admin + "/readyz", timeout=2)
        except httpx.HTTPError:
            break
        if resp.status_code == 503 and "draining" in resp.json()["reason"]:
            saw_draining = True
            break
        time.sleep(0.2)
    assert saw_draining, decode.tail()
    assert decode.wait_exit(EXIT_S) == 0, decode.tail()
    request.join(60)
    assert token_ids(answer["resp"]) == token_ids(complete(cluster["prefill"].url, PROMPTS[5], max_tokens=64))
    assert not _wait_gone(family, 30), f"left behind: {_alive(family)}"
    log = decode.log.read_text(errors="replace")
    assert "drain requested (SIGTERM)" in log and "drained in" in log
    # Unregistered: the proxy has nowhere to send decodes now.
    assert decode.name_in_metadata not in _daemon_records(cluster["metadata"])


def test_prefill_daemon_exits_when_its_engine_dies(cluster: dict[str, Any]) -> None:
    """Runs last: it kills the prefill daemon's vLLM."""
    prefill: Daemon = cluster["prefill"]
    family = descendants(prefill.popen.pid)
    os.kill(prefill.engine_pid(), signal.SIGKILL)
    code = prefill.wait_exit(EXIT_S)
    assert code != 0
    log = prefill.log.read_text(errors="replace")
    assert "vllm exited with code -9" in log, prefill.tail()
    # vLLM's engine core lost its parent: the daemon ended the engine's whole group.
    assert not _wait_gone(family, 30), f"left behind: {_alive(family)}"
