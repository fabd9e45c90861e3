"""The queueing model against closed forms, and the CLI's answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvx import cli
from kvx.errors import ConfigError
from kvx.plan.links import Curve, parse_link
from kvx.plan.model import Cluster, evaluate, mg1_wait_mean_s, nics_needed, transfer_queue_mean_s, wait_pmf
from kvx.plan.shapes import PRESETS
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only


def erlang_md1_cdf(rate: float, d: float, t: float) -> float:
    """Erlang's M/D/1 waiting-time distribution: (1 - rho) sum_k
    (lambda (k d - t))^k / k! exp(-lambda (k d - t)), k = 0..floor(t / d)."""
    rho = rate * d
    total = 0.0
    for k in range(int(t // d) + 1):
        x = rate * (k * d - t)
        total += x**k / math.factorial(k) * math.exp(-x)
    return (1 - rho) * total


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.8])
def test_wait_distribution_matches_erlang_md1(rho):
    d, rate = 1.0, rho
    dt, cells = 0.002, 1 << 14
    cdf = np.cumsum(wait_pmf(rate, [(d, 1.0)], dt, cells))
    for t in (0.0, 0.5, 1.0, 2.5, 5.0, 9.0):
        j = int(round(t / dt))
        assert cdf[j] == pytest.approx(erlang_md1_cdf(rate, d, t), abs=2e-3)
    mean = float(np.dot(np.arange(cells) * dt, wait_pmf(rate, [(d, 1.0)], dt, cells)))
    assert mean == pytest.approx(mg1_wait_mean_s(rate, [(d, 1.0)]), rel=5e-3)


def test_pollaczek_khinchine_mean_and_exponential_service():
    # Two service times: E[S] = 0.5, E[S^2] = 0.5 (0.25 + ... ): check by hand.
    services = [(0.2, 1.0), (0.8, 1.0)]
    rate = 1.0
    es, es2 = 0.5, (0.04 + 0.64) / 2
    assert mg1_wait_mean_s(rate, services) == pytest.approx(rate * es2 / (2 * (1 - rate * es)))
    assert mg1_wait_mean_s(3.0, services) == math.inf
    curve = Curve(0.0, 1e9)
    # M/D/1 sojourn: D + rho D / (2 (1 - rho)).
    assert transfer_queue_mean_s(500.0, curve, [1_000_000]) == pytest.approx(1e-3 + 0.5 * 1e-3 / (2 * 0.5))
    assert transfer_queue_mean_s(0.0, curve, [(1_000_000, 1.0), (3_000_000, 1.0)]) == pytest.approx(2e-3)


def cluster(**kw):
    base = dict(
        shape=PRESETS["llama-3.1-70b"],
        prompt=((8192, 1.0),),
        rate_rps=2.0,
        curve=parse_link("rdma:400")[0].curve(),
        prefill_instances=2,
        prefill_tp=8,
        decode_tp=8,
    )
    base.update(kw)
    return Cluster(**base)


def test_evaluate_is_consistent():
    c = cluster()
    p = evaluate(c)
    assert p.request_bytes == 8192 * 327_680
    assert p.prefill_rank_bytes == p.decode_rank_bytes == 8192 * 327_680 / 8
    assert p.nic_utilisation == pytest.approx(1.0 * c.curve.transfer_s(p.request_bytes))
    assert p.prefill_utilisation == pytest.approx(1.0 * 8192 / 20_000)
    assert p.ttft_mean_s == pytest.approx(
        p.prefill_wait_mean_s + p.prefill_s + p.transfer_mean_s + c.overhead_s
    )
    assert p.prefill_wait_p50_s <= p.prefill_wait_p99_s
    assert p.prefill_s + p.transfer_service_s < p.ttft_p50_s < p.ttft_p99_s
    assert p.transfer_service_s <= p.transfer_p50_s <= p.transfer_p99_s
    assert p.overloaded is None
    # The p99 of prefill's wait is Erlang's M/D/1 p99.
    rate, d = 1.0, 8192 / 20_000
    assert erlang_md1_cdf(rate, d, p.prefill_wait_p99_s) == pytest.approx(0.99, abs=2e-3)
    more = evaluate(cluster(nics=p.nics_needed))
    assert more.transfer_share <= c.target_share < evaluate(cluster(nics=p.nics_needed - 1)).transfer_share


def test_histogram_and_overload():
    c = cluster(prompt=((1024, 3.0), (16384, 1.0)))
    p = evaluate(c)
    assert p.request_bytes == pytest.approx((3 * 1024 + 16384) / 4 * 327_680)
    hot = evaluate(cluster(rate_rps=10.0))
    assert hot.overloaded and "prefill" in hot.overloaded and hot.ttft_p99_s == math.inf
    slow = evaluate(cluster(curve=Curve(0.0, 1e9), rate_rps=1.0, prefill_tokens_per_s=1e6))
    assert slow.overloaded and "NIC" in slow.overloaded
    assert nics_needed(cluster(overhead_s=10.0)) == 1
    assert nics_needed(cluster(curve=Curve(5.0, 1e12))) is None  # a fixed cost no NIC count shortens


def test_layer_overlap():
    p = evaluate(cluster())
    assert p.overlap_hides and p.overlap_exposed_s == p.layer_transfer_s
    slow = evaluate(cluster(curve=Curve(0.0, 1e9), rate_rps=0.1))
    assert not slow.overlap_hides
    assert slow.overlap_exposed_s == pytest.approx(
        80 * (slow.layer_transfer_s - slow.layer_compute_s) + slow.layer_compute_s
    )


def test_curve_from_sweep_interpolates_linearly_and_extends_at_the_last_bandwidth():
    sweep = {
        "backend": "tcp",
        "points": [
            {"bytes": 4096, "latency_us_p50": 100.0, "latency_us_p99": 150.0},
            {"bytes": 1 << 20, "latency_us_p50": 600.0, "latency_us_p99": 900.0},
            {"bytes": 4 << 20, "latency_us_p50": 2100.0, "latency_us_p99": 2500.0},
            {"bytes": 4 << 20, "latency_us_p50": 2300.0, "latency_us_p99": 2500.0},
        ],
    }
    c = Curve.from_sweep(sweep)
    assert c.transfer_s(4096) == pytest.approx(100e-6)
    assert c.transfer_s(1024) == pytest.approx(100e-6)
    assert c.transfer_s((4096 + (1 << 20)) // 2) == pytest.approx(350e-6, rel=1e-3)
    assert c.transfer_s(4 << 20) == pytest.approx(2200e-6)  # the median of the two
    slope = (2200e-6 - 600e-6) / (3 << 20)
    assert c.transfer_s(8 << 20) == pytest.approx(2200e-6 + slope * (4 << 20))
    assert c.p99_s(4096) == pytest.approx(150e-6)
    for bad, message in (
        ([], "JSON object"),
        ({"points": [{"bytes": 1, "latency_us_p50": 1}]}, "2.."),
        ({"points": [{"bytes": -1, "latency_us_p50": 1}] * 2}, "bytes"),
        ({"points": [{"bytes": 1, "latency_us_p50": "x"}] * 2}, "latency_us_p50"),
        ({"points": [{"bytes": 1, "latency_us_p50": 1}] * 2}, "two transfer sizes"),
        ({"points": [{"bytes": 1, "latency_us_p50": 9}, {"bytes": 2, "latency_us_p50": 1}]}, "does not rise"),
    ):
        with pytest.raises(ConfigError, match=message):
            Curve.from_sweep(bad)


def test_links():
    link, nics = parse_link("8x400")
    assert nics == 8 and link.peak_bytes_per_s == 50e9
    assert parse_link("nvlink4")[0].peak_bytes_per_s == 450e9
    assert parse_link("tcp")[0].peak_bytes_per_s == 12.5e9
    for bad in ("infiniband", "0x400", "rdma:0", "8x"):
        with pytest.raises(ConfigError):
            parse_link(bad)


def run_cli(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table_json_and_errors(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-3.1-8b", "--prompt-tokens", "8192", "--rate", "1")
    assert code == 0 and "NICs needed" in out and "TTFT" in out
    hist = tmp_path / "hist.csv"
    hist.write_text("tokens,weight\n1024,3\n16384,1\n")
    sweep = tmp_path / "tcp.json"
    sweep.write_text(
        json.dumps(
            {"points": [{"bytes": 4096, "latency_us_p50": 50}, {"bytes": 1 << 24, "latency_us_p50": 8000}]}
        )
    )
    code, out, _ = run_cli(
        capsys, "model", "--model", "deepseek-v3", "--prompt-hist", str(hist), "--curve", str(sweep), "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["request_bytes"] == pytest.approx((3 * 1024 + 16384) / 4 * 70_272)
    assert data["inputs"]["curve"] == str(sweep)
    for argv, message in (
        (["--model", "nope", "--prompt-tokens", "5"], "neither a preset"),
        (["--model", "tiny", "--prompt-tokens", "5", "--link", "carrier-pigeon"], "link"),
        (["--model", "tiny", "--prompt-hist", str(tmp_path / "missing.csv")], "cannot read"),
        (["--model", "tiny", "--prompt-tokens", "5", "--curve", str(hist)], "not JSON"),
        (["--model", "tiny", "--prompt-tokens", "5", "--target-share", "2"], "target share"),
        (["--model", "tiny", "--prompt-tokens", "5", "--link", "4x400", "--nics", "2"], "give one"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err, (argv, err)


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(
        capsys,
        "--model",
        "llama-3.1-70b",
        "--prompt-tokens",
        "8192",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "8",
        "--link",
        "4x400",
        "--plot",
        str(tmp_path),
    )
    assert code == 0
    for name in ("transfer-vs-prompt.png", "utilisation-vs-rate.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_sizes_flag(capsys):
    assert cli._sweep_sizes("64KiB, 96KiB,4KiB") == (65536, 98304, 4096)
    for bad in ("20KiB", "2GiB", "", "1KiB"):
        with pytest.raises(ConfigError):
            cli._sweep_sizes(bad)
    assert cli.main(["bench", "--sizes", "64KiB"]) == 1
    assert "add --sweep" in capsys.readouterr().err


def test_cli_plan_model_and_simulate_subcommands(capsys):
    # `kvx plan --model ...` is `kvx plan model --model ...`.
    code, implicit, _ = run_cli(capsys, "--model", "tiny", "--prompt-tokens", "512", "--json")
    assert code == 0
    code, explicit, _ = run_cli(capsys, "model", "--model", "tiny", "--prompt-tokens", "512", "--json")
    assert code == 0 and json.loads(explicit) == json.loads(implicit)
    argv = ["simulate", "--prefill", "2", "--decode", "2", "--duration", "5", "--seed", "3", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    result = json.loads(out)
    assert result["requests"]["completed"] > 0
    code, _, err = run_cli(capsys, "simulate", "--prefill", "0", "--decode", "2")
    assert code == 2 and "prefill" in err
