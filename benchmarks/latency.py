"""The latency of one small READ, alone: the posting thread's view.

Two processes on this host, as in ``kvx bench``: a target agent with one
region, an initiator that READs one block of --size bytes, waits, and
repeats. No limit path runs in between (``kvx bench --sweep`` alternates
with one), so the figure is kvx's own, for before/after comparisons of a
change on the latency path:

    python benchmarks/latency.py --backend shm --size 16384 --iters 20000

Prints one JSON line: p10, p50 and p99 in microseconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import secrets
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))


def target_main(conn: Any, size: int, backend: str, secret: bytes) -> None:
    import kvx

    pool = np.arange(2 * size, dtype=np.uint8)
    with kvx.Agent("latency-target", auth_secret=secret, backend=backend) as agent:
        agent.register(pool)
        conn.send(agent.metadata())
        conn.recv()  # done


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--size", type=int, default=16384, help="bytes of the one block read")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    args = parser.parse_args()

    import kvx

    secret = secrets.token_bytes(32)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=target_main, args=(theirs, args.size, args.backend, secret), daemon=True)
    child.start()
    try:
        if not mine.poll(60):
            raise RuntimeError("target did not start")
        metadata = mine.recv()
        with kvx.Agent("latency-initiator", auth_secret=secret, backend=args.backend) as agent:
            pool = np.zeros(2 * args.size, np.uint8)
            region = agent.register(pool)
            peer = agent.add_peer(metadata)
            local = kvx.Descs.from_blocks(region, [0], args.size)
            remote = kvx.Descs.from_blocks(peer.regions[0], [1], args.size)
            for _ in range(args.warmup):
                peer.read(local, remote).wait(30)
            took = []
            for _ in range(args.iters):
                start = time.perf_counter()
                peer.read(local, remote).wait(30)
                took.append(time.perf_counter() - start)
            if not np.array_equal(pool[: args.size], np.arange(2 * args.size, dtype=np.uint8)[args.size :]):
                raise RuntimeError("the bytes read are not the target's")
            backend = peer.backend
        mine.send("done")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    took.sort()
    n = len(took)
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "backend": backend,
                "size": args.size,
                "iters": n,
                "p10_us": round(took[n // 10] * 1e6, 2),
                "p50_us": round(took[n // 2] * 1e6, 2),
                "p99_us": round(took[n * 99 // 100] * 1e6, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
