"""``kvx plan`` (the model) on hostile and extreme inputs: each is refused
with exit 2 and a message, or answered sanely and in bounded time."""

from __future__ import annotations

import json
import math
import random
import time

import numpy as np
import pytest

from kvx import cli
from kvx.plan import files
from kvx.plan.links import SWEEP_POINTS_MAX, Curve
from kvx.plan.model import PROMPT_BINS_MAX, Cluster, evaluate, mean_ttft_s, nics_needed
from kvx.plan.shapes import PRESETS
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    """``kvx plan ARGV``: (exit code, stdout, stderr); argparse's exit 2 included."""
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    return code, out, err


def largest_inputs(tmp_path) -> tuple[str, str]:
    rng = random.Random(7)
    hist = tmp_path / "hist.json"
    hist.write_text(json.dumps([[rng.randint(1, 1 << 24), rng.random()] for _ in range(PROMPT_BINS_MAX)]))
    curve = tmp_path / "sweep.json"
    points = [
        {"bytes": 4096 * (i + 1), "latency_us_p50": 60 + i * 1.0, "latency_us_p99": 90 + i * 1.5}
        for i in range(SWEEP_POINTS_MAX)
    ]
    curve.write_text(json.dumps({"points": points}))
    return str(hist), str(curve)


def test_the_largest_inputs_evaluate_and_plot_in_bounded_time(tmp_path, capsys):
    # 10,000 prompt lengths and a 4,096-point curve once took over 300 s: a
    # linear NIC search, each step a linear scan of the curve per length.
    hist, curve = largest_inputs(tmp_path)
    for rate, tokens_per_s in (("1", "20000"), ("0.001", "1e9")):
        started = time.monotonic()
        argv = ["--model", "llama-3.1-70b", "--prompt-hist", hist, "--curve", curve, "--rate", rate]
        code, out, err = plan(capsys, *argv, "--prefill-tokens-per-s", tokens_per_s, "--json")
        assert code == 0, err
        assert time.monotonic() - started < 30
    assert json.loads(out)["nic_utilisation"] > 0.5  # the NIC search really ran
    pytest.importorskip("matplotlib")
    started = time.monotonic()
    code, _, err = plan(capsys, *argv, "--prefill-tokens-per-s", "1e9", "--plot", str(tmp_path / "png"))
    assert code == 0, err
    assert time.monotonic() - started < 120


def test_vectorised_curve_and_bisected_nic_search_agree_with_the_slow_forms():
    rng = np.random.default_rng(3)
    sizes = np.sort(rng.choice(np.arange(1, 1 << 30, 4096), 300, replace=False))
    curve = Curve.from_points([(int(b), 1e-5 + b / 1e10, 2e-5 + b / 9e9) for b in sizes])
    probe = np.concatenate(([0.0, 1.0, float(sizes[0]), float(sizes[-1])], rng.uniform(1, 2e9, 2000)))
    many = curve.transfer_s_many(probe)
    for n, t in zip(probe, many, strict=True):
        pts = curve.points
        if n <= 0:
            want = 0.0
        elif n <= pts[0][0]:
            want = pts[0][1]
        elif n > pts[-1][0]:
            want = pts[-1][1] + (n - pts[-1][0]) / curve.bandwidth_bytes_per_s
        else:
            (b0, a, _), (b1, b, _) = next((p, q) for p, q in zip(pts, pts[1:], strict=False) if n <= q[0])
            want = a + (b - a) * (n - b0) / (b1 - b0)
        assert curve.transfer_s(float(n)) == pytest.approx(want, rel=1e-12)
        assert t == pytest.approx(want, rel=1e-9)
    shape = PRESETS["llama-3.1-70b"]
    for rate, share in ((0.2, 0.1), (2.0, 0.05), (3.0, 0.3)):
        c = Cluster(shape, ((8192, 1.0), (32768, 1.0)), rate, curve, target_share=share)
        linear = next(
            (
                n
                for n in range(1, 1025)
                if (m := mean_ttft_s(c, n))[1] <= share * m[0] and math.isfinite(m[0])
            ),
            None,
        )
        assert nics_needed(c) == linear


def test_an_overloaded_prefill_needs_no_nic_search():
    c = Cluster(PRESETS["tiny"], ((4096, 1.0),), 100.0, Curve(1e-5, 1e9), prefill_tokens_per_s=1.0)
    assert nics_needed(c) is None and evaluate(c).overloaded


