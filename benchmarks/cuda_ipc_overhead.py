"""kvx's own work per cuda_ipc transfer, on any machine: a stand-in CUDA whose
copies cost nothing (tests/unit/fake_cuda.py), so what is timed is the
Python and C of kvx's path (descriptor checks, the pin or lease, pairing
and cutting the ranges, loading the kernel's arguments) and nothing of the
GPU. Two agents in one process; READs of N scattered 16 KiB blocks.

    python benchmarks/cuda_ipc_overhead.py --blocks 1,64,512,4096 --rounds 5

On a GPU the transfer costs this, plus the kernel launch, the copy and the
wake-up of the waiting thread (benchmarks/gpu_side_by_side.py and
``kvx bench --sweep --memory cuda --backend cuda_ipc`` measure those).
Prints one JSON object: per block count, the median over rounds of each
round's p50 in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())  # the checkout under test (run from its root)
sys.path.insert(1, ROOT)

import numpy as np  # noqa: E402

from tests.unit import fake_cuda  # noqa: E402

BLOCK = 16384


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", default="1,64,512,4096", help="blocks per READ, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300, help="READs per round and size")
    args = parser.parse_args()
    lib = fake_cuda.build_kernel(pathlib.Path(tempfile.mkdtemp()))
    if lib is None:
        sys.exit("needs a C++ compiler for the CPU build of the copy kernel (apt-get install g++)")
    cupy = fake_cuda.make(lib)
    # No copy runs: kvx's work is what is left.
    cupy.RawModule.get_function = lambda self, name: lambda grid, block, kernel_args: None
    cupy.cuda.runtime.memcpyAsync = lambda *a: None
    sys.modules["cupy"] = cupy
    import kvx
    from kvx import Descs
    from kvx._datapath import gpu

    arrays: list = []
    gpu._allocation = fake_cuda.allocation_of(arrays)

    def device(nbytes: int) -> fake_cuda.DeviceArray:
        arr = fake_cuda.DeviceArray(np.zeros(nbytes, np.uint8))
        arrays.append(arr)
        return arr

    sizes = [int(n) for n in args.blocks.split(",")]
    results: dict[int, list[float]] = {n: [] for n in sizes}
    with kvx.Agent("initiator", backend="cuda_ipc") as a, kvx.Agent("target", backend="cuda_ipc") as b:
        rng = np.random.default_rng(0)
        cases = []
        for n in sizes:
            theirs, mine = b.register(device(2 * n * BLOCK)), a.register(device(2 * n * BLOCK))
            cases.append((n, theirs, mine))
        peer = a.add_peer(b.metadata())
        assert peer.backend == "cuda_ipc", peer.backend_reason
        lists = {
            n: (
                Descs.from_blocks(mine, rng.permutation(2 * n)[:n], BLOCK),
                Descs.from_blocks(peer.region(theirs.id), rng.permutation(2 * n)[:n], BLOCK),
            )
            for n, theirs, mine in cases
        }
        for _ in range(args.rounds):
            for n, (local, remote) in lists.items():
                for _ in range(20):
                    peer.read(local, remote).wait(10)
                samples = []
                for _ in range(args.iters):
                    started = time.perf_counter()
                    peer.read(local, remote).wait(10)
                    samples.append(time.perf_counter() - started)
                results[n].append(statistics.median(samples) * 1e6)
    print(json.dumps({str(n): round(statistics.median(v), 1) for n, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
