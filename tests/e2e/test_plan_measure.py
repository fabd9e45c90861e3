"""kvx.plan.measure against a real synthetic cluster (``kvx demo``'s: metadata,
prefill and decode daemons, proxy), with few requests: the harness's numbers
are sane. No engine is needed; the e2e directory runs in the KVX_NATIVE=1
pass only, which is enough (the harness measures, it moves no new bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvx import _bench
from kvx.daemon.shapes import PRESETS
from kvx.plan import Cluster, Curve, evaluate, load_shape
from kvx.plan.measure import measure_cluster, poisson_arrivals
from kvx.plan.simulate import MetadataLoad, SimConfig, simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
# The tiny shape (1 KiB of KV per token): the daemons' own CPU work (deriving
# and checking the KV bytes) stays small next to the simulated compute, which
# is what the model's prefill queue is about. 512 tokens at 5,000 tokens/s:
# S = 102.4 ms on the one FIFO prefill server.
SHAPE, PROMPT_TOKENS, TOKENS_PER_S = "tiny", 512, 5000.0
SERVICE_S = PROMPT_TOKENS / TOKENS_PER_S
RATES = [0.30 / SERVICE_S, 0.65 / SERVICE_S]  # prefill utilisation 0.30 and 0.65
REQUESTS, WARMUP = 150, 10
# The arrival schedule is seeded, so every run sends the same requests at the
# same times: what varies between runs is the machine, and that is what the
# 15% must hold against. (Across seeds, the p50 of 150 requests at 65% load
# itself varies by about +-20%: queueing delays are strongly correlated.)
SEED = 1
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def measured() -> dict:
    return measure_cluster(
        RATES, PROMPT_TOKENS, TOKENS_PER_S, REQUESTS, model_shape=SHAPE, seed=SEED, warmup=WARMUP
    )


def test_measure_cluster_gives_sane_numbers(measured) -> None:
    result = measured
    json.dumps(result)  # JSON-ready
    shape = PRESETS[SHAPE]
    assert result["service_s"] == pytest.approx(SERVICE_S)
    # What decode READ is what the shape says: 32 blocks of 16 tokens, every layer and plane.
    assert result["bytes_per_request"] == PROMPT_TOKENS * shape.token_bytes
    assert 0 < result["transfer_s_mean"] < 1.0
    assert 0 < result["overhead_s"] < 1.0
    means = []
    for rate, got in zip(RATES, result["rates"], strict=True):
        assert got["offered_rate"] == rate and got["requests"] == REQUESTS
        assert len(got["ttft_s"]) == REQUESTS and len(got["arrivals_s"]) == REQUESTS + WARMUP
        # The arrivals sent are the seeded schedule's, on time: the client kept up.
        scheduled = np.asarray(got["arrivals_s"][WARMUP:])
        scheduled_rate = (REQUESTS - 1) / (scheduled[-1] - scheduled[0])
        assert got["achieved_rate"] == pytest.approx(scheduled_rate, rel=0.15)
        assert got["lateness_s"]["p99"] < 0.1, got["lateness_s"]
        # Every request waits at least its own compute; the quantiles are in order.
        assert min(got["ttft_s"]) >= SERVICE_S * 0.9
        assert got["ttft_p50_s"] <= got["ttft_p90_s"] <= got["ttft_p99_s"] <= max(got["ttft_s"])
        means.append(got["ttft_mean_s"])
    # More load, more queueing at the one prefill server.
    assert means[1] > means[0], means


def calibrated(result: dict) -> tuple[Curve, float]:
    """What the model and the simulator are given, measured here: the
    transfer's curve from kvx bench (the request's bytes, and four times
    them), and the per-request overhead from the idle probe less the READ
    it includes."""
    nbytes = int(result["bytes_per_request"])
    sweep = _bench.sweep("read", 1, sizes=(nbytes, 4 * nbytes))
    return Curve.from_sweep(sweep), result["overhead_s"] - result["transfer_s_mean"]


def test_model_and_simulator_predict_ttft_p50_within_15_percent(measured) -> None:
    curve, overhead_s = calibrated(measured)
    shape = load_shape(SHAPE)
    assert shape.request_bytes(PROMPT_TOKENS) == measured["bytes_per_request"]
    rows = []
    for rate, got in zip(RATES, measured["rates"], strict=True):
        cluster = Cluster(
            shape,
            ((PROMPT_TOKENS, 1.0),),
            rate,
            curve,
            prefill_tokens_per_s=TOKENS_PER_S,
            overhead_s=overhead_s,
        )
        # The simulator over many more requests than were sent: its p50 is
        # the distribution's, as the model's is.
        sim = simulate(
            SimConfig(
                prefill=1,
                decode=1,
                rate=rate,
                prompt_tokens=PROMPT_TOKENS,
                prefill_tokens_per_s=TOKENS_PER_S,
                request_bytes=shape.request_bytes,
                transfer_s=curve.transfer_s,
                overhead_s=overhead_s,
                metadata=MetadataLoad(lookup_cost_s=0.0, renewal_cost_s=0.0),  # the proxy caches
                duration_s=20_000 / rate,
                warmup_s=100 / rate,
                seed=SEED,
            )
        )
        rows.append((rate, got["ttft_p50_s"], evaluate(cluster).ttft_p50_s, sim.ttft_s["p50"]))
    report = "\n".join(
        f"rate {rate:.2f}/s: measured p50 {m * 1e3:.1f} ms, model {p * 1e3:.1f} ms ({p / m - 1:+.1%}), "
        f"simulator {s * 1e3:.1f} ms ({s / m - 1:+.1%})"
        for rate, m, p, s in rows
    )
    print("\n" + report)
    for _, m, p, s in rows:
        assert abs(p / m - 1) < TOLERANCE and abs(s / m - 1) < TOLERANCE, report
    # The two rates are told apart: queueing is what is predicted, not only S.
    assert rows[1][1] > rows[0][1] * 1.1, report


def test_the_arrivals_are_poisson_and_seeded() -> None:
    a = poisson_arrivals(5.0, 20_000, seed=9)
    assert a == poisson_arrivals(5.0, 20_000, seed=9)
    gaps = np.diff([0.0, *a])
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: sd = mean


def test_the_command_refuses_bad_arguments_and_says_why() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvx.plan.measure", "--prefill-tokens-per-s", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "prefill_tokens_per_s must be above 0" in done.stderr
