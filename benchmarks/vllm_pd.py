"""Disaggregated prefill/decode with real vLLM engines: KvxConnector against NixlConnector.

Starts a P/D pair of CPU vLLM engines (tiny random-weight Llama) wired with
KvxConnector, then one wired with vLLM's own NixlConnector, each behind
``kvx proxy``, one pair at a time (an idle NIXL engine keeps polling and
would slow the other pair down), alternating the order round by round, with
the same prompts for both:

- time to first token (streamed, through the proxy) of single requests;
- total time of single requests and of a batch of concurrent requests.

Prompts are distinct random token ids (no prefix-cache hits). Reports
medians over rounds, and the kvx/NIXL ratio (lower is better for kvx).

    KVX_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_pd.py --rounds 5

The vLLM environment needs ``nixl==1.5.0`` for the NIXL pair
(``.venv-vllm/bin/pip install nixl==1.5.0 torch==2.13.0``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port, vllm_python  # noqa: E402


def start_pair(name: str, model: Path, tmp: Path, connector: str) -> list[Engine]:
    if connector == "kvx":
        p_cfg = {"kv_connector": "KvxConnector", "kv_role": "kv_producer"}
        d_cfg = {"kv_connector": "KvxConnector", "kv_role": "kv_consumer"}
        p_env = d_env = {}
    else:
        p_cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        d_cfg = dict(p_cfg)
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    prefill = Engine(f"{name}-prefill", model, tmp, p_cfg, p_env)
    decode = Engine(f"{name}-decode", model, tmp, d_cfg, d_env)
    return [prefill, decode]


def start_proxy(name: str, prefill: Engine, decode: Engine, tmp: Path) -> tuple[Proc, str]:
    port = free_port()
    proxy = Proc(
        f"{name}-proxy",
        [
            sys.executable,
            "-m",
            "kvx",
            "proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--timeout-s",
            "300",
        ],
        dict(os.environ),
        tmp / f"{name}-proxy.log",
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proxy, url
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError(f"{name} proxy not ready:\n{proxy.tail()}")


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(ttft_s, total_s, tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    tokens.extend(choice["token_ids"])
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--singles", type=int, default=4, help="sequential requests per round")
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests per round")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--connectors", default="kvx,nixl")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    connectors = args.connectors.split(",")
    vllm_python()  # fails early without an engine environment
    tmp = Path(tempfile.mkdtemp(prefix="kvx-bench-pd-"))
    model = tmp / "tiny-llama"
    subprocess.run(
        [
            os.environ["KVX_VLLM_PYTHON"],
            str(Path(__file__).resolve().parents[1] / "tests/e2e/tiny_model.py"),
            str(model),
        ],
        check=True,
    )
    rng = random.Random(11)

    def prompt() -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(args.prompt_len)]

    warm = prompt()
    warm_out: dict[str, list[int]] = {}
    warmup_failures: dict[str, int] = {}
    results: dict[str, dict[str, list[float]]] = {
        c: {"ttft_ms": [], "single_ms": [], "batch_ms": []} for c in connectors
    }
    for r in range(args.rounds):
        singles = [prompt() for _ in range(args.singles)]
        batch = [prompt() for _ in range(args.batch)]
        # One pair at a time (an idle NIXL engine still polls), in alternating order.
        for c in connectors if r % 2 == 0 else connectors[::-1]:
            procs: list[Proc] = []
            try:
                engines = start_pair(c, model, tmp, c)
                procs += engines
                deadline = time.monotonic() + ENGINE_START_S
                for e in engines:
                    e.wait_ready(deadline)
                proxy, url = start_proxy(c, engines[0], engines[1], tmp)
                procs.append(proxy)
                model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                # Warm-up (connections, handshakes), and a check that every pair agrees token for token.
                # A failed first handshake (NIXL's can time out on a loaded machine) is retried and counted.
                for attempt in range(3):
                    try:
                        out = one_request(url, model_id, warm, args.max_tokens)[2]
                        break
                    except RuntimeError as exc:
                        warmup_failures[c] = warmup_failures.get(c, 0) + 1
                        print(f"round {r + 1} {c}: warm-up request failed: {exc}", flush=True)
                        if attempt == 2:
                            raise
                if warm_out.setdefault("first", out) != out:
                    raise RuntimeError(f"{c} disagrees with the first pair: {out} != {warm_out['first']}")
                ttfts, totals = [], []
                for p in singles:
                    ttft, total, _ = one_request(url, model_id, p, args.max_tokens)
                    ttfts.append(ttft * 1e3)
                    totals.append(total * 1e3)
                results[c]["ttft_ms"].append(statistics.median(ttfts))
                results[c]["single_ms"].append(statistics.median(totals))
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                    n = len(batch)
                    list(pool.map(one_request, [url] * n, [model_id] * n, batch, [args.max_tokens] * n))
                results[c]["batch_ms"].append((time.perf_counter() - start) * 1e3)
                print(
                    f"round {r + 1} {c}: ttft {results[c]['ttft_ms'][-1]:.0f} ms, single "
                    f"{results[c]['single_ms'][-1]:.0f} ms, batch of {args.batch} "
                    f"{results[c]['batch_ms'][-1]:.0f} ms",
                    flush=True,
                )
            finally:
                for proc in procs:
                    proc.stop()
    summary = {c: {k: statistics.median(v) for k, v in m.items()} for c, m in results.items()}
    if {"kvx", "nixl"} <= set(summary):
        summary["kvx/nixl"] = {k: summary["kvx"][k] / summary["nixl"][k] for k in summary["kvx"]}
    if warmup_failures:
        summary["warm-up failures"] = warmup_failures
    print(
        json.dumps(summary, indent=2)
        if args.json
        else "\n".join(
            f"{c:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()) for c, m in summary.items()
        )
    )


if __name__ == "__main__":
    main()