def test_percentiles_near_saturation_do_not_collapse_to_zero(capsys):
    # rho = 0.99999: the grid's step (its span over its cells) once passed the
    # service time, all mass fell into cell 0 and p50 = p99 = 0 under a mean of
    # 50,000 s.
    argv = ["--model", "tiny", "--prompt-tokens", "1000", "--rate", "1", "--prefill-tokens-per-s", "1000.01"]
    code, out, err = plan(capsys, *argv, "--json")
    assert code == 0, err
    p = json.loads(out)
    assert p["prefill_wait_p50_s"] > 0 and p["ttft_p50_s"] > 0
    assert p["prefill_wait_p50_s"] < p["prefill_wait_mean_s"] < p["prefill_wait_p99_s"]
    assert 3 < p["prefill_wait_p99_s"] / p["prefill_wait_mean_s"] < 6  # exponential: ln 100
    assert p["ttft_p50_s"] < p["ttft_mean_s"] < p["ttft_p99_s"]
    assert "exponential" in p["approximation"]
    code, out, _ = plan(capsys, *argv)
    assert code == 0 and "Cramer-Lundberg" in out
    # Away from saturation the grid is used, and says nothing.
    code, out, _ = plan(capsys, "--model", "tiny", "--prompt-tokens", "1000", "--rate", "0.5", "--json")
    assert json.loads(out)["approximation"] is None


def test_deeply_nested_json_is_refused(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    for argv in (
        ["--model", "tiny", "--prompt-hist", str(deep)],
        ["--model", "tiny", "--prompt-tokens", "5", "--curve", str(deep)],
        ["--model", str(deep), "--prompt-tokens", "5"],
    ):
        code, _, err = plan(capsys, *argv)
        assert code == 2 and "nested too deeply" in err, (argv, err)


def test_weights_summing_past_the_largest_float_are_refused(tmp_path, capsys):
    hist = tmp_path / "hist.json"
    hist.write_text("[[1024, 1e308], [2048, 1e308]]")
    code, _, err = plan(capsys, "--model", "tiny", "--prompt-hist", str(hist))
    assert code == 2 and "scale them down" in err


def test_a_non_string_model_type_is_refused(tmp_path, capsys):
    config = tmp_path / "config.json"
    fields = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"}
    config.write_text(json.dumps({**fields, "sliding_window": 128, "model_type": 5}))
    code, _, err = plan(capsys, "--model", str(config), "--prompt-tokens", "5")
    assert code == 2 and "'model_type' must be a string" in err


def test_plot_at_an_existing_file_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    code, _, err = plan(capsys, "--model", "tiny", "--prompt-tokens", "5", "--plot", str(taken))
    assert code == 2 and "directory" in err
    assert taken.read_text() == "not a directory"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--prefill-tokens-per-s", "0"),
        ("--prefill-tokens-per-s", "-5"),
        ("--overhead-s", "-0.001"),
        ("--target-share", "0"),
        ("--target-share", "1.5"),
        ("--rate", "0"),
        ("--rate", "-1"),
        ("--rate", "inf"),
        ("--rate", "nan"),
    ],
)
def test_out_of_range_numbers_exit_2(capsys, flag, value):
    # --prefill-tokens-per-s 0 was silently the 20,000 default (`x or DEFAULT`).
    code, out, err = plan(capsys, "--model", "tiny", "--prompt-tokens", "512", flag, value)
    assert code == 2 and flag.lstrip("-").split("-")[0] in err and not out, err


def test_plan_after_global_options_takes_the_model_default(capsys):
    for argv in (
        ["--log-level", "INFO", "plan", "--model", "tiny", "--prompt-tokens", "512", "--json"],
        ["--log-level=WARNING", "plan", "--model", "tiny", "--prompt-tokens", "512", "--json"],
    ):
        assert cli.main(argv) == 0
        assert json.loads(capsys.readouterr().out)["request_bytes"] > 0


def test_file_messages_bom_and_comments(tmp_path, capsys):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (files.FILE_BYTES_MAX + 1))
    code, _, err = plan(capsys, "--model", "tiny", "--prompt-tokens", "5", "--curve", str(big))
    assert code == 2 and "over 16 MiB" in err and "not JSON" not in err
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf[[1024, 3], [2048, 1]]")
    assert files.read_histogram(str(bom)) == ((1024, 3.0), (2048, 1.0))
    bom_curve = tmp_path / "bom-sweep.json"
    sweep = {"points": [{"bytes": 4096, "latency_us_p50": 50}, {"bytes": 1 << 24, "latency_us_p50": 8000}]}
    bom_curve.write_bytes(b"\xef\xbb\xbf" + json.dumps(sweep).encode())
    assert files.read_curve(str(bom_curve)).points[0][0] == 4096
    commented = tmp_path / "hist.csv"
    commented.write_text("# prompt lengths from last week\ntokens,weight\n1024,3\n16384,1\n")
    assert files.read_histogram(str(commented)) == ((1024, 3.0), (16384, 1.0))


def test_extreme_values_print_in_a_few_characters(capsys):
    code, out, err = plan(
        capsys, "--model", "tiny", "--prompt-tokens", "512", "--prefill-tokens-per-s", "1e-300"
    )
    assert code == 0, err
    assert "OVERLOADED" in out
    assert max(len(line) for line in out.splitlines()) < 200, out
