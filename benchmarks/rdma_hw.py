"""The rdma backend on a NIC: registration time per GiB, the transfer curve
against the port's line rate, and striping over several NICs.

    python benchmarks/rdma_hw.py --provider verbs               # every device ibv_devices lists
    python benchmarks/rdma_hw.py --provider efa --devices rdmap16s27,rdmap32s27
    python benchmarks/rdma_hw.py --provider "tcp;ofi_rxm" --devices lo   # a dry run anywhere

Made for a host with RDMA NICs (scripts/rdma_check.sh runs it there); the
issue's goals are >= 90% of line rate per NIC for pieces of 64 KiB and more,
and striping over 4 NICs >= 3.5x one NIC. Three parts, medians of --rounds:

1. Registration: register --gib GiB of host memory (touched first, so the
   time is the registration's, not the page faults') with one endpoint, and
   of GPU memory when CuPy sees a GPU; seconds per GiB.
2. The curve: ``kvx bench --sweep --backend rdma`` between two processes on
   this host (loopback through the first NIC), each size's throughput
   against the NIC's line rate read from sysfs
   (/sys/class/infiniband/<dev>/ports/<n>/rate).
3. Striping: a 64 MiB transfer with KVX_RDMA_DEVICES naming 1, 2 and 4 NICs
   (as many as there are), aggregate throughput against one NIC's.

Loopback through one port moves each byte through that port twice (out and
in), so a NIC's loopback throughput can stay below its line rate; between
two hosts run ``kvx bench --backend rdma`` on each pair instead. Prints
Markdown for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZES = "64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
STRIPE_BYTES = 64 << 20


def devices() -> list[str]:
    """RDMA devices in /sys/class/infiniband, in name order."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def line_rate_gbps(device: str, port: int = 1) -> float | None:
    """The port's rate in GB/s (sysfs says e.g. "400 Gb/sec (4X NDR)")."""
    try:
        text = Path(f"/sys/class/infiniband/{device}/ports/{port}/rate").read_text()
    except OSError:
        return None
    match = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(match.group(1)) / 8 if match else None


def open_endpoint(provider: str, device: str | None) -> Any:
    if provider == "verbs":
        from kvx.backends.rdma import verbs

        return verbs.Endpoint(device, 1)
    from kvx.backends.rdma import fabric

    return fabric.Endpoint(provider=provider, domain=device)


def registration(provider: str, device: str | None, gib: int, rounds: int) -> dict[str, float]:
    """Median seconds per GiB to register host (and GPU) memory."""
    out: dict[str, float] = {}
    ep = open_endpoint(provider, device)
    try:
        host = np.ones(gib << 30, dtype=np.uint8)  # touched: faults are not the registration's
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            mr = ep.register(host.ctypes.data, host.nbytes, remote_read=True, remote_write=True)
            times.append(time.perf_counter() - start)
            mr.close()
        out["host"] = statistics.median(times) / gib
        try:
            import cupy  # type: ignore[import-not-found]

            gpu = cupy.ones(gib << 30, dtype=cupy.uint8)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                mr = ep.register(gpu.data.ptr, gpu.nbytes, remote_read=True, remote_write=True, device=0)
                times.append(time.perf_counter() - start)
                mr.close()
            out["gpu"] = statistics.median(times) / gib
        except ImportError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
            print(f"GPU memory registration failed: {exc}", file=sys.stderr)
    finally:
        ep.close()
    return out


def bench(provider: str, devices: list[str], sizes: str, rounds: int) -> list[dict[str, Any]]:
    """``kvx bench --sweep`` over rdma --rounds times; per size the median point."""
    env = dict(os.environ, KVX_RDMA_PROVIDER=provider)
    if devices:
        env["KVX_RDMA_DEVICES"] = ",".join(devices)
    runs = []
    for _ in range(rounds):
        cmd = [
            sys.executable,
            "-m",
            "kvx",
            "bench",
            "--backend",
            "rdma",
            "--sweep",
            "--sizes",
            sizes,
            "--json",
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"kvx bench failed ({done.returncode}): {done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout)["points"])
    points = []
    for i, first in enumerate(runs[0]):
        gbps = statistics.median(run[i]["throughput_gbps"] for run in runs)
        p50 = statistics.median(run[i]["latency_us_p50"] for run in runs)
        points.append({"bytes": first["bytes"], "gbps": gbps, "p50_us": p50})
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="verbs", help='verbs, efa, "verbs;ofi_rxm", "tcp;ofi_rxm"')
    parser.add_argument("--devices", default="", help="comma-separated NICs (default: every RDMA device)")
    parser.add_argument("--gib", type=int, default=1, help="GiB registered per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default=SIZES, help=f"transfer sizes of the curve (default {SIZES})")
    args = parser.parse_args()
    nics = [d for d in args.devices.split(",") if d] or devices()
    first = nics[0] if nics else None
    rate = line_rate_gbps(first) if first else None
    print(f"provider {args.provider}; NICs {', '.join(nics) or 'none listed'}; line rate of {first}: "
          f"{f'{rate:.1f} GB/s' if rate else 'unknown'}\n")  # fmt: skip

    print("## Registration time per GiB\n\n| memory | s per GiB |\n|---|---:|")
    for kind, seconds in registration(args.provider, first, args.gib, args.rounds).items():
        print(f"| {kind} | {seconds:.4f} |")

    print(f"\n## One NIC ({first}), kvx bench --sweep --backend rdma\n")
    print("| size | GB/s | of line rate | p50 µs |\n|---:|---:|---:|---:|")
    for p in bench(args.provider, nics[:1], args.sizes, args.rounds):
        share = f"{p['gbps'] / rate:.2f}" if rate else "-"
        print(f"| {p['bytes'] >> 10} KiB | {p['gbps']:.2f} | {share} | {p['p50_us']:.0f} |")

    counts = sorted({n for n in (1, 2, 4) if n <= len(nics)})
    if len(counts) > 1:
        print(f"\n## Striping a {STRIPE_BYTES >> 20} MiB transfer\n")
        print("| NICs | GB/s | against one NIC |\n|---:|---:|---:|")
        one = None
        for n in counts:
            (point,) = bench(args.provider, nics[:n], str(STRIPE_BYTES >> 10) + "KiB", args.rounds)
            one = one or point["gbps"]
            print(f"| {n} | {point['gbps']:.2f} | {point['gbps'] / one:.2f}x |")


if __name__ == "__main__":
    main()
