"""Disaggregated prefill/decode with real vLLM engines: kvx pull and push against NIXL.

Contenders, each a P/D pair of CPU vLLM engines (tiny random-weight Llama)
behind ``kvx proxy``, started one pair at a time (an idle NIXL engine keeps
polling and would slow another pair down), in an order that alternates round
by round, with the same prompts for all:

- ``kvx``: KvxConnector, pull (decode READs once prefill has finished);
- ``kvx-push``: KvxConnector with ``"mode": "push"`` and ``kvx proxy --mode
  push`` (prefill WRITEs each layer as it computes it);
- ``nixl``: vLLM's NixlConnector (pull);
- ``nixl-push``: vLLM's NixlPushConnector (prefill WRITEs when the request
  ends; the proxy sends the legs one after the other);
- ``single``: one engine with no connector, asked directly: prefill's own
  time to first token, the floor that push aims at.

Measured per prompt length: time to first token (streamed) and total time of
single requests, and, for each pair, the TTFT of its prefill engine asked
directly with a prompt of the same length (prefill's own time in that pair:
push aims at it); and the total time of a batch of concurrent requests.
Prompts are distinct random token ids (no prefix-cache hits). Reports medians
over rounds, each contender's TTFT against ``single``'s, and kvx against
NIXL (lower is better for kvx).

    KVX_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_pd.py --rounds 3

The vLLM environment needs ``nixl==1.5.0`` for the NIXL pairs
(``python3 -m uv pip install --python .venv-vllm/bin/python nixl==1.5.0 torch==2.13.0+cpu``).
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port, vllm_python  # noqa: E402

CONTENDERS = ("single", "kvx", "kvx-push", "nixl", "nixl-push")


def start_engines(
    name: str,
    model: Path,
    tmp: Path,
    contender: str,
    extra_args: list[str],
    env: dict[str, str] | None = None,
) -> list[Engine]:
    """[prefill, decode], or [engine] for ``single``; ``env`` goes to every engine."""
    if contender == "single":
        return [Engine(name, model, tmp, None, dict(env or {}), extra_args)]
    p_env: dict[str, str] = dict(env or {})
    d_env: dict[str, str] = dict(env or {})
    if contender.startswith("kvx"):
        extra = {"kv_connector_extra_config": {"mode": "push"}} if contender == "kvx-push" else {}
        p_cfg: dict[str, Any] = {"kv_connector": "KvxConnector", "kv_role": "kv_producer", **extra}
        d_cfg: dict[str, Any] = {"kv_connector": "KvxConnector", "kv_role": "kv_consumer", **extra}
    else:
        connector = "NixlPushConnector" if contender == "nixl-push" else "NixlConnector"
        p_cfg = {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        d_cfg = dict(p_cfg)
        p_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        d_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    prefill = Engine(f"{name}-prefill", model, tmp, p_cfg, p_env, extra_args)
    decode = Engine(f"{name}-decode", model, tmp, d_cfg, d_env, extra_args)
    return [prefill, decode]


def start_proxy(name: str, prefill: Engine, decode: Engine, tmp: Path, push: bool) -> tuple[Proc, str]:
    port = free_port()
    argv = [sys.executable, "-m", "kvx", "proxy", "--listen", f"127.0.0.1:{port}"]
    argv += ["--prefill", prefill.url, "--decode", decode.url, "--timeout-s", "300"]
    if push:
        argv += ["--mode", "push"]
    proxy = Proc(f"{name}-proxy", argv, dict(os.environ), tmp / f"{name}-proxy.log")
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


def summarize(results: dict[str, dict[str, list[float]]], lens: list[int]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        c: {k: round(statistics.median(v), 1) for k, v in m.items() if v} for c, m in results.items()
    }
    base = summary.get("single", {})
    for c in results:
        if c == "single":
            continue
        for n in lens:
            key = f"ttft_ms@{n}"
            if key in base and key in summary[c]:
                summary[c][f"ttft/single@{n}"] = round(summary[c][key] / base[key], 3)
            own = f"prefill_ttft_ms@{n}"
            if own in summary[c] and key in summary[c]:
                summary[c][f"ttft/prefill@{n}"] = round(summary[c][key] / summary[c][own], 3)
    for ours, theirs in (("kvx", "nixl"), ("kvx-push", "nixl-push"), ("kvx-push", "kvx")):
        if ours in summary and theirs in summary:
            summary[f"{ours}/{theirs}"] = {
                k: round(summary[ours][k] / summary[theirs][k], 3)
                for k in summary[ours]
                if k in summary[theirs] and "/" not in k and summary[theirs][k]
            }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--singles", type=int, default=3, help="sequential requests per prompt length and round")
    ap.add_argument(
        "--prompt-lens", default="256,1024,4096", help="prompt lengths in tokens, comma-separated"
    )
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests per round")
    ap.add_argument("--batch-len", type=int, default=600, help="prompt length of the batch's requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--connectors", default=",".join(CONTENDERS), help=f"some of {', '.join(CONTENDERS)}")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="OpenMP threads per engine (default 1: two engines share this machine's cores, and "
        "more threads than cores spin against each other); 0 leaves vLLM's default",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    contenders = args.connectors.split(",")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    lens = [int(n) for n in args.prompt_lens.split(",")]
    max_model_len = max([*lens, args.batch_len]) + args.max_tokens + 64
    extra_args = ["--max-model-len", str(max_model_len)]
    engine_env = {"OMP_NUM_THREADS": str(args.engine_threads)} if args.engine_threads else {}
    vllm_python()  # fails early without an engine environment
    tmp = Path(tempfile.mkdtemp(prefix="kvx-bench-pd-"))
    model = tmp / "tiny-llama"
    subprocess.run(
        [
            os.environ["KVX_VLLM_PYTHON"],
            str(Path(__file__).resolve().parents[1] / "tests/e2e/tiny_model.py"),
            str(model),
            str(max(max_model_len, 2048)),
        ],
        check=True,
    )
    rng = random.Random(11)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    warm = prompt(lens[-1])
    warm_out: dict[str, list[int]] = {}
    failures: dict[str, list[str]] = {}
    results: dict[str, dict[str, list[float]]] = {c: {} for c in contenders}
    for r in range(args.rounds):
        singles = {n: [prompt(n) for _ in range(args.singles)] for n in lens}
        batch = [prompt(args.batch_len) for _ in range(args.batch)]
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            procs: list[Proc] = []
            try:
                engines = start_engines(c, model, tmp, c, extra_args, engine_env)
                procs += engines
                deadline = time.monotonic() + ENGINE_START_S
                for e in engines:
                    e.wait_ready(deadline)
                if c == "single":
                    url = engines[0].url
                else:
                    proxy, url = start_proxy(c, engines[0], engines[1], tmp, push=c == "kvx-push")
                    procs.append(proxy)
                model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                # Warm-up (connections, handshakes; in push mode the proxy learns prefill's identity
                # from the first request, which runs in pull mode), and a check that every contender
                # agrees token for token with the first.
                for _ in range(2):
                    out = one_request(url, model_id, warm, args.max_tokens)[2]
                for n in lens:  # every prompt length once, on the pair and on prefill alone
                    one_request(url, model_id, prompt(n), args.max_tokens)
                    if c != "single":
                        one_request(engines[0].url, model_id, prompt(n), 1)
                if warm_out.setdefault("first", out) != out:
                    raise RuntimeError(
                        f"{c} disagrees with the first contender: {out} != {warm_out['first']}"
                    )
                line = []
                for n in lens:
                    ttfts, totals, own = [], [], []
                    for p in singles[n]:
                        if c != "single":
                            # Prefill's own time in this pair: the same engine asked directly, a
                            # prompt of the same length with no transfer (two engines share the
                            # machine here, so ``single`` alone is a floor no pair can reach).
                            own.append(one_request(engines[0].url, model_id, prompt(n), 1)[0] * 1e3)
                        ttft, total, _ = one_request(url, model_id, p, args.max_tokens)
                        ttfts.append(ttft * 1e3)
                        totals.append(total * 1e3)
                    results[c].setdefault(f"ttft_ms@{n}", []).append(statistics.median(ttfts))
                    results[c].setdefault(f"total_ms@{n}", []).append(statistics.median(totals))
                    if own:
                        results[c].setdefault(f"prefill_ttft_ms@{n}", []).append(statistics.median(own))
                    line.append(
                        f"{n}: ttft {statistics.median(ttfts):.0f} ms"
                        + (f" (prefill alone {statistics.median(own):.0f} ms)" if own else "")
                    )
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                    k = len(batch)
                    list(pool.map(one_request, [url] * k, [model_id] * k, batch, [args.max_tokens] * k))
                results[c].setdefault("batch_ms", []).append((time.perf_counter() - start) * 1e3)
                line.append(f"batch of {args.batch} {results[c]['batch_ms'][-1]:.0f} ms")
                print(f"round {r + 1} {c}: " + ", ".join(line), flush=True)
            except (RuntimeError, httpx.HTTPError) as exc:
                # A contender that fails is reported, not hidden, and the others still run.
                failures.setdefault(c, []).append(f"round {r + 1}: {exc}"[:500])
                print(f"round {r + 1} {c}: FAILED: {exc}", flush=True)
            finally:
                for proc in procs:
                    proc.stop()
    summary = summarize(results, lens)
    if failures:
        summary["failures"] = failures
    print(json.dumps(summary, indent=2) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
