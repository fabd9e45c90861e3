"""Same-host transfers: kvx's shm backend, the process_vm_readv limit and NIXL, in one run.

    bash benchmarks/peers/setup.sh                     # once, for NIXL
    python benchmarks/shm_side_by_side.py --rounds 5

Workload: one READ of 1,000 non-adjacent 32 KiB blocks (32,768,000 bytes)
between two processes. Each round runs, in turn:
  - `kvx bench --backend shm` with its defaults: kvx's transfers alternate
    with one process_vm_readv of exactly the same ranges (the limit);
  - NIXL (UCX) tuned as it needs to be here: progress thread off, UCX error
    handling none, once with UCX_TLS=cma,tcp and once with UCX_TLS=sm,tcp.
The table gives medians over rounds of each round's median; NIXL's best is the
better of its two transports in each round. Prints Markdown; --json-out keeps
every sample.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from side_by_side import PEER_PY, kvx_bench  # noqa: E402

NIXL_TLS = ("cma,tcp", "sm,tcp")


def nixl(tls: str, iters: int) -> dict:
    cmd = [
        str(PEER_PY),
        str(HERE / "peers" / "nixl_bench.py"),
        "--json-only",
        "--iters",
        str(iters),
        "--lat-iters",
        "200",
        "--err-mode",
        "none",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, UCX_TLS=tls),
    )
    if out.returncode != 0:
        raise RuntimeError(f"NIXL with UCX_TLS={tls} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="transfers per round and contender")
    parser.add_argument("--no-nixl", action="store_true", help="kvx and the limit only")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    use_nixl = not args.no_nixl
    if use_nixl and not PEER_PY.exists():
        print("run `bash benchmarks/peers/setup.sh` first, or pass --no-nixl", file=sys.stderr)
        return 2
    rows: dict[str, list] = {"kvx": [], **{tls: [] for tls in NIXL_TLS}}
    for r in range(args.rounds):
        rows["kvx"].append(kvx_bench("--backend", "shm", "--iters", str(args.iters)))
        if use_nixl:
            for tls in NIXL_TLS:
                rows[tls].append(nixl(tls, args.iters))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = statistics.median
    kv = rows["kvx"]
    limit = med(k["limit_gbps"] for k in kv)
    lines = [
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores, kernel "
        f"{platform.release()}; kvx data path: {kv[0]['data_path']}, {kv[0]['streams']} lanes; "
        f"{args.rounds} rounds of {args.iters} transfers, medians over rounds.",
        "",
        "| contender | GB/s | vs process_vm_readv |",
        "|---|---|---|",
        f"| process_vm_readv, same ranges (limit) | {limit:.2f} | 1.00 |",
        f"| kvx shm (defaults) | {med(k['throughput_gbps'] for k in kv):.2f} | {med(k['ratio'] for k in kv):.2f} |",
    ]
    if use_nixl:
        for tls in NIXL_TLS:
            gbps = med(n["throughput_gbps"] for n in rows[tls])
            lines.append(
                f"| NIXL 1.5.0, UCX_TLS={tls}, no progress thread, error handling none | {gbps:.2f} | "
                f"{gbps / limit:.2f} |"
            )
        best = [max(rows[tls][i]["throughput_gbps"] for tls in NIXL_TLS) for i in range(args.rounds)]
        lines.append(f"| NIXL, best of the two per round | {med(best):.2f} | {med(best) / limit:.2f} |")
        lines.append("")
        wins = sum(k["throughput_gbps"] >= b for k, b in zip(kv, best, strict=True))
        lines.append(f"kvx at least NIXL's best in {wins} of {args.rounds} rounds.")
    print("\n".join(lines))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
