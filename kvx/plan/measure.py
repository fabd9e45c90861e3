"""Measure a synthetic cluster under Poisson load: what ``kvx plan``'s model and
simulator are checked against.

    python -m kvx.plan.measure                      # the defaults below, a table
    python -m kvx.plan.measure --rates 3 6 --requests 200 --json

It starts ``kvx demo``'s local cluster (kvx/_demo.py: ``kvx metadata``, one
synthetic ``kvx prefill`` and one ``kvx decode`` daemon, ``kvx proxy``, each a
child process), with ``--prefill-tokens-per-s``: the prefill daemon is then one
first-come-first-served server whose service time is ``S = prompt_tokens /
prefill_tokens_per_s`` (docs/daemons.md). With every prompt the same length
and Poisson arrivals, the prefill is an M/D/1 queue. Then:

1. The calibration probe, on the idle cluster: ``PROBE_REQUESTS`` requests one
   after the other. ``overhead_s`` is the median of TTFT - S (the proxy, both
   legs' HTTP, deriving and checking the KV, the transfer); ``bytes_per_request``
   and ``transfer_s_mean`` are from decode's /metrics (what its READs moved and
   how long they took).
2. For each rate: a warm-up of ``warmup`` requests (not counted; the queue
   starts empty), then ``requests`` requests, sent at seeded Poisson arrival
   times through the proxy as streamed completions, each from its own thread.
   TTFT is the time from sending to the first streamed token. A thread starts
   late when the client is busy: ``lateness_s`` (actual send - scheduled send)
   says by how much, so a result whose arrivals were not Poisson shows it.

Every answer is checked against the synthetic engine's derivation (a wrong KV
byte changes it); any failed request fails the measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvx import _demo
from kvx.daemon.shapes import PRESETS
from kvx.errors import ConfigError, KvxError

# 16 MiB of KV per request: a real transfer, yet little CPU (the daemons derive and check
# every byte; at 512 tokens, 64 MiB, two cores saturate near 6 requests/s).
PROMPT_TOKENS = 128
PREFILL_TOKENS_PER_S = 1250.0  # S = 102.4 ms
RATES = (2.9, 6.3)  # requests per second: utilisation 0.3 and 0.65 at the defaults
REQUESTS = 150  # counted per rate
MODEL_SHAPE = "llama-3.1-8b"
MAX_TOKENS = 2  # the answer's tokens: TTFT is the first, the rest is decode's
PROBE_REQUESTS = 10
MAX_CLIENT_THREADS = 64  # the daemons' default --max-inflight
MAX_REQUESTS = 100_000
POOL_REQUESTS = 16  # each daemon's KV pool holds this many prompts at least
POOL_BYTES_MAX = 1 << 30  # ... within this many bytes
TIMEOUT_S = _demo.REQUEST_TIMEOUT_S


class MeasureError(KvxError):
    """The cluster did not start, a request failed, or the arguments cannot be measured."""


def quantile(samples: Sequence[float], q: float) -> float:
    """The q-quantile of samples (linear interpolation, as numpy's default)."""
    return float(np.quantile(np.asarray(samples, dtype=float), q))


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    return np.cumsum(gaps).tolist()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Keep the garbage collector off what the process holds now, while the
    block runs: a full collection stops every thread of the client, and in a
    process that has imported torch (200,000 objects) it took 200 ms on a
    2-core VM, long enough to make arrivals late (a test run that had run a
    thousand tests first saw a p99 lateness of 111 ms). Objects made inside
    the block are collected as usual. A process that froze its heap itself
    keeps it frozen."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Client:
    """Streamed completions through the proxy, each checked against the derivation."""

    def __init__(self, cluster: _demo.LocalCluster, threads: int) -> None:
        import httpx

        self.cluster = cluster
        self.model = f"kvx-synthetic-{cluster.shape.name}"
        self.http = httpx.Client(
            trust_env=False,
            timeout=httpx.Timeout(TIMEOUT_S, connect=10.0),
            limits=httpx.Limits(max_connections=threads, max_keepalive_connections=threads),
        )

    def ttft(self, prompt: str, want: str) -> float:
        """Seconds to the first streamed token of ``prompt``, whose answer must be ``want``."""
        try:
            first, _, text = _demo.stream_completion(
                self.http, self.cluster.proxy_url, self.model, prompt, MAX_TOKENS
            )
        except Exception as exc:  # httpx's errors, a refused request: each fails the measurement
            raise MeasureError(f"a request failed: {type(exc).__name__}: {exc}") from None
        if text != want:
            raise MeasureError(f"a wrong answer: {text[:60]!r}, not {want[:60]!r}")
        return first

    def close(self) -> None:
        self.http.close()


def _prompts(count: int, tokens: int, seed: int, shape_name: str) -> list[tuple[str, str]]:
    """``count`` distinct prompts of ``tokens`` words (a word is a token) and their answers."""
    from kvx.daemon.synthetic import expected_answer, render

    shape = PRESETS[shape_name]
    out = []
    for i in range(count):
        prompt = _demo.words_prompt(tokens, seed * 1_000_003 + i)
        out.append((prompt, render(expected_answer(prompt, shape, _demo.BLOCK_TOKENS, MAX_TOKENS))))
    return out


def _probe(client: _Client, prompts: list[tuple[str, str]], service_s: float) -> dict[str, Any]:
    decode_admin = client.cluster.admin_url["decode"]
    client.ttft(*prompts[0])  # connections, the agents' peer connection
    before = _demo.decode_totals(decode_admin)
    overheads = [client.ttft(*p) - service_s for p in prompts[1:]]
    moved = _demo.decode_totals(decode_admin) - before
    return {
        "overhead_s": statistics.median(overheads),
        "overhead_samples_s": overheads,
        "bytes_per_request": moved.bytes / max(1.0, moved.transfers),
        "transfer_s_mean": moved.seconds / max(1.0, moved.transfers),
    }


def _at_rate(
    client: _Client, prompts: list[tuple[str, str]], rate: float, warmup: int, seed: int, threads: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate``: the first ``warmup`` are not counted."""
    arrivals = poisson_arrivals(rate, len(prompts), seed)
    decode_admin = client.cluster.admin_url["decode"]
    ttft = [0.0] * len(prompts)
    sent = [0.0] * len(prompts)
    lateness = [0.0] * len(prompts)
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvx-measure")
    moved_before: list[_demo.DecodeTotals] = []

    def one(i: int, scheduled: float) -> None:
        start = time.perf_counter()
        sent[i], lateness[i] = start, start - scheduled
        ttft[i] = client.ttft(*prompts[i])

    futures = []
    try:
        t0 = time.perf_counter() + 0.05
        for i, at in enumerate(arrivals):
            if i == warmup:
                # Decode's counters from here on: wait for the warm-up requests to end first
                # would stall the arrivals, so the counters are read as the first counted one goes.
                moved_before.append(_demo.decode_totals(decode_admin))
            scheduled = t0 + at
            delay = scheduled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i, scheduled))
        for future in futures:
            future.result(TIMEOUT_S)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    moved = _demo.decode_totals(decode_admin) - moved_before[0] if moved_before else None
    counted = range(warmup, len(prompts))
    samples = [ttft[i] for i in counted]
    late = [lateness[i] for i in counted]
    span_s = sent[-1] - sent[warmup]
    return {
        "offered_rate": rate,
        "achieved_rate": (len(samples) - 1) / span_s if span_s > 0 else 0.0,
        "requests": len(samples),
        "warmup": warmup,
        "ttft_s": samples,
        # Every request's scheduled send (seconds from the first), the warm-up's too: the
        # sample path, for replaying the same arrivals through a model or simulator.
        "arrivals_s": [at - arrivals[0] for at in arrivals],
        "ttft_p50_s": quantile(samples, 0.5),
        "ttft_p90_s": quantile(samples, 0.9),
        "ttft_p99_s": quantile(samples, 0.99),
        "ttft_mean_s": statistics.fmean(samples),
        # Decode's mean READ time over the counted requests (and the warm-up's tail).
        "transfer_s_mean": moved.seconds / moved.transfers if moved and moved.transfers else None,
        "lateness_s": {"p50": quantile(late, 0.5), "p99": quantile(late, 0.99), "max": max(late)},
    }


def _check(rates: Sequence[float], prompt_tokens: int, prefill_tokens_per_s: float, requests: int) -> None:
    if not rates or not all(isinstance(r, (int, float)) and 0 < r <= 10_000 for r in rates):
        raise ConfigError(
            "rates must be one or more request rates, each above 0 and at most 10000 per second"
        )
    if not _demo.MIN_PROMPT_WORDS <= prompt_tokens <= 8192:
        raise ConfigError(f"prompt_tokens must be {_demo.MIN_PROMPT_WORDS}..8192, not {prompt_tokens}")
    if not 0 < prefill_tokens_per_s <= 1e9:
        raise ConfigError("prefill_tokens_per_s must be above 0: the measurement needs a service time")
    if not 2 <= requests <= MAX_REQUESTS:
        raise ConfigError(f"requests must be 2..{MAX_REQUESTS}, not {requests}")


def measure_cluster(
    rates: Sequence[float] = RATES,
    prompt_tokens: int = PROMPT_TOKENS,
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S,
    requests: int = REQUESTS,
    model_shape: str = MODEL_SHAPE,
    seed: int = 1,
    backend: str = "auto",
    warmup: int | None = None,
    say: Callable[[str], None] = lambda text: None,
) -> dict[str, Any]:
    """Start a synthetic cluster, probe it idle, then measure TTFT at each Poisson rate.

    ``requests`` are counted per rate, after ``warmup`` more (default: a tenth, 5..30).
    Returns a JSON-ready dict (see the module's docstring and docs); raises
    MeasureError when the cluster fails or any request does.
    """
    _check(rates, prompt_tokens, prefill_tokens_per_s, requests)
    if model_shape not in PRESETS:
        raise ConfigError(f"model_shape must be one of {', '.join(PRESETS)}, not {model_shape!r}")
    warmup = max(5, min(30, requests // 10)) if warmup is None else warmup
    if not 0 <= warmup <= MAX_REQUESTS:
        raise ConfigError(f"warmup must be 0..{MAX_REQUESTS} requests, not {warmup}")
    shape = PRESETS[model_shape]
    service_s = prompt_tokens / prefill_tokens_per_s
    blocks = -(-prompt_tokens // _demo.BLOCK_TOKENS)
    block_bytes = _demo.BLOCK_TOKENS * shape.token_bytes
    num_blocks = max(blocks * POOL_REQUESTS, min(4096, POOL_BYTES_MAX // block_bytes))
    daemon_args = ("--prefill-tokens-per-s", repr(float(prefill_tokens_per_s)), "--backend", backend)
    threads = MAX_CLIENT_THREADS
    out: dict[str, Any] = {
        "shape": {
            "name": shape.name,
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": shape.dtype,
            "planes": shape.planes,
            "token_bytes": shape.token_bytes,
        },
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_per_s": float(prefill_tokens_per_s),
        "service_s": service_s,
        "block_tokens": _demo.BLOCK_TOKENS,
        "backend": backend,
        "seed": seed,
        "kv_bytes_per_request_shape": blocks * block_bytes,
    }
    try:
        with (
            _demo.LocalCluster(
                model_shape, num_blocks=num_blocks, daemon_args=daemon_args, say=say
            ) as cluster,
            heap_frozen(),  # the client's own pauses would make arrivals late
        ):
            client = _Client(cluster, threads)
            try:
                probe = _prompts(PROBE_REQUESTS + 1, prompt_tokens, seed, model_shape)
                out.update(_probe(client, probe, service_s))
                say(f"  idle: overhead {out['overhead_s'] * 1e3:.1f} ms, S {service_s * 1e3:.1f} ms")
                out["rates"] = []
                for k, rate in enumerate(rates):
                    prompts = _prompts(warmup + requests, prompt_tokens, seed * 7919 + k + 1, model_shape)
                    result = _at_rate(client, prompts, rate, warmup, seed * 104_729 + k, threads)
                    result["utilisation"] = rate * service_s
                    out["rates"].append(result)
                    say(
                        f"  {rate:g}/s (rho {rate * service_s:.2f}): TTFT p50 {result['ttft_p50_s'] * 1e3:.1f} ms, "
                        f"mean {result['ttft_mean_s'] * 1e3:.1f} ms"
                    )
                    cluster.check_alive("after a rate")
            finally:
                client.close()
    except _demo.DemoError as exc:
        raise MeasureError(str(exc)) from None
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['shape']['name']}, {result['prompt_tokens']} tokens, "
        f"{result['prefill_tokens_per_s']:g} tokens/s (S {result['service_s'] * 1e3:.1f} ms), "
        f"{result['bytes_per_request'] / (1 << 20):.1f} MiB per request",
        f"idle overhead {result['overhead_s'] * 1e3:.1f} ms, READ {result['transfer_s_mean'] * 1e3:.1f} ms",
        "| rate /s | achieved /s | rho | TTFT p50 ms | p90 ms | p99 ms | mean ms | READ ms | late p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rates"]:
        read = r["transfer_s_mean"]
        lines.append(
            f"| {r['offered_rate']:g} | {r['achieved_rate']:.2f} | {r['utilisation']:.2f} | "
            f"{r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_p90_s'] * 1e3:.1f} | {r['ttft_p99_s'] * 1e3:.1f} | "
            f"{r['ttft_mean_s'] * 1e3:.1f} | {'-' if read is None else f'{read * 1e3:.1f}'} | "
            f"{r['lateness_s']['p99'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvx.plan.measure",
        description="TTFT of a local synthetic cluster under Poisson load, for checking kvx plan.",
    )
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES), metavar="PER_S")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, metavar="N")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=PREFILL_TOKENS_PER_S, metavar="N")
    parser.add_argument("--requests", type=int, default=REQUESTS, metavar="N", help="counted, per rate")
    parser.add_argument("--warmup", type=int, default=None, metavar="N", help="per rate, not counted")
    parser.add_argument("--model-shape", default=MODEL_SHAPE, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args(argv)
    try:
        result = measure_cluster(
            args.rates,
            args.prompt_tokens,
            args.prefill_tokens_per_s,
            args.requests,
            args.model_shape,
            args.seed,
            args.backend,
            args.warmup,
            say=lambda text: print(text, file=sys.stderr, flush=True),
        )
    except KvxError as exc:
        print(f"python -m kvx.plan.measure: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
