"""The transfer-size curve side by side: kvx (``kvx bench --sweep``, with
its limit measured in the same run), NIXL and Mooncake (``--sweep`` of
``benchmarks/peers/``), in rounds, each contender in turn; medians of the
rounds per size.

    bash benchmarks/peers/setup.sh
    python benchmarks/sweep_peers.py --rounds 5 --backends tcp,shm
    python benchmarks/sweep_peers.py --kvx before=/path/to/old/checkout --kvx after=. --skip-peers

``--kvx LABEL=DIR`` (repeatable) runs the kvx of another checkout too, to
compare two versions in one run (its C extensions must be built there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_PYTHON = HERE / "peers" / ".venv" / "bin" / "python"


def run_json(cmd: list[str], cwd: Path, timeout_s: float = 900) -> dict:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="tcp", help="kvx backends, comma-separated (default: tcp)")
    parser.add_argument(
        "--kvx", action="append", default=[], metavar="LABEL=DIR", help="kvx checkouts to run"
    )
    parser.add_argument("--skip-peers", action="store_true", help="kvx only")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    checkouts = [tuple(k.split("=", 1)) for k in args.kvx] or [("kvx", str(ROOT))]
    contenders: list[tuple[str, list[str], Path]] = []
    for label, path in checkouts:
        for backend in args.backends.split(","):
            cmd = [sys.executable, "-m", "kvx", "bench", "--sweep", "--backend", backend, "--json"]
            contenders.append((f"{label} {backend}", cmd, Path(path).resolve()))
    if not args.skip_peers:
        if not PEER_PYTHON.exists():
            print("run bash benchmarks/peers/setup.sh first (or --skip-peers)", file=sys.stderr)
            return 2
        for peer in ("nixl", "mooncake"):
            cmd = [str(PEER_PYTHON), str(HERE / "peers" / f"{peer}_bench.py"), "--sweep", "--json-only"]
            contenders.append((peer, cmd, ROOT))
    raw: dict[str, list[dict]] = {name: [] for name, _, _ in contenders}
    for r in range(args.rounds):
        for name, cmd, cwd in contenders:
            started = time.monotonic()
            raw[name].append(run_json(cmd, cwd))
            print(
                f"round {r + 1}/{args.rounds}: {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr
            )
    # Per contender and size: medians over the rounds.
    medians: dict[str, dict[int, dict[str, float]]] = {}
    for name, results in raw.items():
        per_size: dict[int, list[dict]] = {}
        for result in results:
            for p in result.get("points") or result.get("sweep"):
                if not p["verified"]:
                    raise RuntimeError(f"{name}: {p['bytes']} bytes not verified")
                per_size.setdefault(p["bytes"], []).append(p)
        medians[name] = {
            size: {
                key: statistics.median(p[key] for p in pts)
                for key in pts[0]
                if isinstance(pts[0][key], float)
            }
            for size, pts in per_size.items()
        }
    sizes = sorted({s for m in medians.values() for s in m})
    print(f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, medians of {args.rounds} rounds; READ\n")
    header = "| size |"
    for name in medians:
        header += f" {name} GB/s | p50 us | p99 us |"
        if "limit_gbps" in next(iter(medians[name].values())):
            header += " limit GB/s | ratio |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for size in sizes:
        row = f"| {_size(size)} |"
        for m in medians.values():
            p = m.get(size)
            has_limit = "limit_gbps" in next(iter(m.values()))
            if p is None:
                row += " | | |" + (" | |" if has_limit else "")
                continue
            row += f" {p['throughput_gbps']:.3f} | {p['latency_us_p50']:.1f} | {p['latency_us_p99']:.1f} |"
            if has_limit:
                row += f" {p['limit_gbps']:.3f} | {p['ratio']:.2f} |"
        print(row)
    for name, results in raw.items():
        pp = [r["pingpong"] for r in results if "pingpong" in r]
        if pp:
            print(
                f"\n{name}: 4 KiB p50 {statistics.median(p['kvx_us_p50'] for p in pp):.1f} us against a bare "
                f"socket ping-pong of {statistics.median(p['socket_us_p50'] for p in pp):.1f} us in the same "
                f"runs: {statistics.median(p['ratio_p50'] for p in pp):.2f}x",
                end="",
            )
    print()
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {"raw": raw, "medians": {k: {str(s): v for s, v in m.items()} for k, m in medians.items()}}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
