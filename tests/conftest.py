"""Fixtures shared by the kvx tests.

The whole suite runs twice in CI (scripts/test.sh): with KVX_NATIVE=1 (the C
data path, required to be built) and KVX_NATIVE=0 (the pure-Python twin).
Worker processes inherit the same choice.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import pytest

import kvx
import kvx.backends
from kvx._datapath import io as _io
from kvx._worker import Worker, WorkerConfig, use_forkserver

# Hundreds of workers start in a run: from a fork server with kvx imported, each takes
# about 0.06 s where a fresh interpreter took 0.4 s (benchmarks/agent_start.py).
use_forkserver()

# A backend added from outside the package: its module and this one line (tests/backends/procmem.py).
kvx.backends.register("procmem", "tests.backends.procmem:ProcMemBackend")

NATIVE = os.environ.get("KVX_NATIVE", "")
# KVX_NATIVE switches the byte path alone (kvx._datapath). A test module about something
# else (the metadata service and its stores, the proxy, the side channel) would only repeat
# itself in the KVX_NATIVE=0 pass: the agents some of them start do connect through the
# byte path's I/O, which the transfer, fault and shm tests run in both passes anyway.
# Such a module sets ``pytestmark`` to this.
native_pass_only = pytest.mark.skipif(
    NATIVE == "0",
    reason="runs in the KVX_NATIVE=1 pass: it tests no byte path (the transfer tests run both)",
)
# Workers allocate their pools with kvx.alloc_shared (see backend_setting).
SHARED_POOLS = False
SECRET = b"test-cluster-secret-0123456789"


def pytest_report_header(config):
    return f"kvx data path: {_io.IMPL} (KVX_NATIVE={NATIVE or 'unset'})"


@pytest.fixture(scope="session", autouse=True)
def _data_path_is_what_was_asked():
    if NATIVE == "1":
        assert _io.IMPL == "native", "KVX_NATIVE=1 but the C extension is not in use"
    if NATIVE == "0":
        assert _io.IMPL == "python"


@pytest.fixture
def make_worker():
    workers: list[Worker] = []

    def make(name: str = "target", pool_bytes: int = 1 << 20, **kwargs) -> Worker:
        kwargs.setdefault("native", NATIVE)
        kwargs.setdefault("shared", SHARED_POOLS)
        worker = Worker(WorkerConfig(name, pool_bytes, **kwargs))
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop()


@pytest.fixture
def make_agent(request):
    # A module that defines a ``backend`` fixture runs its tests over each backend it lists.
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else None
    agents: list[kvx.Agent] = []

    def make(name: str = "initiator", **kwargs) -> kvx.Agent:
        if backend is not None:
            kwargs.setdefault("backend", backend)
        agent = kvx.Agent(name, **kwargs)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


def backend_setting(param: str, monkeypatch) -> str:
    """The agent backend setting for a suite's ``backend`` parameter.
    "shm-segments": shm where this process is refused cross-memory attach
    (the probe says EPERM) and workers' pools are kvx.alloc_shared memory,
    so that the bytes go through shared segments.
    "rdma": the rdma backend through libfabric's tcp provider, which does real
    one-sided READ and WRITE between the processes (skipped where kvx was
    built without libfabric)."""
    if param == "rdma":
        return rdma_setting(monkeypatch)
    if param != "shm-segments":
        return param
    from kvx.backends import shm

    monkeypatch.setattr(
        shm,
        "probe",
        lambda md: f"cross-memory attach to pid {md.pid} is not permitted (EPERM): refused for this test",
    )
    monkeypatch.setattr(sys.modules[__name__], "SHARED_POOLS", True)
    return "shm"


# The software provider CI moves rdma bytes through; workers inherit it.
RDMA_PROVIDER = "tcp;ofi_rxm"


def rdma_setting(monkeypatch) -> str:
    """Skip unless kvx._fabric is built; else every agent this test starts
    (workers too) opens an endpoint on libfabric's tcp provider."""
    from kvx.backends import rdma

    if NATIVE == "0":
        pytest.skip(
            "rdma moves bytes through kvx._fabric, not the data path KVX_NATIVE picks: "
            "it runs in the KVX_NATIVE=1 pass"
        )
    _, why = rdma.load_fabric()
    if why is not None:
        pytest.skip(f"the rdma backend needs kvx._fabric: {why}")
    monkeypatch.setenv(rdma.PROVIDER_ENV, RDMA_PROVIDER)
    return "rdma"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def kvx_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvx-"))


def fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(out)


def wait_until(predicate, timeout_s: float = 10.0, tolerate: tuple = ()) -> bool:
    """Poll ``predicate`` until it is true (True) or the time is up (False);
    exceptions in ``tolerate`` count as "not yet"."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except tolerate:
            pass
        time.sleep(0.05)
    return False
