"""What agents watching a read replica see when it dies, and when it returns.

    python benchmarks/replica_failover.py --watchers 1000 --rounds 3

A primary (`kvx metadata`) and one read replica of it (`--store
mirror://`), each its own process; --watchers kvx watches
(`kvx.metadata.client.Watcher`, each with its own channels to the replica
and, as its fallback, the primary, as an agent's Directory makes them) in
--procs processes. Each watches --names-per-watcher names of --agents
registered agents, and one name all share (the beacon). Per round:

1. steady: the beacon is registered again (a new epoch); the delay until
   each watcher sees it, through the replica.
2. the replica is killed (SIGKILL) and, --change-after-s later, the beacon
   changes again: the delay from the change until each watcher sees it
   (they must have moved to the primary), and how many watch the primary;
   meanwhile, from the kill on for --lookup-s, a GetAgent at the primary
   every 10 ms: what the watchers moving there cost its other callers; and
   the CPU seconds the primary and the watchers' processes used from the
   kill until every watcher saw the change (window_s).
3. the replica is started again (same address) after --down-s: the time
   until every watcher watches it again (the health probe, jittered around
   READER_PROBE_S, plus gRPC's reconnection backoff), and a change through
   it; then --settle-s, so that the next kill finds the return kept.

Prints one JSON object: per round and phase, p50/p99/max delays in ms, and
the watchers that never saw a change (should be 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BEACON = "beacon"


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _service(address: str, *store: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvx.cli", "--log-level", "ERROR", "metadata", "--listen", address]
        + ["--admin-listen", "off", "--max-watch-streams", "8192", *store],
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    _wait_serving(address, proc)
    return proc


def _wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    from kvx.metadata.client import MetadataClient

    client = MetadataClient(address)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.serving(1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service at {address} did not serve")
            time.sleep(0.05)
    finally:
        client.close()


class _Registrar:
    """Registers at the primary; a name registered again keeps its lease (a new epoch is a restart)."""

    def __init__(self, address: str) -> None:
        from kvx.metadata.client import MetadataClient

        self.client = MetadataClient(address)
        self.leases: dict[str, int] = {}

    def register(self, name: str, epoch: int) -> None:
        from kvx.v1 import metadata_pb2

        record = metadata_pb2.AgentRecord(
            name=name, epoch=epoch, role=metadata_pb2.ROLE_DECODE, started_unix_ms=1
        )
        record.metadata.name, record.metadata.epoch, record.metadata.protocol_version = name, epoch, 1
        request = metadata_pb2.RegisterAgentRequest(
            record=record, ttl_s=300, lease_id=self.leases.get(name, 0)
        )
        self.leases[name] = self.client.stub.RegisterAgent(request, timeout=10).lease_id

    def close(self) -> None:
        self.client.close()


def _watchers(
    conn: Any, replica: str, primary: str, count: int, names: list[list[str]], probe_s: float, spread_s: float
) -> None:
    from kvx.metadata import client as client_module
    from kvx.metadata.client import MetadataClient, Watcher
    from kvx.v1 import metadata_pb2

    logging.getLogger("kvx").setLevel(logging.ERROR)  # a warning per watcher on each move
    if probe_s > 0:
        client_module.READER_PROBE_S = probe_s
    if spread_s >= 0:
        client_module.READER_MOVE_SPREAD_S = spread_s
    seen = [dict[int, float]() for _ in range(count)]  # watcher -> beacon epoch -> when first seen

    def on_event(w: int) -> Any:
        def handle(event: metadata_pb2.WatchAgentsResponse) -> None:
            if event.type == metadata_pb2.WatchAgentsResponse.EVENT_TYPE_PUT and event.record.name == BEACON:
                seen[w].setdefault(event.record.epoch, time.monotonic())

        return handle

    readers = [MetadataClient(replica, reader=True) for _ in range(count)]
    fallbacks = [MetadataClient(primary) for _ in range(count)]
    for fallback in fallbacks:  # connected, as an agent's is: it registers and renews there
        fallback.serving(10)
    watchers = [
        Watcher(readers[w], on_event(w), names=[BEACON, *names[w]], fallback=fallbacks[w])
        for w in range(count)
    ]
    try:
        while True:
            command, arg = conn.recv()
            if command == "stop":
                break
            if command == "state":
                conn.send(
                    (
                        sum(w.synced.is_set() for w in watchers),
                        sum(w.current_stream[1] is w.client for w in watchers),
                    )
                )
            elif command == "seen":
                conn.send([s.get(arg) for s in seen])
    finally:
        for w in watchers:
            w.stop()
        for c in readers + fallbacks:
            c.close()


class _Fleet:
    def __init__(self, args: argparse.Namespace, replica: str, primary: str) -> None:
        rng = np.random.default_rng(1)
        per = [args.watchers // args.procs + (i < args.watchers % args.procs) for i in range(args.procs)]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for count in per:
            names = [
                [
                    f"agent-{int(i):05d}"
                    for i in rng.choice(args.agents, args.names_per_watcher, replace=False)
                ]
                for _ in range(count)
            ]
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_watchers,
                args=(child, replica, primary, count, names, args.probe_s, args.move_spread_s),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def ask(self, command: str, arg: Any = None) -> list[Any]:
        for conn in self.conns:
            conn.send((command, arg))
        return [conn.recv() for conn in self.conns]

    def state(self) -> tuple[int, int]:
        answers = self.ask("state")
        return sum(a[0] for a in answers), sum(a[1] for a in answers)

    def seen(self, epoch: int) -> list[float | None]:
        return [t for answer in self.ask("seen", epoch) for t in answer]

    def stop(self) -> None:
        for conn in self.conns:
            conn.send(("stop", None))
        for proc in self.procs:
            proc.join(15)
            if proc.is_alive():
                proc.kill()


class _Lookups:
    """GetAgent at the primary every 10 ms from a thread, for --lookup-s: what the
    watchers that move there cost the primary's other callers."""

    def __init__(self, primary: str, seconds: float) -> None:
        import threading

        from kvx.metadata.client import MetadataClient

        self.client = MetadataClient(primary)
        self.client.get("agent-00000")  # connected before the kill
        self.seconds, self.took_ms = seconds, list[float]()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            self.client.get("agent-00000")
            self.took_ms.append((time.perf_counter() - start) * 1000)
            time.sleep(0.01)

    def result(self) -> dict[str, float]:
        self.thread.join()
        self.client.close()
        got = np.array(self.took_ms)
        return {
            "n": len(got),
            "p50": round(float(np.percentile(got, 50)), 1),
            "p99": round(float(np.percentile(got, 99)), 1),
            "max": round(float(got.max()), 1),
        }


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _until(check: Any, timeout_s: float, step_s: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


def _delays(fleet: _Fleet, epoch: int, since: float, timeout_s: float) -> dict[str, Any]:
    _until(lambda: all(t is not None for t in fleet.seen(epoch)), timeout_s, 0.1)
    times = fleet.seen(epoch)
    got = np.array([t - since for t in times if t is not None]) * 1000
    out: dict[str, Any] = {"missed": sum(t is None for t in times)}
    if len(got):
        out.update(
            p50_ms=round(float(np.percentile(got, 50)), 1), p99_ms=round(float(np.percentile(got, 99)), 1)
        )
        out["max_ms"] = round(float(got.max()), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--watchers", type=int, default=1000)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--names-per-watcher", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--change-after-s", type=float, default=0.0, help="after the kill, before the change")
    p.add_argument("--down-s", type=float, default=5.0, help="how long the replica stays down")
    p.add_argument("--probe-s", type=float, default=0.0, help="READER_PROBE_S for the watchers (0: kvx's)")
    p.add_argument(
        "--move-spread-s", type=float, default=-1.0, help="READER_MOVE_SPREAD_S for the watchers (-1: kvx's)"
    )
    p.add_argument(
        "--lookup-s", type=float, default=6.0, help="lookups at the primary from the kill on, this long"
    )
    p.add_argument("--settle-s", type=float, default=11.0, help="after a round, before the next")
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args()

    primary_address, replica_address = _free_address(), _free_address()
    primary = _service(primary_address)
    registrar = _Registrar(primary_address)
    replica = fleet = None
    epoch = 1
    try:
        for i in range(args.agents):
            registrar.register(f"agent-{i:05d}", 1)
        registrar.register(BEACON, epoch)
        replica = _service(replica_address, "--store", f"mirror://{primary_address}")
        fleet = _Fleet(args, replica_address, primary_address)
        synced = _until(lambda: fleet.state() == (args.watchers, args.watchers), args.timeout_s, 0.2)
        if synced is None:
            raise RuntimeError(f"the watchers did not sync on the replica: {fleet.state()}")
        rounds = []
        for _ in range(args.rounds):
            result: dict[str, Any] = {}
            epoch += 1
            at = time.monotonic()
            registrar.register(BEACON, epoch)
            result["steady"] = _delays(fleet, epoch, at, args.timeout_s)

            lookups = _Lookups(primary_address, args.lookup_s)
            watcher_pids = [proc.pid for proc in fleet.procs]
            cpu_before = _cpu_s([primary.pid]), _cpu_s(watcher_pids)
            replica.send_signal(signal.SIGKILL)
            replica.wait(10)
            killed = time.monotonic()
            time.sleep(args.change_after_s)
            epoch += 1
            at = time.monotonic()
            registrar.register(BEACON, epoch)
            result["replica_killed"] = _delays(fleet, epoch, at, args.timeout_s)
            result["replica_killed"]["on_primary"] = args.watchers - fleet.state()[1]
            # Until every watcher saw the change: the primary's CPU, and the watchers'
            # (their processes share this host's cores with it).
            result["replica_killed"]["window_s"] = round(time.monotonic() - killed, 2)
            result["replica_killed"]["primary_cpu_s"] = round(_cpu_s([primary.pid]) - cpu_before[0], 2)
            result["replica_killed"]["watchers_cpu_s"] = round(_cpu_s(watcher_pids) - cpu_before[1], 2)
            result["primary_lookup_ms"] = lookups.result()
            time.sleep(max(0.0, args.down_s - (time.monotonic() - killed)))

            replica = _service(replica_address, "--store", f"mirror://{primary_address}")
            back = _until(lambda: fleet.state()[1] == args.watchers, args.timeout_s, 0.1)
            result["replica_back_s"] = None if back is None else round(back, 2)
            result["on_replica"] = fleet.state()[1]
            epoch += 1
            at = time.monotonic()
            registrar.register(BEACON, epoch)
            result["after_return"] = _delays(fleet, epoch, at, args.timeout_s)
            rounds.append(result)
            # A return counts as kept once the replica held the watch READER_STAYED_S (10 s):
            # a kill sooner would double the next wait, as for a replica that drops watches.
            time.sleep(args.settle_s)
        print(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))
    finally:
        if fleet is not None:
            fleet.stop()
        registrar.close()
        for proc in (replica, primary):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
