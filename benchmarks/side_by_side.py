"""kvx, the raw loopback socket, NIXL and Mooncake on the same workloads, in one run.

    python benchmarks/side_by_side.py --rounds 5            # kvx and the raw limit only
    bash benchmarks/peers/setup.sh                           # once, for the peers
    python benchmarks/side_by_side.py --rounds 5 --peers     # all four

Workloads (the issue's KV pattern), two processes on loopback:
  A  one READ of 1,000 non-adjacent 32 KiB blocks (32,768,000 bytes)
  B  one READ of a single 4 KiB block (latency)
  C  building descriptors for 262,144 blocks from a block-id array
Each round runs every contender once, in turn, so noise on a shared machine
hits all of them; the table gives the median over rounds of each round's
median. kvx's raw-socket limit is measured inside kvx bench, interleaved with
kvx's own transfers. Prints a Markdown table; --json-out keeps every sample.
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
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEER_PY = HERE / "peers" / ".venv" / "bin" / "python"


def run_json(cmd: list[str], timeout_s: float = 600, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd``; the JSON object on its last line of output."""
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, **env) if env else None,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kvx_bench(*args: str) -> dict:
    return run_json([sys.executable, "-m", "kvx.cli", "bench", "--json", *args])


def descs_build_ms(reps: int = 21) -> float:
    from kvx import Descs

    ids = np.random.default_rng(0).permutation(262_144)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        Descs.from_blocks(1, ids, 32_768)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="transfers per round, workload A")
    parser.add_argument("--lat-iters", type=int, default=2000, help="transfers per round, workload B")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--peers", action="store_true", help="also run NIXL and Mooncake (benchmarks/peers)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.peers and not PEER_PY.exists():
        print("run `bash benchmarks/peers/setup.sh` first", file=sys.stderr)
        return 2

    samples: dict[str, list[dict]] = {"kvx": [], "kvx_lat": [], "nixl": [], "mooncake": []}
    build_ms = []
    for r in range(args.rounds):
        samples["kvx"].append(kvx_bench("--iters", str(args.iters), "--streams", str(args.streams)))
        samples["kvx_lat"].append(
            kvx_bench(
                "--blocks", "1", "--block-size", "4KiB", "--iters", str(args.lat_iters), "--warmup", "200"
            )
        )
        build_ms.append(descs_build_ms())
        if args.peers:
            common = ["--json-only", "--iters", str(args.iters), "--lat-iters", str(args.lat_iters)]
            samples["nixl"].append(run_json([str(PEER_PY), str(HERE / "peers" / "nixl_bench.py"), *common]))
            samples["mooncake"].append(
                run_json([str(PEER_PY), str(HERE / "peers" / "mooncake_bench.py"), *common])
            )
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    kv, lat = samples["kvx"], samples["kvx_lat"]
    lines = [
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; kvx data path: {kv[0]['data_path']}; "
        f"{args.rounds} rounds, medians over rounds.",
        "",
        "| contender | A: GB/s | A: vs raw socket | B: 4 KiB READ p50 us | B: p99 us | C: build 262,144 descs ms |",
        "|---|---|---|---|---|---|",
        f"| raw loopback socket (limit) | {med(kv, 'limit_gbps'):.2f} | 1.00 | "
        f"{med(lat, 'limit_latency_us_p50'):.1f} | | |",
        f"| kvx (tcp, {args.streams} stream) | {med(kv, 'throughput_gbps'):.2f} | {med(kv, 'ratio'):.2f} | "
        f"{med(lat, 'latency_us_p50'):.1f} | {med(lat, 'latency_us_p99'):.1f} | {statistics.median(build_ms):.2f} |",
    ]
    limit = med(kv, "limit_gbps")
    for name, label in (("nixl", "NIXL 1.5.0 (UCX tcp)"), ("mooncake", "Mooncake TE 0.3.13.post1 (tcp)")):
        rows = samples[name]
        if rows:
            prep = med(rows, "prepare_ms") if rows[0].get("prepare_ms") is not None else None
            lines.append(
                f"| {label} | {med(rows, 'throughput_gbps'):.2f} | {med(rows, 'throughput_gbps') / limit:.2f} | "
                f"{med(rows, 'lat4k_us_p50'):.1f} | {med(rows, 'lat4k_us_p99'):.1f} | "
                f"{'' if prep is None else f'{prep:.2f}'} |"
            )
    print("\n".join(lines))
    if args.json_out:
        args.json_out.write_text(json.dumps({"samples": samples, "descs_build_ms": build_ms}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
