"""The chaos soak's world (benchmarks/soak.py): network namespaces joined
by veth pairs on a bridge, faults on the links (iptables, tc), and the
services (etcd, the metadata service) it starts, kills and restarts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

SUBNET = "10.201.0"
HUB_IP = f"{SUBNET}.1"
ETCD_CLIENT, ETCD_PEER, METADATA_PORT = 2379, 2380, 50051
CLONE_NEWNET = 0x40000000
START_TIMEOUT_S = 90.0  # an agent's or a service's start, on a busy 2-core machine
COMMAND_TIMEOUT_S = 20.0  # ip, tc, iptables


class SoakError(Exception):
    """The soak itself could not run (missing tool, setup failed)."""


# The network: a hub namespace with a bridge, one namespace per agent.


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise SoakError(f"{' '.join(args)} did not finish within {COMMAND_TIMEOUT_S} s") from None
    if check and result.returncode:
        raise SoakError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def check_tools() -> None:
    """Raise SoakError naming what is missing."""
    if os.geteuid() != 0:
        raise SoakError("the soak creates network namespaces: run it as root")
    missing = [
        f"{tool} (Debian package {package})"
        for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables"))
        if shutil.which(tool) is None
    ]
    if not os.path.exists("/usr/bin/etcd") and shutil.which("etcd") is None:
        missing.append("etcd (Debian package etcd-server)")
    if missing:
        raise SoakError(f"missing: {', '.join(missing)}; apt-get install them, then run the soak again")


def remove_stale() -> None:
    """Namespaces and folders of earlier soaks whose process is gone (killed before it could clean up)."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        match = re.match(r"(kvxsoak-(\d+)-\S+)", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            _run("ip", "netns", "del", match.group(1), check=False)
    for folder in Path(tempfile.gettempdir()).glob("kvxsoak-*-*"):
        pid = folder.name.split("-")[1]
        if folder.is_dir() and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(folder, ignore_errors=True)


class Network:
    def __init__(self, agents: int) -> None:
        self.prefix = f"kvxsoak-{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.agent_ns = [f"{self.prefix}-a{i}" for i in range(agents)]
        self.agent_ip = [f"{SUBNET}.{10 + i}" for i in range(agents)]
        self.created: list[str] = []

    def create(self) -> None:
        for ns in (self.hub, *self.agent_ns):
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.agent_ns):
            # The hub end is h<i>, the agent's end eth0: names need only be unique inside a namespace.
            _run("ip", "-n", self.hub, "link", "add", f"h{i}", "type", "veth",
                 "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _run("ip", "-n", self.hub, "link", "set", f"h{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.agent_ip[i]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def enter_hub(self) -> None:
        """Move this process (still one thread) into the hub: etcd and the
        metadata service start there, and its health checks reach them."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.hub}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise SoakError(f"setns into {self.hub}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def set_loss(self, i: int, probability: float, on: bool) -> None:
        ns, action = self.agent_ns[i], "-A" if on else "-D"
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _run(
                "ip", "netns", "exec", ns, "iptables", "-w", "5", action, chain, flag, "eth0",
                "-m", "statistic", "--mode", "random", "--probability", f"{probability:.3f}", "-j", "DROP",
            )  # fmt: skip

    def set_bandwidth(self, i: int, rate: str | None) -> None:
        # Both directions: the agent's eth0 sends, the hub's h<i> sends towards the agent.
        for ns, dev in ((self.agent_ns[i], "eth0"), (self.hub, f"h{i}")):
            if rate is None:
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                     "rate", rate, "burst", "32kb", "latency", "400ms")  # fmt: skip

    def remove(self) -> list[str]:
        """Delete every namespace made (their veths, bridge, rules and qdiscs go with them)."""
        problems = []
        for ns in reversed(self.created):
            result = _run("ip", "netns", "del", ns, check=False)
            if result.returncode:
                problems.append(f"ip netns del {ns}: {result.stderr.strip()}")
        self.created.clear()
        return problems


# Processes.


def kill_process(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()  # a stopped process dies too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


class Service:
    """etcd or the metadata service: started, killed and restarted on the same address and data."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None) -> None:
        self.name, self.args, self.log, self.env = name, args, log, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from kvx._spawn import dying_with_parent

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                dying_with_parent(self.args, self.env),  # SIGKILL when the soak dies
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def kill(self) -> None:
        kill_process(self.proc)

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""


def etcd_healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ETCD_CLIENT}/health", timeout=1) as response:
            return b'"health":"true"' in response.read().replace(b" ", b"")
    except OSError:
        return False


def metadata_serving() -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{HUB_IP}:{METADATA_PORT}") as channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service="kvx.v1.MetadataService"), timeout=1)
                .status
            )
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def wait_for(what: str, predicate: Any, service: Service) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if service.proc is not None and service.proc.poll() is not None:
            raise SoakError(f"{what} exited with {service.proc.returncode}:\n{service.tail()}")
        if predicate():
            return
        time.sleep(0.2)
    raise SoakError(f"{what} was not ready within {START_TIMEOUT_S} s:\n{service.tail()}")
