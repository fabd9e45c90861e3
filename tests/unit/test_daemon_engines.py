"""The command lines the daemons give vLLM and SGLang, and how they watch them.

The SGLang path runs no real SGLang here (its environment is costly to build);
these tests hold its command line to what kvx's SGLang backend reads.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvx.daemon import engines
from kvx.daemon.engines import EngineProcess, engine_command
from kvx.daemon.settings import DaemonSettings, load
from kvx.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def settings(
    tmp_path: Path, engine: str, role: str = "prefill", args: list[str] | None = None
) -> DaemonSettings:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    flags = {
        "engine": engine,
        "name": f"{role}-0",
        "metadata": "127.0.0.1:50051",
        "secret_file": str(secret),
        "host": "0.0.0.0",
        "advertise_host": "10.0.0.7",
        "api_port": 8123,
        "backend": "tcp",
        "engine_python": "/opt/engine/bin/python",
    }
    return load(role, flags, engine_args=args or ["--model-path", "m"])


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_gets_what_the_kvx_backend_needs(tmp_path: Path, role: str) -> None:
    s = settings(tmp_path, "sglang", role)
    argv, env = engine_command(s)
    assert argv[:3] == ["/opt/engine/bin/python", "-m", "sglang.launch_server"]
    assert argv[3:5] == ["--model-path", "m"]  # the arguments after --, first
    assert _value(argv, "--disaggregation-mode") == role
    assert _value(argv, "--disaggregation-transfer-backend") == "kvx"
    assert (_value(argv, "--host"), _value(argv, "--port")) == ("0.0.0.0", "8123")
    assert "--enable-metrics" in argv  # the drain counts its requests from /metrics
    # The agent binds and advertises the advertised host, with the cluster secret.
    assert env == {"KVX_HOST": "10.0.0.7", "KVX_AUTH_SECRET_FILE": s.secret_file, "KVX_BACKEND": "tcp"}
    # ...which are the variables kvx's SGLang backend reads.
    source = (REPO / "kvx" / "connectors" / "sglang" / "conn.py").read_text()
    read = set(re.findall(r'os\.environ\.get\("(KVX_[A-Z_]+)"', source))
    assert set(env) <= read, (set(env) - read, read)


def test_vllm_gets_the_connector_for_its_role(tmp_path: Path) -> None:
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        s = settings(tmp_path, "vllm", role, ["--model", "m"])
        argv, env = engine_command(s)
        assert argv[:3] == ["/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert env == {}
        config = json.loads(_value(argv, "--kv-transfer-config"))
        assert config["kv_role"] == kv_role and config["engine_id"] == f"{role}-0"
        extra = config["kv_connector_extra_config"]
        assert extra["metadata"] == "127.0.0.1:50051" and extra["auth_secret_file"] == s.secret_file
        assert extra["host"] == "10.0.0.7" and extra["backend"] == "tcp"
        assert "metadata_read" not in extra


def test_a_read_replica_goes_to_the_vllm_connector_and_is_refused_for_sglang(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    flags = {"engine": "vllm", "metadata": "meta:50051", "metadata_read": "meta-read:50051"}
    s = load("decode", {**flags, "secret_file": str(secret)}, engine_args=["--model", "m"])
    argv, _ = engine_command(s)
    extra = json.loads(_value(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert (extra["metadata"], extra["metadata_read"]) == ("meta:50051", "meta-read:50051")
    for bad, words in (
        ({**flags, "metadata_read": "meta-read"}, "HOST:PORT"),
        ({**flags, "engine": "sglang"}, "bootstrap server"),
    ):
        with pytest.raises(ConfigError, match=words):
            load("decode", {**bad, "secret_file": str(secret)}, engine_args=["--model-path", "m"])


@pytest.mark.parametrize(
    ("engine", "arg"),
    [
        ("vllm", "--port=9000"),
        ("vllm", "--kv-transfer-config"),
        ("vllm", "--kv_transfer_config"),  # vLLM reads it as --kv-transfer-config
        ("sglang", "--disaggregation-mode"),
        ("sglang", "--disaggregation_transfer_backend=mooncake"),
    ],
)
def test_flags_the_daemon_sets_are_refused_after_dashdash(tmp_path: Path, engine: str, arg: str) -> None:
    with pytest.raises(ConfigError, match="the daemon sets it"):
        engine_command(settings(tmp_path, engine, args=["--model", "m", arg, "x"]))


SGLANG_METRICS = b"""\
# HELP sglang:num_running_reqs The number of running requests.
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 2.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 1.0
sglang:num_prefill_inflight_queue_reqs{model_name="m"} 3.0
sglang:num_prefill_bootstrap_queue_reqs 4.0
sglang:num_used_tokens{model_name="m"} 999.0
"""


@pytest.fixture
def engine_http() -> Iterator[tuple[str, list[str]]]:
    """A stand-in engine on loopback: /health and SGLang-style /metrics; the paths asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            body = SGLANG_METRICS if self.path == "/metrics" else b"{}"
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def _watcher(tmp_path: Path, api_url: str) -> EngineProcess:
    """An EngineProcess with no child: only its HTTP side, against the stand-in."""
    s = settings(tmp_path, "sglang")
    s.engine_python = sys.executable
    s.engine_args = []
    proc = EngineProcess.__new__(EngineProcess)
    proc.s, proc.api_url = s, api_url
    return proc


def test_health_and_load_are_asked_directly_whatever_the_proxy_settings(
    tmp_path: Path, engine_http: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy in the environment (common in clusters) must not stand between the
    daemon and its own engine: through a dead proxy the engine would never be ready."""
    url, asked = engine_http
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # discard port: nothing answers
    proc = _watcher(tmp_path, url)
    assert proc.answers()
    # Running, queued and SGLang's disaggregation queues (with or without labels); not other gauges.
    assert proc.in_flight() == 2 + 1 + 3 + 4
    assert asked == ["/health", "/metrics"]


def test_in_flight_is_zero_when_the_engine_does_not_say(tmp_path: Path) -> None:
    proc = _watcher(tmp_path, "http://127.0.0.1:9")
    assert not proc.answers() and proc.in_flight() == 0


def test_running_gauges_of_vllm() -> None:
    text = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
    )
    assert sum(float(m.group(1)) for m in engines._RUNNING.finditer(text)) == 3.0


def test_the_engine_dies_with_a_daemon_killed_outright(tmp_path: Path) -> None:
    """SIGKILL gives the daemon no chance to stop its engine: the kernel must
    (PR_SET_PDEATHSIG), or the engine would keep the GPU and its ports."""
    import os
    import signal
    import subprocess
    import time

    engine = tmp_path / "engine-python"
    pidfile = tmp_path / "engine.pid"
    engine.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 600\n")
    engine.chmod(0o755)
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvx", "prefill", "--engine", "vllm", "--engine-python", str(engine),
         "--metadata", "127.0.0.1:9", "--secret-file", str(secret), "--api-port", "0", "--admin-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline and daemon.poll() is None, "the engine did not start"
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        os.kill(pid, 0)  # alive
        daemon.kill()
        daemon.wait(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            # A zombie is gone for good; the init process reaps it.
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    break
            assert time.monotonic() < deadline, "the engine outlived its daemon"
            time.sleep(0.05)
    finally:
        if daemon.poll() is None:
            daemon.kill()
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
