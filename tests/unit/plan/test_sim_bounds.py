"""kvx.plan.simulate refuses what it cannot run and bounds what it runs: caps that hold
while only rare events run, memory that does not grow with the run, inputs checked
before anything is drawn, finite JSON, and the model's --link and --prompt-hist."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from kvx.errors import ConfigError
from kvx.plan import _sim_loop
from kvx.plan.links import parse_link
from kvx.plan.model import DEFAULT_PREFILL_TOKENS_PER_S
from kvx.plan.simulate import (
    MetadataLoad,
    SimConfig,
    add_simulate_parser,
    config_from_args,
    run_simulate_cli,
    simulate,
)
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only

SMALL = ["--prefill", "2", "--decode", "2"]


def _config(**overrides) -> SimConfig:
    base = {
        "prefill": 2,
        "decode": 2,
        "rate": 20.0,
        "prompt_tokens": 1000,
        "prefill_tokens_per_s": 100_000.0,
        "request_bytes": lambda tokens: tokens * 1000,
        "transfer_s": lambda nbytes: 1e-4 + nbytes / 1e9,
        "duration_s": 10.0,
        "seed": 1,
    }
    base.update(overrides)
    return SimConfig(**base)


def _refuse(nan: str) -> float:
    raise ValueError(f"{nan} is not JSON")


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out, parse_constant=_refuse)


# -- 1. the caps hold while only rare events run ---------------------------------------


def test_the_wall_cap_stops_a_run_of_spine_windows_without_arrivals(capsys):
    # 10 million spine windows and no arrival to speak of: the caps used to be checked
    # only between arrivals, so the run went on for every window
    argv = [*SMALL, "--nodes-per-leaf", "1", "--spine-oversubscription", "2", "--rate", "0.000001"]
    assert run_simulate_cli([*argv, "--duration", "1e7", "--max-wall-s", "0.5", "--json"]) == 0
    sim = _json(capsys)["sim"]
    assert "max_wall_s" in sim["truncated"]
    assert sim["wall_s"] < 60.0
    assert sim["events"] < 10_000_000


def test_the_event_cap_stops_a_run_of_rare_events():
    config = _config(
        rate=1e-6, duration_s=1e6, spine_oversubscription=2.0, nodes_per_leaf=1, max_events=10_000
    )
    result = simulate(config)
    assert "max_events" in result.sim["truncated"]
    assert result.sim["events"] < 10_000 + 2 * (1 << 14)


def test_absurd_spine_window_counts_are_refused(capsys):
    argv = [*SMALL, "--nodes-per-leaf", "1", "--spine-oversubscription", "2", "--rate", "1"]
    assert run_simulate_cli([*argv, "--duration", "1e9"]) == 2
    assert "--duration" in capsys.readouterr().err
    assert run_simulate_cli([*argv, "--duration", "1e8"]) == 2
    err = capsys.readouterr().err
    assert "spine windows" in err and "--duration" in err


# -- 2. memory ---------------------------------------------------------------------------


def test_an_unstable_run_stops_at_the_backlog_bound(monkeypatch):
    # prefill at twice its capacity: before the bound the backlog grew by ~100 bytes a
    # request until the wall cap (1.3 GB in 20 s)
    monkeypatch.setattr(_sim_loop, "PENDING_MAX", 50_000)
    config = _config(
        prefill=1,
        decode=1,
        rate=100_000.0,
        prompt_tokens=1,
        prefill_tokens_per_s=50_000.0,
        metadata=MetadataLoad(lookups_per_request=0),
        duration_s=1e6,
        max_wall_s=120.0,
    )
    result = simulate(config)
    assert "prefill" in result.unstable
    assert "backlog" in result.sim["truncated"]
    assert result.requests["arrived"] < 1_000_000


def test_samples_keep_a_bounded_uniform_sample_and_exact_count_mean_max(monkeypatch):
    monkeypatch.setattr(_sim_loop, "SAMPLES_MAX", 5_000)
    values = np.random.default_rng(3).exponential(1.0, 200_000).astype(np.float32)
    samples = _sim_loop.Samples(np.random.default_rng(0))
    for chunk in np.array_split(values, 40):
        samples.buf.extend(chunk.tolist())
        samples.compact()
        assert samples.kept.size <= 5_000 and len(samples.buf) < 5_000 + 5_000
    out = samples.summary()
    assert samples.kept.size == 5_000
    assert out["count"] == values.size
    assert out["mean"] == pytest.approx(float(values.mean(dtype=np.float64)), rel=1e-9)
    assert out["max"] == float(values.max())
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert out[key] == pytest.approx(float(np.percentile(values, q)), rel=0.1)


def test_a_run_past_the_sample_cap_keeps_its_percentiles_and_its_seed(monkeypatch):
    config = _config(
        prefill=1, decode=1, rate=300.0, duration_s=200.0, metadata=MetadataLoad(lookups_per_request=0)
    )
    full = simulate(config)
    monkeypatch.setattr(_sim_loop, "SAMPLES_MAX", 4_000)
    sampled = simulate(config)
    assert sampled.ttft_s["count"] == full.ttft_s["count"] > 40_000
    assert sampled.ttft_s["mean"] == pytest.approx(full.ttft_s["mean"], rel=1e-9)
    assert sampled.ttft_s["max"] == full.ttft_s["max"]
    for key in ("p50", "p90", "p99"):
        assert sampled.ttft_s[key] == pytest.approx(full.ttft_s[key], rel=0.1)
    assert simulate(config).ttft_s == sampled.ttft_s


# -- 3. and 4. inputs are refused with a ConfigError, before anything is drawn ------------


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--prefill", "1000000000"], "at most 1,000,000 nodes"),
        (["--decode", "999999", "--rate", "1"], "at most 1,000,000 nodes"),
        (["--metadata-cores", "1000000000"], "metadata cores"),
        (["--nics", "10000000"], "nics_per_node"),
        (["--lookups-per-request", "1000000000000000000000"], "lookups_per_request"),
        (["--agents-per-node", "1000000000"], "agents_per_node"),
        (["--nodes-per-leaf", "0"], "nodes_per_leaf"),
        (["--prompt-tokens", "0"], "prompt_tokens must be >= 1"),
        (["--prompt-tokens", "1024:0"], "sum to zero"),
        (["--prompt-tokens", "1024:inf,2048:1"], "finite"),
        (["--prompt-tokens", "1024:1e308,2048:1e308"], "finite"),
        (["--prompt-tokens", "1024:nan"], "finite"),
        (["--seed", "-1"], "seed"),
        (["--spine-oversubscription", "inf"], "spine_oversubscription"),
        (["--spine-oversubscription", "nan"], "spine_oversubscription"),
        (["--prefill-tokens-per-s", "nan"], "prefill-tokens-per-s"),
        (["--prefill-tokens-per-s", "inf"], "--rate is needed"),
        (["--link-gbps", "inf"], "--link-gbps"),
        (["--cache-hit-ratio", "nan"], "cache_hit_ratio"),
        (["--overhead-ms", "inf"], "overhead_s"),
        (["--duration", "nan"], "--duration"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, match, capsys):
    assert (
        run_simulate_cli(
            [*SMALL, *flags, "--duration", "1"] if "--duration" not in flags else [*SMALL, *flags]
        )
        == 2
    )
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides",
    [
        {"metadata": MetadataLoad(lookups_per_request=10**21)},
        {"metadata": MetadataLoad(lookups_per_request=2.5)},
        {"metadata": MetadataLoad(lease_ttl_s=math.inf)},
        {"prompt_tokens": [(1024, math.inf), (2048, 1.0)]},
        {"prompt_tokens": [(10**30, 1.0)]},
        {"nics_per_node": 10_000_000},
        {"seed": -1},
        {"rate": math.inf},
        {"nic_bytes_per_s": math.inf},
    ],
)
def test_bad_configs_raise_config_errors(overrides):
    with pytest.raises(ConfigError):
        simulate(_config(**overrides))


# -- 5. finite JSON ------------------------------------------------------------------------


def test_leaves_without_nodes_give_a_finite_spine_load(capsys):
    # 4 nodes in 4 leaves of 1, prefill and decode spread evenly: two leaves hold two
    # nodes and two none, whose 0 bytes / 0 capacity was NaN in the JSON
    argv = [*SMALL, "--nodes-per-leaf", "1", "--spine-oversubscription", "2", "--duration", "5", "--json"]
    assert run_simulate_cli(argv) == 0
    utilisation = _json(capsys)["utilisation"]
    assert 0.0 < utilisation["spine_mean"] <= 1.0


# -- 6. the model's inputs --------------------------------------------------------------


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *SMALL, *flags])


def test_link_gives_the_models_curve_and_nics():
    curve = parse_link("rdma:400")[0].curve()
    config = config_from_args(_args("--link", "rdma:400"))
    for nbytes in (1, 1 << 20, 1 << 30):
        assert config.transfer_s(nbytes) == curve.transfer_s(nbytes)
    assert config.nic_bytes_per_s == 400e9 / 8  # the spine's capacity: the nominal speed
    assert config_from_args(_args("--link", "8x400")).nics_per_node == 8
    assert config_from_args(_args("--link-gbps", "100", "--fixed-us", "5")).transfer_s(0) == pytest.approx(
        5e-6
    )
    with pytest.raises(ConfigError, match="not both"):
        config_from_args(_args("--link", "rdma:400", "--link-gbps", "100"))
    with pytest.raises(ConfigError, match="give one"):
        config_from_args(_args("--link", "8x400", "--nics", "2"))


def test_the_default_prefill_speed_is_the_models():
    assert config_from_args(_args()).prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S


def test_prompt_hist_reads_the_models_histogram_file(tmp_path, capsys):
    hist = tmp_path / "prompts.csv"
    hist.write_text("tokens,weight\n512,1\n2048,3\n")
    common = [*SMALL, "--duration", "5", "--seed", "4", "--json"]
    assert run_simulate_cli([*common, "--prompt-hist", str(hist)]) == 0
    from_file = _json(capsys)
    assert run_simulate_cli([*common, "--prompt-tokens", "512:1,2048:3"]) == 0
    inline = _json(capsys)
    assert from_file["ttft_s"] == inline["ttft_s"] and from_file["ttft_s"]["count"] > 0
    with pytest.raises(SystemExit):
        run_simulate_cli([*common, "--prompt-hist", str(hist), "--prompt-tokens", "100"])
    assert run_simulate_cli([*common, "--prompt-hist", str(tmp_path / "missing.csv")]) == 2
