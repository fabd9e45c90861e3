"""The scale point of `kvx plan simulate`: 100,000 nodes for ten simulated minutes.

    python benchmarks/plan_sim.py                 # the scale point (prints wall time, events/s, RSS)
    python benchmarks/plan_sim.py --duration 60   # a shorter run of the same cluster

The cluster: 20,000 prefill and 80,000 decode nodes (one instance each), a 70B-class
model (320 KiB of KV per token: 80 layers x 8 KV heads x 128 x 2 x bf16), prefill at
20,000 tokens/s per instance, prompts of 1k, 4k and 16k tokens (2:2:1, mean 5,325),
one 400 Gbit/s NIC per node (20 us + bytes / 50 GB/s), 32 nodes per leaf and a 2:1
oversubscribed spine, 8 agents per node, a 64-core metadata service, and 0.001 node
failures per node-hour. The rate puts each prefill instance at 60% utilisation:
0.6 x 20,000 x 20,000 / 5,325 = 45,070 requests/s, about 27 million requests.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from kvx.plan.simulate import MetadataLoad, SimConfig, format_result, simulate

KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2
PROMPTS = [(1024, 2.0), (4096, 2.0), (16384, 1.0)]
MEAN_PROMPT = sum(t * w for t, w in PROMPTS) / sum(w for _, w in PROMPTS)
NIC_BYTES_PER_S = 400e9 / 8


def config(duration_s: float, prefill: int, decode: int, seed: int) -> SimConfig:
    prefill_tokens_per_s = 20_000.0
    return SimConfig(
        prefill=prefill,
        decode=decode,
        rate=0.6 * prefill * prefill_tokens_per_s / MEAN_PROMPT,
        prompt_tokens=PROMPTS,
        prefill_tokens_per_s=prefill_tokens_per_s,
        request_bytes=lambda tokens: tokens * KV_BYTES_PER_TOKEN,
        transfer_s=lambda nbytes: 20e-6 + nbytes / NIC_BYTES_PER_S,
        nic_bytes_per_s=NIC_BYTES_PER_S,
        spine_oversubscription=2.0,
        nodes_per_leaf=32,
        metadata=MetadataLoad(cores=64),
        failure_rate=0.001,
        restart_s=120.0,
        duration_s=duration_s,
        warmup_s=min(30.0, duration_s / 10),
        seed=seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds (default 600)")
    parser.add_argument("--prefill", type=int, default=20_000)
    parser.add_argument("--decode", type=int, default=80_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args(argv)
    cfg = config(args.duration, args.prefill, args.decode, args.seed)
    started = time.monotonic()
    result = simulate(cfg)
    wall_s = time.monotonic() - started
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_result(cfg, result))
    print(
        f"scale: {args.prefill + args.decode:,} nodes, {args.duration:g} s simulated, "
        f"{result.requests['arrived']:,} requests counted: wall {wall_s:.1f} s, "
        f"{result.sim['events'] / wall_s:,.0f} events/s, max RSS {rss_mib:,.0f} MiB",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
