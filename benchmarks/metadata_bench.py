"""Load on the kvx metadata service: many agents, steady lookups and keep-alives.

    python benchmarks/metadata_bench.py --agents 10000 --lookups-per-s 1000 --keepalive-s 5 --duration-s 30
    python benchmarks/metadata_bench.py --store etcd://127.0.0.1:2379 ...      # against a running etcd

Starts `kvx metadata` in its own process, registers --agents records (each
with a few regions, like a real agent), then runs, for --duration-s seconds,
two load processes side by side:
  - keep-alive: every lease renewed once per --keepalive-s, over 100 streams,
    spread evenly over the period (agents renew independently);
  - lookups: GetAgent of random names at a fixed rate (open loop: a request
    is sent on schedule whether or not the last one has answered), each
    latency measured from its scheduled time.
Prints one JSON object: lookup latency p50/p99/max, the rates achieved,
leases lost, and the server's CPU use. With --profile, py-spy samples the
server during the load and the top functions by own time are printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

STREAMS = 100


def _record(i: int):
    from kvx.v1 import metadata_pb2

    name = f"agent-{i:05d}"
    rec = metadata_pb2.AgentRecord(
        name=name,
        epoch=i + 1,
        role=1 + i % 2,
        started_unix_ms=1,
        labels={"model": "llama-3-8b", "zone": f"z{i % 4}"},
        engine_info={"url": f"http://10.0.{i // 250}.{i % 250}:8000"},
    )
    rec.metadata.name, rec.metadata.epoch, rec.metadata.protocol_version = name, i + 1, 1
    rec.metadata.endpoints.add(backend=1, address=f"10.0.{i // 250}.{i % 250}:40000")
    for r in range(4):
        rec.metadata.regions.add(
            id=r + 1,
            size_bytes=1 << 30,
            memory_kind=2,
            device=r,
            address=0x7F0000000000 + r,
            remote_read=True,
            remote_write=True,
        )
    return rec


async def _register_all(address: str, agents: int) -> list[int]:
    import grpc

    from kvx.v1 import metadata_pb2, metadata_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        leases: list[int] = []
        for start in range(0, agents, 200):
            replies = await asyncio.gather(
                *(
                    stub.RegisterAgent(
                        metadata_pb2.RegisterAgentRequest(record=_record(i), ttl_s=30), timeout=30
                    )
                    for i in range(start, min(start + 200, agents))
                )
            )
            leases += [r.lease_id for r in replies]
        return leases


def _keepalive_proc(address: str, leases: list[int], period_s: float, duration_s: float, out) -> None:
    import grpc

    from kvx.v1 import metadata_pb2, metadata_pb2_grpc

    tick_s = 0.01  # renewals due in a tick go out together: the even spread, at 100 wake-ups a second

    async def main() -> dict:
        stats = {"sent": 0, "lost": 0}
        async with grpc.aio.insecure_channel(address) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            queues = [asyncio.Queue() for _ in range(STREAMS)]

            async def requests(queue):
                while (item := await queue.get()) is not None:
                    yield metadata_pb2.KeepAliveRequest(lease_id=item)

            async def replies(call):
                async for reply in call:
                    stats["sent"] += 1
                    stats["lost"] += reply.ttl_s == 0

            calls = [stub.KeepAlive(requests(q)) for q in queues]
            readers = [asyncio.create_task(replies(c)) for c in calls]
            per_tick = len(leases) * tick_s / period_s
            start = time.monotonic()
            due = 0.0
            k = 0
            while time.monotonic() - start < duration_s:
                due += per_tick
                while k < int(due):
                    queues[k % STREAMS].put_nowait(leases[k % len(leases)])
                    k += 1
                await asyncio.sleep(max(0.0, start + (k / per_tick) * tick_s - time.monotonic()) or tick_s)
            for q in queues:
                q.put_nowait(None)
            await asyncio.wait(readers, timeout=10)
            for c in calls:
                c.cancel()
        return stats

    result = asyncio.run(main())
    result["cpu_s"] = time.process_time()
    out.put(result)


def _lookup_proc(address: str, agents: int, rate: float, duration_s: float, out) -> None:
    import grpc

    from kvx.v1 import metadata_pb2, metadata_pb2_grpc

    async def main() -> dict:
        latencies: list[float] = []
        errors = 0
        async with grpc.aio.insecure_channel(address) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            await stub.GetAgent(metadata_pb2.GetAgentRequest(name="agent-00000"), timeout=10)

            async def one(at: float) -> None:
                nonlocal errors
                try:
                    await stub.GetAgent(
                        metadata_pb2.GetAgentRequest(name=f"agent-{random.randrange(agents):05d}"), timeout=10
                    )
                    latencies.append(time.monotonic() - at)
                except grpc.RpcError:
                    errors += 1

            start = time.monotonic()
            tasks = []
            n = int(rate * duration_s)
            for k in range(n):
                at = start + k / rate
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(one(at)))
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - start
        arr = np.asarray(latencies) * 1e3
        return {
            "lookups": len(latencies),
            "errors": errors,
            "rate": len(latencies) / elapsed,
            "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()),
        }

    result = asyncio.run(main())
    result["cpu_s"] = time.process_time()
    out.put(result)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--lookups-per-s", type=float, default=1000)
    parser.add_argument("--keepalive-s", type=float, default=5.0)
    parser.add_argument("--no-keepalive", action="store_true", help="lookups only (isolates the lookup path)")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--store", default="memory")
    parser.add_argument("--profile", action="store_true", help="sample the server with py-spy")
    args = parser.parse_args()

    address = f"127.0.0.1:{_free_port()}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvx.cli",
            "--log-level",
            "WARNING",
            "metadata",
            "--listen",
            address,
            "--admin-listen",
            "off",
            "--store",
            args.store,
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(address.split(":"), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("kvx metadata did not start") from None
                time.sleep(0.1)
        t0 = time.monotonic()
        leases = asyncio.run(_register_all(address, args.agents))
        register_s = time.monotonic() - t0

        ctx = mp.get_context("spawn")
        out_k, out_l = ctx.Queue(), ctx.Queue()
        procs = [
            ctx.Process(
                target=_lookup_proc, args=(address, args.agents, args.lookups_per_s, args.duration_s, out_l)
            )
        ]
        if not args.no_keepalive:
            procs.append(
                ctx.Process(
                    target=_keepalive_proc, args=(address, leases, args.keepalive_s, args.duration_s, out_k)
                )
            )
        cpu0, wall0 = _cpu_s(server.pid), time.monotonic()
        for p in procs:
            p.start()
        profile = None
        if args.profile and shutil.which("py-spy"):
            time.sleep(2)
            raw = subprocess.run(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(server.pid),
                    "--duration",
                    str(int(args.duration_s) - 4),
                    "--format",
                    "raw",
                    "--output",
                    "/dev/stdout",
                    "--nonblocking",
                ],
                capture_output=True,
                text=True,
            ).stdout
            profile = _top_self(raw)
        look = out_l.get(timeout=args.duration_s + 120)
        keep = (
            {"sent": 0, "lost": 0, "cpu_s": 0.0}
            if args.no_keepalive
            else out_k.get(timeout=args.duration_s + 120)
        )
        elapsed = time.monotonic() - wall0
        cpu = (_cpu_s(server.pid) - cpu0) / elapsed
        load_cpu = (look["cpu_s"] + keep["cpu_s"]) / elapsed  # including their start-up
        for p in procs:
            p.join(10)
    finally:
        server.terminate()
        server.wait(10)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "store": args.store,
        "agents": args.agents,
        "register_all_s": round(register_s, 2),
        "lookups_per_s_target": args.lookups_per_s,
        "lookups_per_s": round(look["rate"], 1),
        "lookup_p50_ms": round(look["p50_ms"], 3),
        "lookup_p99_ms": round(look["p99_ms"], 3),
        "lookup_max_ms": round(look["max_ms"], 3),
        "lookup_errors": look["errors"],
        "keepalives_per_s_target": 0 if args.no_keepalive else round(args.agents / args.keepalive_s, 1),
        "keepalives_per_s": round(keep["sent"] / args.duration_s, 1),
        "leases_lost": keep["lost"],
        "server_cpu_cores": round(cpu, 2),
        "load_generators_cpu_cores": round(load_cpu, 2),
    }
    print(json.dumps(result))
    if profile:
        print("server time by function (own samples, py-spy):", file=sys.stderr)
        for name, share in profile:
            print(f"  {share:5.1%}  {name}", file=sys.stderr)
    return 0


def _top_self(raw: str, n: int = 15) -> list[tuple[str, float]]:
    """Top functions by own (leaf) samples from py-spy's raw output."""
    from collections import Counter

    counts: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        counts[leaf] += int(count)
        total += int(count)
    return [(name, c / total) for name, c in counts.most_common(n)] if total else []


if __name__ == "__main__":
    sys.exit(main())
