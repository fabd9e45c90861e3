"""GPU memory: kvx's cuda_ipc and staged-tcp paths against their limits, in one run.

    pip install -e '.[gpu]'
    python benchmarks/gpu_side_by_side.py --rounds 5 --json-out gpu.json

Needs a CUDA device. Workload: one READ of 1,000 non-adjacent 32 KiB blocks
(32,768,000 bytes) between two processes on one host, both pools on CUDA
device 0. Each round runs, in turn (every `kvx bench` alternates kvx's
transfers with its limit's, so noise hits both alike):
  - cuda_ipc, copies by kvx's kernel (KVX_CUDA_COPY=kernel), against one
    cudaMemcpyAsync of the same size device to device;
  - cuda_ipc, copies by one cudaMemcpyAsync per block (KVX_CUDA_COPY=memcpy);
  - tcp with GPU memory (staged through pinned host buffers), against the raw
    socket limit over host memory;
  - tcp with host memory, against the same raw socket limit.
Targets (issue 5): cuda_ipc at least 0.70 of the device-to-device copy; GPU
over tcp at least 0.80 of the host-memory tcp rate. The table gives medians
over rounds of each round's median; prints Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from side_by_side import run_json  # noqa: E402

CONTENDERS = {
    "cuda_ipc, kernel": (["--memory", "cuda", "--backend", "cuda_ipc"], {"KVX_CUDA_COPY": "kernel"}),
    "cuda_ipc, memcpy per block": (
        ["--memory", "cuda", "--backend", "cuda_ipc"],
        {"KVX_CUDA_COPY": "memcpy"},
    ),
    "tcp, GPU memory (staged)": (["--memory", "cuda", "--backend", "tcp"], {}),
    "tcp, host memory": (["--memory", "host", "--backend", "tcp"], {}),
}


def bench(args: list[str], env: dict[str, str], iters: int) -> dict:
    return run_json(
        [sys.executable, "-m", "kvx.cli", "bench", "--json", "--iters", str(iters), *args], env=env
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="transfers per round and contender")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        for name, (bench_args, env) in CONTENDERS.items():
            result = bench(bench_args, env, args.iters)
            if not result["verified"]:
                raise RuntimeError(f"{name}: kvx bench could not verify the bytes it moved")
            samples[name].append(result)
            print(
                f"round {r}: {name}: {result['throughput_gbps']:.2f} GB/s, {result['limit']} "
                f"{result['limit_gbps']:.2f} GB/s, ratio {result['ratio']:.2f}",
                file=sys.stderr,
            )

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    host_tcp = [s["throughput_gbps"] for s in samples["tcp, host memory"]]
    gpu_tcp = [s["throughput_gbps"] for s in samples["tcp, GPU memory (staged)"]]
    gpu_vs_host = statistics.median(g / h for g, h in zip(gpu_tcp, host_tcp, strict=True))
    print(
        f"GPU benchmark, {datetime.date.today()}, {platform.node()}, {args.rounds} rounds x {args.iters} "
        "transfers of 1,000 x 32 KiB (READ)\n"
    )
    print("| contender | kvx GB/s | limit | limit GB/s | ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for name in CONTENDERS:
        ratios = [s["ratio"] for s in samples[name]]
        print(
            f"| {name} | {med(name, 'throughput_gbps'):.2f} | {samples[name][0]['limit']} | "
            f"{med(name, 'limit_gbps'):.2f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    print(f"\nGPU over tcp / host over tcp, per round, median: {gpu_vs_host:.2f}")
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"samples": samples, "gpu_tcp_vs_host_tcp": gpu_vs_host}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
