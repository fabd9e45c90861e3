"""Posting and polling cost per work request in kvx._fabric, and tcp;ofi_rxm throughput.

    python benchmarks/rdma_post_rate.py --rounds 5

Part 1, the engine alone: the null provider moves no data and completes every
work request at once, so what a round measures is kvx's cost to build, post,
poll and dispatch work requests (and one Python call per post). Each post is
a chain of N descriptors (N remote pieces of 16 KiB from N local pieces);
a round posts chains for about --round-s seconds on one thread. Work requests
per second per core = work requests / the thread's CPU time. The issue's goal
is at least 2 million per second per core (a 400 Gb/s NIC fed with 16 KiB
pieces needs about 3 million per second).

Part 2, for reference: READ and WRITE throughput over libfabric's
tcp;ofi_rxm on 127.0.0.1 between two processes, one piece of each size per
post. Loopback tcp measures kvx's overhead against a kernel socket path, not
what a NIC does.

Medians of --rounds rounds; prints Markdown.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvx.backends.rdma import fabric

PIECE = 16 * 1024
CHAINS = (1, 4, 16, 64, 256, 1024)
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)


def null_rate(chain: int, round_s: float) -> tuple[float, float]:
    """(work requests per CPU second, per wall second) for one round."""
    ep = fabric.Endpoint("null")
    buf = np.zeros(PIECE * max(CHAINS), dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=True, remote_write=True)
    half, info = ep.prepare()
    peer = ep.complete(half, info)
    addrs = (buf.ctypes.data + np.arange(chain, dtype=np.uint64) * PIECE).astype(np.uint64)
    lens = np.full(chain, PIECE, dtype=np.uint64)
    keys = np.full(chain, mr.key, dtype=np.uint64)
    post = ep._ep.post  # the C call itself: the wrapper's checks are per post, not per request
    posts = 0
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < round_s:
        for _ in range(64):
            post(0, peer, addrs, lens, addrs, lens, keys, 10_000)
        posts += 64
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    wrs = ep.counters()["work_requests"]
    assert wrs == posts * chain
    ep.close()
    return wrs / cpu, wrs / wall


def _target(conn: Any, size: int) -> None:
    ep = fabric.Endpoint("tcp;ofi_rxm", "127.0.0.1")
    buf = np.ones(size, dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=True, remote_write=True)
    half, info = ep.prepare()
    ep.complete(half, conn.recv())
    conn.send((info, mr.key, mr.addr if ep.virt_addr else 0))
    conn.poll(600)
    ep.close()


def tcp_throughput(rounds: int, total_bytes: int) -> dict[tuple[str, int], float]:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(theirs, max(SIZES)), daemon=True)
    proc.start()
    ep = fabric.Endpoint("tcp;ofi_rxm", "127.0.0.1")
    buf = np.zeros(max(SIZES), dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=False, remote_write=False)
    half, info = ep.prepare()
    mine.send(info)
    if not mine.poll(30):
        raise SystemExit("the target did not answer")
    remote_info, key, base = mine.recv()
    peer = ep.complete(half, remote_info)
    out = {}
    for op, name in ((fabric.READ, "READ"), (fabric.WRITE, "WRITE")):
        for size in SIZES:
            n = max(4, total_bytes // size)
            args = [np.array([x], dtype=np.uint64) for x in (buf.ctypes.data, size, base, size, key)]
            ep.post(op, peer, *args, 30_000)  # warm: connection set up
            rates = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(n):
                    ep.post(op, peer, *args, 30_000)
                rates.append(n * size / (time.perf_counter() - t0))
            out[(name, size)] = statistics.median(rates)
    mine.send("stop")
    proc.join(10)
    mr.close()
    ep.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.5, help="seconds per null-provider round")
    parser.add_argument("--tcp-mib", type=int, default=256, help="MiB moved per tcp round and size")
    parser.add_argument("--no-tcp", action="store_true", help="only the null provider")
    args = parser.parse_args()
    why = fabric.available()
    if why:
        raise SystemExit(why)
    print("## Null provider: posting + polling cost (one thread)\n")
    print("| descriptors per post | work requests/s per core (CPU) | per wall second | ns per request |")
    print("|---:|---:|---:|---:|")
    for chain in CHAINS:
        cpu, wall = zip(*(null_rate(chain, args.round_s) for _ in range(args.rounds)), strict=True)
        med = statistics.median(cpu)
        print(f"| {chain} | {med / 1e6:.2f} M | {statistics.median(wall) / 1e6:.2f} M | {1e9 / med:.0f} |")
        sys.stdout.flush()
    if args.no_tcp:
        return
    print("\n## tcp;ofi_rxm on 127.0.0.1, two processes, one piece per post\n")
    print("| op | piece | GB/s |")
    print("|---|---:|---:|")
    for (name, size), rate in tcp_throughput(args.rounds, args.tcp_mib << 20).items():
        print(f"| {name} | {size >> 10} KiB | {rate / 1e9:.2f} |")


if __name__ == "__main__":
    main()
