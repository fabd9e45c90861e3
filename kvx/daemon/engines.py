"""vLLM and SGLang as the daemon's child process.

The daemon builds the engine's command line for its role (the KV connector,
the metadata service, the secret, the ports), starts it in its own process
group, and watches it: ready once the engine's ``/health`` answers (and, for
vLLM, its kvx agents are registered); its exit is the daemon's exit, non-zero,
with the reason and the end of the engine's output in the log.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from kvx._spawn import dying_with_parent
from kvx.daemon.settings import DaemonSettings
from kvx.errors import ConfigError

logger = logging.getLogger(__name__)

TAIL_LINES = 40
# Flags the daemon sets itself; given after -- they would contradict it.
_OWN_FLAGS = {
    "vllm": ("--host", "--port", "--kv-transfer-config"),
    "sglang": ("--host", "--port", "--disaggregation-mode", "--disaggregation-transfer-backend"),
}
# The gauges of requests an engine holds: running or queued, and SGLang's
# disaggregation queues (a prefill whose KV is still being sent, a decode
# waiting for it), which count too: stopping then would strand the peer.
_RUNNING = re.compile(
    rb"^(?:vllm:num_requests_(?:running|waiting)"
    rb"|sglang:num_(?:running|queue|prefill_(?:bootstrap|prealloc|inflight)_queue"
    rb"|decode_(?:prealloc|transfer)_queue)_reqs)"
    rb"(?:\{[^}]*\})? ([0-9.e+]+)$",
    re.M,
)
# Asks the engine on its own URL: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def engine_command(s: DaemonSettings) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of the engine process."""
    for arg in s.engine_args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):  # vLLM reads --kv_transfer_config as --kv-transfer-config
            flag = "--" + flag[2:].replace("_", "-")
        if flag in _OWN_FLAGS[s.engine]:
            raise ConfigError(
                f"{flag} after -- : the daemon sets it for {s.engine} (use the daemon's settings)"
            )
    python = s.engine_python or sys.executable
    env: dict[str, str] = {}
    if s.engine == "vllm":
        extra: dict[str, Any] = {
            "metadata": s.metadata,
            "auth_secret_file": s.secret_file,
            "host": s.advertise_host,
            "agent_port": s.agent_port,
            "backend": s.backend,
            "lease_s": s.lease_s,
            "transfer_timeout_s": s.transfer_timeout_s,
        }
        if s.metadata_token_file:
            extra["metadata_token_file"] = s.metadata_token_file
        if s.metadata_read:
            extra["metadata_read"] = s.metadata_read
        kv_config = {
            "kv_connector": "KvxConnector",
            "kv_connector_module_path": "kvx.connectors.vllm",
            "kv_role": "kv_producer" if s.role == "prefill" else "kv_consumer",
            "engine_id": s.name,
            "kv_connector_extra_config": extra,
        }
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", *s.engine_args]
        argv += ["--host", s.host, "--port", str(s.api_port), "--kv-transfer-config", json.dumps(kv_config)]
    else:
        argv = [python, "-m", "sglang.launch_server", *s.engine_args]
        argv += ["--host", s.host, "--port", str(s.api_port), "--disaggregation-mode", s.role]
        # Its /metrics (off by default) say how many requests it holds, for the drain.
        argv += ["--disaggregation-transfer-backend", "kvx", "--enable-metrics"]
        env = {
            "KVX_HOST": str(s.advertise_host),
            "KVX_AUTH_SECRET_FILE": s.secret_file,
            "KVX_BACKEND": s.backend,
        }
    return argv, env


class EngineProcess:
    """The engine child: started, watched, asked how busy it is, stopped."""

    def __init__(self, s: DaemonSettings, api_url: str) -> None:
        self.s = s
        self.api_url = api_url
        self.argv, env = engine_command(s)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        full_env = {**os.environ, **env}
        self.popen = subprocess.Popen(
            # SIGKILL when the daemon dies, even by SIGKILL (its drain never runs
            # then; an orphaned engine would hold the GPU and the ports).
            dying_with_parent(self.argv, full_env),
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its workers die with its group
        )
        logger.info("started %s (pid %d): %s", s.engine, self.popen.pid, " ".join(self.argv))
        self._reader = threading.Thread(target=self._read, name="kvx-engine-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.s.engine}] {line}", file=sys.stderr, flush=True)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def died_reason(self) -> str:
        code = self.popen.poll()
        return f"{self.s.engine} exited with code {code}; its last lines:\n  " + "\n  ".join(self.tail)

    def _get(self, path: str, timeout_s: float = 2.0, limit: int = 8 << 20) -> bytes | None:
        try:
            with _OPENER.open(self.api_url + path, timeout=timeout_s) as r:
                return r.read(limit) if r.status == 200 else None
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def answers(self) -> bool:
        return self._get("/health") is not None

    def agents_registered(self, client: Any) -> bool:
        """vLLM's kvx agents carry label engine_id=<name>; SGLang's do not register."""
        if self.s.engine != "vllm":
            return True
        return bool(client.list(labels={"engine_id": str(self.s.name)}))

    def in_flight(self) -> int:
        """Requests the engine runs or queues, from its /metrics (0 when it does not say)."""
        text = self._get("/metrics")
        if text is None:
            return 0
        return int(sum(float(m.group(1)) for m in _RUNNING.finditer(text)))

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.popen.poll() is None:
            with _suppress_gone():
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killing it", self.s.engine, timeout_s)
                with _suppress_gone():
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        else:
            with _suppress_gone():  # workers it left behind
                os.killpg(self.popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self._reader.is_alive() and time.monotonic() < deadline:
            self._reader.join(0.1)


class _suppress_gone:  # noqa: N801 (a context manager used like contextlib.suppress)
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *_: Any) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError | PermissionError)
