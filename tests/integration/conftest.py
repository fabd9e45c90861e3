"""Fixtures for the integration tests: a real etcd on loopback, and a
metadata service (memory store) on loopback as ``service``.

``etcd_server`` runs /usr/bin/etcd (Debian package ``etcd-server``, which
scripts/test.sh installs in CI) on free ports with a temporary data dir, and
can be stopped and started again on the same ports and data.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ETCD_START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _etcd_binary() -> str | None:
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None


class EtcdServer:
    """One etcd member on 127.0.0.1, restartable on the same ports and data."""

    def __init__(self, binary: str, data_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.extra_args = extra_args
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.endpoints = [("127.0.0.1", self.client_port)]
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        self.log_path = data_dir.parent / "etcd.log"
        self._proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name", "kvx-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvx-test={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"kvx-test-{os.getpid()}-{self.client_port}",
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        health = f"http://127.0.0.1:{self.client_port}/health"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(health, timeout=1) as response:
                    if b'"health":"true"' in response.read().replace(b" ", b""):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"etcd did not answer within {ETCD_START_TIMEOUT_S} s:\n{self._log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then wait (SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: etcd hangs, its sockets stay open."""
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"


@pytest.fixture
def etcd_server(tmp_path):
    binary = _etcd_binary()
    if binary is None:
        pytest.skip(
            "etcd is not installed: scripts/test.sh installs it "
            "(apt-get install etcd-server, which provides /usr/bin/etcd)"
        )
    server = EtcdServer(binary, tmp_path / "etcd-data")
    try:
        server.start()
        yield server
    finally:
        server.kill()


@pytest.fixture
def service():
    """A metadata service with the memory store, on a free loopback port."""
    from kvx.metadata.service import MetadataServer, ThreadedServer

    with ThreadedServer(MetadataServer("127.0.0.1:0")) as srv:
        yield srv
