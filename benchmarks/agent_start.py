"""What starting an agent costs: the first ``kvx.Agent`` of a process, and a
worker process (``kvx._worker.Worker``, what ``kvx bench``, ``kvx demo`` and
the tests start) spawned or forked from the fork server.

    python benchmarks/agent_start.py --rounds 3

Each measurement runs in a fresh interpreter, so that nothing is imported or
cached before it. ``agent_old_path_ms`` forces the rdma backend's search for
a hardware provider that ``auto`` skips where sysfs lists no RDMA device.
Prints one JSON object of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

AGENT = """
import time, kvx
from kvx.backends import rdma
if {old}:
    rdma.rdma_hardware = lambda: True
t = time.perf_counter()
agent = kvx.Agent("probe", listen="127.0.0.1:0")
print((time.perf_counter() - t) * 1000)
agent.close()
"""

WORKERS = """
import time
from kvx._worker import Worker, WorkerConfig, use_forkserver
if __name__ == "__main__":
    if {forkserver}:
        use_forkserver()
    Worker(WorkerConfig("warm", 1 << 20)).stop()  # the fork server starts with the first
    times = []
    for i in range(8):
        t = time.perf_counter()
        worker = Worker(WorkerConfig(f"w{{i}}", 1 << 20))
        times.append((time.perf_counter() - t) * 1000)
        worker.stop()
    print(sorted(times)[len(times) // 2])
"""


def _run(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {
        "agent_ms": [],
        "agent_old_path_ms": [],
        "worker_spawned_ms": [],
        "worker_forked_ms": [],
    }
    for _ in range(args.rounds):  # alternating, so that a noisy minute hits every case
        runs["agent_ms"].append(_run(AGENT.format(old=False)))
        runs["agent_old_path_ms"].append(_run(AGENT.format(old=True)))
        runs["worker_spawned_ms"].append(_run(WORKERS.format(forkserver=False)))
        runs["worker_forked_ms"].append(_run(WORKERS.format(forkserver=True)))
    print(json.dumps({k: round(statistics.median(v), 1) for k, v in runs.items()} | {"rounds": args.rounds}))


if __name__ == "__main__":
    main()
