"""Same host without cross-memory attach: kvx over shared segments, against
memcpy of the same ranges, and against kvx with attach, in one run.

    sudo python benchmarks/shm_segments.py --rounds 5     # needs root: drops CAP_SYS_PTRACE in a child

The target is a worker whose pool comes from kvx.alloc_shared. Each round
runs two initiator processes in turn:
  - one without CAP_SYS_PTRACE, so attach is refused and kvx maps the
    target's segments; its limit is one memcpyv of exactly the same ranges
    from the mapped segment, with nothing around it;
  - one with it, so kvx uses process_vm_readv; its limit is one
    process_vm_readv of the same ranges.
Workload: READ of 1,000 non-adjacent 32 KiB blocks. Medians over rounds of
each round's median; prints Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

BLOCK = 32 * 1024
BLOCKS = 1000

_INITIATOR = """
import json, sys, time, numpy as np, kvx
from kvx._datapath import io as _io
md, iters = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
BLOCK, BLOCKS = 32 * 1024, 1000
with kvx.Agent("bench-initiator") as agent:
    pool = np.zeros(2 * BLOCK * BLOCKS, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(md)
    ids = np.arange(0, 2 * BLOCKS, 2)
    local = kvx.Descs.from_blocks(region, ids, BLOCK)
    remote = kvx.Descs.from_blocks(peer.regions[0], ids, BLOCK)
    la = (region.address + ids * BLOCK).astype(np.uint64)
    lens = np.full(BLOCKS, BLOCK, np.uint64)
    maps = getattr(peer._channel, "segment_maps", {})
    if maps:
        ra = (maps[peer.regions[0].id].base + ids * BLOCK).astype(np.uint64)
        limit = lambda: _io.memcpyv(la, ra, lens)
    else:
        ra = (peer.regions[0].address + ids * BLOCK).astype(np.uint64)
        pid = peer._channel.pid
        limit = lambda: _io.vm_readv(pid, la, lens, ra, lens)
    mine, base = [], []
    for i in range(iters + 3):
        t = time.perf_counter(); limit(); lt = time.perf_counter() - t
        t = time.perf_counter(); peer.read(local, remote).wait(30); kt = time.perf_counter() - t
        if i >= 3:
            mine.append(kt); base.append(lt)
    n = BLOCK * BLOCKS
    print(json.dumps({"backend": peer.backend, "segments": bool(maps),
                      "kvx_gbps": n / sorted(mine)[len(mine) // 2] / 1e9,
                      "limit_gbps": n / sorted(base)[len(base) // 2] / 1e9}))
"""


def run(md: bytes, iters: int, unprivileged: bool) -> dict:
    from kvx._spawn import launched

    out = subprocess.run(
        # without CAP_SYS_PTRACE: root may then no longer attach to this process
        launched(
            [sys.executable, "-c", _INITIATOR, md.hex(), str(iters)],
            drop_capabilities=[19] if unprivileged else [],  # CAP_SYS_PTRACE
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"initiator failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: a child drops CAP_SYS_PTRACE to be refused attach", file=sys.stderr)
        return 2
    from kvx._worker import Worker, WorkerConfig

    rows: dict[str, list[dict]] = {"segments": [], "attach": []}
    with Worker(WorkerConfig("bench-target", 2 * BLOCK * BLOCKS, shared=True)) as worker:
        for r in range(args.rounds):
            for name, unprivileged in (("segments", True), ("attach", False)):
                result = run(worker.metadata, args.iters, unprivileged)
                if result["segments"] != unprivileged:
                    raise RuntimeError(f"{name}: expected segments={unprivileged}, got {result}")
                rows[name].append(result)
                print(
                    f"round {r}: {name}: kvx {result['kvx_gbps']:.2f} GB/s, limit {result['limit_gbps']:.2f}",
                    file=sys.stderr,
                )
    print(
        f"Shared segments, {datetime.date.today()}, {platform.node()}, {args.rounds} rounds x {args.iters} READs "
        "of 1,000 x 32 KiB\n"
    )
    print("| path | kvx GB/s | limit | limit GB/s | ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for name, limit in (("segments", "memcpy of the ranges"), ("attach", "process_vm_readv")):
        ratios = [x["kvx_gbps"] / x["limit_gbps"] for x in rows[name]]
        print(
            f"| {name} | {statistics.median(x['kvx_gbps'] for x in rows[name]):.2f} | {limit} | "
            f"{statistics.median(x['limit_gbps'] for x in rows[name]):.2f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    seg_vs_attach = statistics.median(
        s["kvx_gbps"] / a["kvx_gbps"] for s, a in zip(rows["segments"], rows["attach"], strict=True)
    )
    print(f"\nkvx over segments / kvx over attach, per round, median: {seg_vs_attach:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
