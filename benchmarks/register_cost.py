"""Service CPU per registration: agents registered into an idle kvx metadata service.

    python benchmarks/register_cost.py --agents 20000                  # RegisterAgent, one a call
    python benchmarks/register_cost.py --agents 20000 --batch 8        # RegisterAgents, 8 a call

Starts `kvx metadata` (memory store) on a free loopback port, registers the
agents from this process (grpc.aio, --concurrency calls in flight), and
prints one JSON line: registrations a second, and the service's CPU (from
/proc) per registration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metadata_bench as mb  # noqa: E402

from kvx.v1 import metadata_pb2  # noqa: E402


async def _register(address: str, bodies: list[bytes], method: str, concurrency: int) -> None:
    channel = mb._channel(address)
    call = channel.unary_unary(mb.SERVICE + method)
    sem = asyncio.Semaphore(concurrency)

    async def one(body: bytes) -> None:
        async with sem:
            await call(body, timeout=60)

    await asyncio.gather(*(one(body) for body in bodies))
    await channel.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=20_000)
    p.add_argument(
        "--batch", type=int, default=0, help="registrations per RegisterAgents call; 0: RegisterAgent"
    )
    p.add_argument(
        "--concurrency", type=int, default=0, help="calls in flight (default: 64, or 16 for batches)"
    )
    args = p.parse_args()
    if not 0 <= args.batch <= 128:
        p.error("--batch must be within [0, 128] (the service's bound per call)")
    concurrency = args.concurrency or (16 if args.batch else 64)
    address = f"127.0.0.1:{mb._free_port()}"
    service = subprocess.Popen(
        [sys.executable, "-m", "kvx.cli", "--log-level", "WARNING", "metadata", "--listen", address,
         "--admin-listen", "off", "--max-agents", str(args.agents + 10)],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        mb._wait_port(address, service)
        requests = [metadata_pb2.RegisterAgentRequest(record=mb._record(i)) for i in range(args.agents)]
        if args.batch:
            bodies = [
                metadata_pb2.RegisterAgentsRequest(requests=requests[i : i + args.batch]).SerializeToString()
                for i in range(0, len(requests), args.batch)
            ]
            method = "RegisterAgents"
        else:
            bodies, method = [r.SerializeToString() for r in requests], "RegisterAgent"
        cpu0, t0 = mb._cpu_s(service.pid), time.monotonic()
        asyncio.run(_register(address, bodies, method, concurrency))
        wall, cpu = time.monotonic() - t0, mb._cpu_s(service.pid) - cpu0
        print(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "agents": args.agents, "batch": args.batch,
            "concurrency": concurrency, "registrations_per_s": round(args.agents / wall),
            "service_cpu_us_per_registration": round(cpu / args.agents * 1e6, 1),
        }))  # fmt: skip
    finally:
        service.terminate()
        service.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
