"""SGLang prefill/decode: the kvx transfer backend against mooncake_tcp, through SGLang's router.

One pair at a time (CPU engines, tiny random-weight Llama), the order
alternating by round, the same prompts for both: time to first token of
sequential streamed requests, and the time and throughput of 16 concurrent
requests. Medians over rounds; kvx/mooncake ratios (lower is better for kvx).
The single prompts' greedy outputs must be the same through both backends:
SGLang's own mooncake_tcp is the reference kvx must agree with (the
end-to-end test compares kvx with a single engine; this is not run by
scripts/test.sh).

    KVX_SGLANG_PYTHON=.venv-sglang/bin/python python benchmarks/sglang_pd.py --rounds 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.e2e.conftest import Proc, free_port  # noqa: E402
from tests.e2e.test_sglang_pd import pair, sglang_env, sglang_python  # noqa: E402


def stream_ttft(url: str, ids: list[int], max_new: int) -> tuple[float, float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new},
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(f"{url}: {line[:300]}")
                if first is None:
                    first = time.perf_counter() - start
    return (first if first is not None else float("nan")), time.perf_counter() - start


def greedy(url: str, ids: list[int], max_new: int) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
    resp = httpx.post(url + "/generate", json=body, timeout=300)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: {resp.status_code} {resp.text[:300]}")
    return list(resp.json()["output_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--singles", type=int, default=4)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--backends", default="kvx,mooncake_tcp")
    args = ap.parse_args()
    backends = args.backends.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="kvx-bench-sgl-"))
    model = tmp / "tiny-llama"
    subprocess.run(
        [sglang_python(), str(Path(__file__).resolve().parents[1] / "tests/e2e/tiny_model.py"), str(model)],
        check=True,
    )
    rng = random.Random(3)

    def prompt() -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(args.prompt_len)]

    results = {b: {"ttft_ms": [], "concurrent_s": [], "tokens_per_s": []} for b in backends}
    outputs: dict[str, list[list[list[int]]]] = {b: [] for b in backends}  # per round, per single
    for r in range(args.rounds):
        singles = [prompt() for _ in range(args.singles)]
        batch = [prompt() for _ in range(args.concurrent)]
        for backend in backends if r % 2 == 0 else backends[::-1]:
            prefill, decode, bootstrap = pair(model, tmp, backend, f"{backend}-r{r}")
            procs: list[Proc] = [prefill, decode]
            try:
                deadline = time.monotonic() + 300
                prefill.wait_ready(deadline)
                decode.wait_ready(deadline)
                port = free_port()
                procs.append(
                    Proc(
                        f"router-{backend}",
                        [
                            sglang_python(),
                            "-m",
                            "sglang_router.launch_router",
                            "--pd-disaggregation",
                            "--prefill",
                            prefill.url,
                            str(bootstrap),
                            "--decode",
                            decode.url,
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                        ],
                        sglang_env(),
                        tmp / f"router-{backend}-r{r}.log",
                    )
                )
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 60
                while True:  # warm-up: the router is up and the pair has connected
                    try:
                        stream_ttft(url, prompt(), args.max_new)
                        break
                    except (httpx.HTTPError, RuntimeError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(1)
                ttfts = [stream_ttft(url, p, args.max_new)[0] * 1e3 for p in singles]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                    n = len(batch)
                    list(pool.map(stream_ttft, [url] * n, batch, [args.max_new] * n))
                took = time.perf_counter() - start
                outputs[backend].append([greedy(url, p, args.max_new) for p in singles])
                results[backend]["ttft_ms"].append(statistics.median(ttfts))
                results[backend]["concurrent_s"].append(took)
                results[backend]["tokens_per_s"].append(len(batch) * args.max_new / took)
                print(
                    f"round {r + 1} {backend}: ttft {statistics.median(ttfts):.0f} ms, "
                    f"{len(batch)} concurrent in {took:.1f} s",
                    flush=True,
                )
            finally:
                for proc in procs:  # Proc.stop also ends the router's child, which leaves its group
                    proc.stop()
    summary: dict[str, object] = {
        b: {k: statistics.median(v) for k, v in m.items()} for b, m in results.items()
    }
    same = all(outputs[b] == outputs[backends[0]] for b in backends)
    summary["same_outputs"] = same
    if {"kvx", "mooncake_tcp"} <= set(summary):
        summary["kvx/mooncake_tcp"] = {
            k: statistics.median(results["kvx"][k]) / statistics.median(results["mooncake_tcp"][k])
            for k in results["kvx"]
        }
    print(json.dumps(summary, indent=2))
    if not same:
        sys.exit(f"the backends' greedy outputs differ: {outputs}")


if __name__ == "__main__":
    main()
