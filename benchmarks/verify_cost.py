"""What ``verify=True`` costs: the same transfer with and without it,
alternating in one session, over several sizes, medians of several rounds.

    python benchmarks/verify_cost.py [--rounds 5] [--backends tcp,shm] [--op read]

Each round starts a fresh target process (kvx._bench's session) and, per
size, alternates a plain transfer with a verified one; the throughput of
each is the median of its samples, and the round's ratio is verified over
plain. The printed figure per size is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvx import Descs
from kvx._bench import _Session, _stats

# (block size, blocks, iterations per round): a fixed cost hides in one size.
SIZES = ((16384, 1, 400), (16384, 64, 200), (32768, 1000, 20), (262144, 128, 20))


def _round(backend: str, op: str) -> dict[str, tuple[float, float]]:
    largest = max(block * blocks for block, blocks, _ in SIZES)
    session = _Session(2 * largest, 1, backend, "host")
    try:
        out = {}
        for block, blocks, iters in SIZES:
            ids = np.arange(0, 2 * blocks, 2)
            local = Descs.from_blocks(session.region, ids, block)
            remote = Descs.from_blocks(session.peer.regions[0], ids, block)
            post = session.peer.read if op == "read" else session.peer.write
            samples: dict[bool, list[float]] = {False: [], True: []}
            for i in range(iters + 3):
                for verify in (False, True):
                    start = time.perf_counter()
                    post(local, remote, verify=verify).wait(60)
                    if i >= 3:
                        samples[verify].append(time.perf_counter() - start)
            nbytes = block * blocks
            plain = _stats(samples[False], nbytes)
            checked = _stats(samples[True], nbytes)
            out[f"{blocks} x {block // 1024} KiB"] = (plain["throughput_gbps"], checked["throughput_gbps"])
        return out
    finally:
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="tcp,shm")
    parser.add_argument("--op", choices=["read", "write"], default="read")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        rounds = [_round(backend, args.op) for _ in range(args.rounds)]
        print(f"{backend} {args.op}, medians of {args.rounds} rounds:")
        print(f"  {'transfer':>16}  {'plain GB/s':>10}  {'verify GB/s':>11}  {'verify/plain':>12}")
        for size in rounds[0]:
            plain = statistics.median(r[size][0] for r in rounds)
            checked = statistics.median(r[size][1] for r in rounds)
            ratio = statistics.median(r[size][1] / r[size][0] for r in rounds)
            print(f"  {size:>16}  {plain:>10.3f}  {checked:>11.3f}  {ratio:>12.2f}")


if __name__ == "__main__":
    main()
