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

from kvx.daemon.shapes import PRESETS
from kvx.plan.measure import measure_cluster, poisson_arrivals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS, TOKENS_PER_S = 128, 1250.0  # S = 102.4 ms
RATES = [2.9, 6.3]  # utilisation 0.30 and 0.65
REQUESTS, WARMUP = 40, 5


def test_measure_cluster_gives_sane_numbers() -> None:
    result = measure_cluster(
        RATES, PROMPT_TOKENS, TOKENS_PER_S, REQUESTS, model_shape="llama-3.1-8b", seed=3, warmup=WARMUP
    )
    json.dumps(result)  # JSON-ready
    service_s = PROMPT_TOKENS / TOKENS_PER_S
    shape = PRESETS["llama-3.1-8b"]
    assert result["service_s"] == pytest.approx(service_s)
    # What decode READ is what the shape says: 8 blocks of 16 tokens, every layer and plane.
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
        assert min(got["ttft_s"]) >= service_s * 0.9
        assert got["ttft_p50_s"] <= got["ttft_p90_s"] <= got["ttft_p99_s"] <= max(got["ttft_s"])
        means.append(got["ttft_mean_s"])
    # More load, more queueing at the one prefill server.
    assert means[1] > means[0], means


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
