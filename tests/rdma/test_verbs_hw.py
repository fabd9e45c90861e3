"""The verbs provider on a real RDMA device: run by scripts/rdma_check.sh.

Skipped unless ``ibv_devices`` lists a device (a host with an InfiniBand or
RoCE NIC and rdma-core installed). Each side runs in its own process
(tests/rdma/peer.py), over one device and port: loopback through the NIC.
KVX_RDMA_DEVICE picks the device (default: the first one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

PIECE = 32 * 1024
SIZE = 1000 * PIECE


def _devices() -> list[str]:
    if shutil.which("ibv_devices") is None:
        return []
    out = subprocess.run(["ibv_devices"], capture_output=True, text=True, timeout=30, check=False)
    lines = out.stdout.splitlines()[2:]  # a header and a rule
    return [line.split()[0] for line in lines if line.strip()]


DEVICES = _devices()
pytestmark = pytest.mark.skipif(
    not DEVICES,
    reason="needs an RDMA device: runs on a host where `ibv_devices` lists one (scripts/rdma_check.sh)",
)
DEVICE = os.environ.get("KVX_RDMA_DEVICE") or (DEVICES[0] if DEVICES else "")


def _gpus() -> list[int]:
    try:
        import cupy

        return [0] if cupy.cuda.runtime.getDeviceCount() > 0 else []
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: host memory only
        return []


MEMORY = [-1] + _gpus()


class Proc:
    def __init__(self, role: str, gpu: int, case: str = "transfer") -> None:
        command = [sys.executable, "-m", "tests.rdma.peer", role, "--size", str(SIZE)]
        command += ["--device", DEVICE, "--gpu", str(gpu), "--case", case]
        self.p = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def say(self, message: dict) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(message) + "\n")
        self.p.stdin.flush()

    def hear(self, timeout_s: float = 60) -> dict:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout_s
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.p.stdout, selectors.EVENT_READ)
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise AssertionError("the peer process said nothing in time")
        line = self.p.stdout.readline()
        assert line, f"the peer process exited ({self.p.poll()})"
        return json.loads(line)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


def connect(gpu: int, case: str) -> tuple[Proc, Proc]:
    target = Proc("target", gpu)
    first = target.hear()
    initiator = Proc("initiator", gpu, case)
    initiator.say(first)
    target.say(initiator.hear())
    assert target.hear()["ready"]
    initiator.say({"go": True})
    return target, initiator


@pytest.mark.parametrize("gpu", MEMORY, ids=lambda g: "host" if g < 0 else f"gpu{g}")
def test_loopback_on_one_port(gpu):
    proc = Proc("loopback", gpu)
    try:
        result = proc.hear(timeout_s=120)
        assert result["write_exact"]
        assert result["how"] == ("host" if gpu < 0 else "dma-buf") or result["how"].startswith("peer-memory")
    finally:
        proc.stop()


@pytest.mark.parametrize("gpu", MEMORY, ids=lambda g: "host" if g < 0 else f"gpu{g}")
def test_two_processes_read_and_write_byte_exact(gpu):
    target, initiator = connect(gpu, "transfer")
    try:
        result = initiator.hear(timeout_s=120)
        assert result.get("error") is None and result["read_exact"]
        target.say({"do": "hash"})
        assert target.hear()["sha256"] == result["written_sha256"]
    finally:
        target.say({"do": "quit"})
        target.stop()
        initiator.stop()


@pytest.mark.parametrize("case", ["bad_rkey", "out_of_bounds"])
def test_bad_access_refused(case):
    target, initiator = connect(-1, case)
    try:
        assert initiator.hear()["error"] == "remote access error"
    finally:
        target.say({"do": "quit"})
        target.stop()
        initiator.stop()


def test_peer_killed_fails_within_the_timeout():
    target, initiator = connect(-1, "peer_killed")
    try:
        assert initiator.hear()["killing"]
        target.stop()
        initiator.say({"killed": True})
        result = initiator.hear(timeout_s=60)
        # The NIC retries (timeout 14, retry_cnt 7: about 4 s), then reports; kvx's deadline is 20 s.
        assert result["error"] in ("transport retry counter exceeded", "timeout")
        assert result["elapsed_s"] < 25
    finally:
        target.stop()
        initiator.stop()
