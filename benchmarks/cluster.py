"""The synthetic cluster through kvx proxy against kvx bench, for the same bytes, in one run.

    python benchmarks/cluster.py --rounds 3                      # llama-3.1-8b, 128 to 8k tokens
    python benchmarks/cluster.py --tokens 2048 --rounds 5 --backend tcp

The cluster is `kvx demo`'s (kvx/_demo.py): kvx metadata, synthetic kvx prefill
and kvx decode daemons, and kvx proxy finding them, each a child process. For
each prompt length (a word is a token), each round sends --requests streamed
completions one after the other through the proxy, then the same prompt once
straight to the decode daemon with no kv_transfer_params (a single engine: it
computes the KV itself), then runs kvx bench's measurement (kvx/_bench.py,
this process as the initiator agent, a worker process as the target) on the
same transfer: blocks x layers x planes non-adjacent descriptors of
block_size x token_plane_bytes each. Sizes and rounds alternate, so noise on a
shared machine hits all alike; the table gives medians over rounds.

Columns:
  req/s         completions per second through the proxy, one at a time
  path GB/s     KV bytes decode READ / wall time of those requests: the whole
                path (proxy, prefill computing the KV, the READ, decode
                checking every byte, the answer)
  xfer GB/s     the same bytes / the time decode spent in READs (its
                /metrics: kvx_transfer_duration_seconds, posted to done)
  bench GB/s    kvx bench, same bytes and descriptors, same run
  xfer ratio    xfer GB/s / bench GB/s: the daemon's agent against the bare agent
  path ratio    path GB/s / bench GB/s
  TTFT          time to the first streamed token through the proxy
  single TTFT   the same prompt on the decode daemon alone (no transfer)
  xfer ms       what the transfer adds to TTFT: decode's mean READ time per
                request (from its /metrics); the rest of TTFT - single TTFT
                is the prefill leg, the proxy and decode's byte check

Every P/D answer is compared with the single-engine answer, and decode's
kvx_blocks_verified_total with the blocks the prompts need. Prints a
Markdown table; --json-out keeps every sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import httpx

from kvx import _bench, _demo
from kvx.daemon.shapes import PRESETS

BLOCK_TOKENS = _demo.BLOCK_TOKENS
GiB = 1 << 30


def requests_for(nbytes: int, cap: int) -> int:
    """Completions per size and round: about 1 GiB of KV, 2 at least."""
    return max(2, min(cap, GiB // nbytes))


def one_round(
    cluster: _demo.LocalCluster,
    client: httpx.Client,
    session: _bench._Session,
    tokens: int,
    requests: int,
    seed: int,
) -> dict[str, Any]:
    shape = cluster.shape
    blocks = -(-tokens // BLOCK_TOKENS)
    pieces = blocks * shape.layers * shape.planes
    piece_bytes = BLOCK_TOKENS * shape.token_plane_bytes
    nbytes = pieces * piece_bytes
    model = f"kvx-synthetic-{shape.name}"
    prompts = [_demo.words_prompt(tokens, seed * 1000 + i) for i in range(requests)]
    decode_admin = cluster.admin_url["decode"]

    before = _demo.decode_totals(decode_admin)
    ttft, answers = [], []
    start = time.perf_counter()
    for prompt in prompts:
        first, _, text = _demo.stream_completion(client, cluster.proxy_url, model, prompt, 16)
        ttft.append(first)
        answers.append(text)
    wall_s = time.perf_counter() - start
    moved = _demo.decode_totals(decode_admin) - before
    # The single engine: the decode daemon computes the KV itself; no transfer, no check.
    single_first, _, single_text = _demo.stream_completion(
        client, cluster.api_url["decode"], model, prompts[0], 16
    )
    if answers[0] != single_text:
        raise RuntimeError(f"{tokens} tokens: the P/D answer differs from the single-engine answer")
    want_blocks = requests * pieces
    if moved.bytes != requests * nbytes or moved.blocks_verified != want_blocks or moved.verify_failures:
        raise RuntimeError(
            f"{tokens} tokens: decode moved {moved.bytes:.0f} bytes and verified {moved.blocks_verified:.0f} "
            f"blocks; the prompts need {requests * nbytes} and {want_blocks}"
        )

    iters = max(3, min(20, GiB // nbytes))
    bench = session.measure("read", piece_bytes, pieces, iters, warmup=1)
    if not bench["verified"]:
        raise RuntimeError(f"{tokens} tokens: kvx bench's bytes did not verify")
    return {
        "tokens": tokens,
        "requests": requests,
        "bytes_per_request": nbytes,
        "descriptors": pieces,
        "descriptor_bytes": piece_bytes,
        "req_per_s": requests / wall_s,
        "path_gbps": moved.bytes / wall_s / 1e9,
        "xfer_gbps": moved.bytes / moved.seconds / 1e9,
        "xfer_ms": moved.seconds / moved.transfers * 1e3,
        "ttft_ms": statistics.median(ttft) * 1e3,
        "single_ttft_ms": single_first * 1e3,
        "backend": ",".join(sorted(moved.backends)),
        "bench_gbps": bench["throughput_gbps"],
        "bench_limit_gbps": bench["limit_gbps"],
        "bench_limit": bench["limit"],
    }


def median_row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(samples[0])
    for key in ("req_per_s", "path_gbps", "xfer_gbps", "xfer_ms", "ttft_ms", "single_ttft_ms", "bench_gbps"):
        row[key] = statistics.median(s[key] for s in samples)
    row["bench_limit_gbps"] = statistics.median(s["bench_limit_gbps"] for s in samples)
    row["xfer_ratio"] = statistics.median(s["xfer_gbps"] / s["bench_gbps"] for s in samples)
    row["path_ratio"] = statistics.median(s["path_gbps"] / s["bench_gbps"] for s in samples)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt tokens | KV per request | req/s | path GB/s | xfer GB/s | bench GB/s | xfer ratio "
        "| path ratio | TTFT ms | single TTFT ms | xfer ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['bytes_per_request'] / (1 << 20):,.0f} MiB | {r['req_per_s']:.2f} "
            f"| {r['path_gbps']:.3f} | {r['xfer_gbps']:.3f} | {r['bench_gbps']:.3f} | {r['xfer_ratio']:.2f} "
            f"| {r['path_ratio']:.2f} | {r['ttft_ms']:.0f} | {r['single_ttft_ms']:.0f} | {r['xfer_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="llama-3.1-8b", choices=list(PRESETS))
    parser.add_argument(
        "--tokens",
        default="128,512,2048,4096,8192",
        help="prompt lengths in tokens (words), comma-separated (default: 128,512,2048,4096,8192)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the table gives medians (default: 3)")
    parser.add_argument(
        "--requests", type=int, default=8, help="most completions per size and round (default: 8)"
    )
    parser.add_argument(
        "--backend", default="auto", help="the daemons' and kvx bench's backend (default: auto)"
    )
    parser.add_argument("--json-out", help="write every sample here")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    shape = PRESETS[args.model_shape]
    per_block = BLOCK_TOKENS * shape.token_bytes
    # One prompt at a time: the longest prompt's blocks and a spare few.
    num_blocks = -(-max(sizes) // BLOCK_TOKENS) + 8
    biggest = -(-max(sizes) // BLOCK_TOKENS) * per_block
    print(
        f"# {args.model_shape}: {shape.token_bytes / 1024:.0f} KiB of KV per token, pools of {num_blocks} blocks "
        f"x {per_block / (1 << 20):.0f} MiB = {num_blocks * per_block / GiB:.2f} GiB per daemon; kvx bench "
        f"pools of {2 * biggest / GiB:.2f} GiB per side",
        file=sys.stderr,
    )
    samples: dict[int, list[dict[str, Any]]] = {t: [] for t in sizes}
    daemon_args = ("--backend", args.backend, "--lease-s", "600", "--transfer-timeout-s", "120")
    with (
        _demo.LocalCluster(
            args.model_shape, num_blocks, daemon_args, say=lambda t: print(t, file=sys.stderr)
        ) as cluster,
        httpx.Client(trust_env=False, timeout=httpx.Timeout(600.0, connect=10.0)) as client,
    ):
        session = _bench._Session(2 * biggest, 1, args.backend, "host")
        try:
            for rnd in range(args.rounds):
                for tokens in sizes:
                    nbytes = -(-tokens // BLOCK_TOKENS) * per_block
                    sample = one_round(
                        cluster,
                        client,
                        session,
                        tokens,
                        requests_for(nbytes, args.requests),
                        rnd * 100 + tokens,
                    )
                    samples[tokens].append(sample)
                    print(
                        f"round {rnd + 1}/{args.rounds} {tokens:>5} tokens: {sample['req_per_s']:.2f} req/s, "
                        f"path {sample['path_gbps']:.3f} GB/s, xfer {sample['xfer_gbps']:.3f} GB/s, "
                        f"bench {sample['bench_gbps']:.3f} GB/s, TTFT {sample['ttft_ms']:.0f} ms "
                        f"(single {sample['single_ttft_ms']:.0f} ms), xfer {sample['xfer_ms']:.1f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
            about = session.describe()
        finally:
            session.close()
    rows = [median_row(samples[t]) for t in sizes]
    print(
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores; {args.model_shape}, "
        f"{args.rounds} rounds, daemons over {rows[0]['backend']}, kvx bench over {about['backend']} "
        f"({about['data_path']} data path), limit {rows[0]['bench_limit']}\n"
    )
    print(table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "samples": samples}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
