"""kvx.plan.simulate against queueing formulas, and its inputs, caps and CLI."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys

import pytest

from kvx.errors import ConfigError
from kvx.plan.simulate import MetadataLoad, SimConfig, run_simulate_cli, simulate
from tests.conftest import native_pass_only

# No byte path here: it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only

NO_LOOKUPS = MetadataLoad(lookups_per_request=0)


def _config(**overrides) -> SimConfig:
    base = {
        "prefill": 4,
        "decode": 4,
        "rate": 20.0,
        "prompt_tokens": 1000,
        "prefill_tokens_per_s": 100_000.0,
        "request_bytes": lambda tokens: tokens * 1000,
        "transfer_s": lambda nbytes: 1e-4 + nbytes / 1e9,
        "duration_s": 60.0,
        "seed": 1,
    }
    base.update(overrides)
    return SimConfig(**base)


def _comparable(result) -> dict:
    out = result.to_dict()
    out["sim"] = {k: v for k, v in out["sim"].items() if k not in ("wall_s", "events_per_s")}
    return out


def test_a_seed_gives_the_same_run_and_another_seed_another():
    config = _config(failure_rate=20.0, restart_s=5.0)
    first = _comparable(simulate(config))
    assert first == _comparable(simulate(config))
    assert first["requests"]["completed"] > 1000
    other = _comparable(simulate(dataclasses.replace(config, seed=2)))
    assert other["ttft_s"] != first["ttft_s"]


# One prefill node (instant prefill) and one decode node, one NIC each: the transfer is an
# M/G/1 queue. Service times 1 ms and 3 ms, equally likely.
ES, ES2 = 2e-3, (1e-6 + 9e-6) / 2


@pytest.mark.parametrize("rho", [0.3, 0.7])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_link_matches_pollaczek_khinchine(rho, seed):
    lam = rho / ES
    requests = 300_000
    config = _config(
        prefill=1,
        decode=1,
        rate=lam,
        prompt_tokens=[(1, 1.0), (3, 1.0)],
        prefill_tokens_per_s=math.inf,
        transfer_s=lambda nbytes: nbytes / 1e6,
        metadata=NO_LOOKUPS,
        duration_s=requests / lam,
        seed=seed,
    )
    result = simulate(config)
    want = ES + lam * ES2 / (2 * (1 - rho))
    # measured: within 0.6% over 6 runs (3 seeds x 2 loads) at 300k requests; 5% is the model's promise
    assert result.transfer_s["mean"] == pytest.approx(want, rel=0.02)
    assert result.utilisation["nic_send_mean"] == pytest.approx(rho, rel=0.02)
    assert result.unstable == []


def test_fan_in_queues_at_the_decode_nic():
    # 50 prefill nodes at 1.4% of their NIC each send to one decode NIC at 70%: the
    # queue is at the receiver, and it is M/G/1 again (measured: within 0.9% over 4 seeds).
    rho = 0.7
    lam = rho / ES
    config = _config(
        prefill=50,
        decode=1,
        rate=lam,
        prompt_tokens=[(1, 1.0), (3, 1.0)],
        prefill_tokens_per_s=math.inf,
        transfer_s=lambda nbytes: nbytes / 1e6,
        metadata=NO_LOOKUPS,
        duration_s=300_000 / lam,
    )
    result = simulate(config)
    assert result.transfer_s["mean"] == pytest.approx(ES + lam * ES2 / (2 * (1 - rho)), rel=0.03)
    assert result.utilisation["nic_receive_mean"] == pytest.approx(rho, rel=0.02)
    assert result.utilisation["nic_send_mean"] == pytest.approx(rho / 50, rel=0.02)


def test_prefill_is_m_d_1_per_instance():
    rho, service_s, prefill = 0.7, 0.01, 4
    config = _config(
        prefill=prefill,
        rate=rho / service_s * prefill,
        prompt_tokens=1000,
        prefill_tokens_per_s=1000 / service_s,
        metadata=NO_LOOKUPS,
        duration_s=2000.0,
        warmup_s=10.0,
    )
    result = simulate(config)
    want = rho * service_s / (2 * (1 - rho))
    assert result.prefill_wait_s["mean"] == pytest.approx(want, rel=0.05)
    assert result.offered_load["prefill"] == pytest.approx(rho)
    assert result.utilisation["prefill_mean"] == pytest.approx(rho, rel=0.03)


def test_metadata_lookups_queue_as_m_d_1_slowed_by_renewals():
    md = MetadataLoad(
        lookups_per_request=1,
        cache_hit_ratio=0.5,
        agents_per_node=100,
        renewal_interval_s=1.0,
        lookup_cost_s=1e-3,
        renewal_cost_s=1e-3,
    )
    # 8 nodes x 100 agents renew once a second: u = 0.8 of one core; lookups take 5 ms
    config = _config(rate=200.0, metadata=md, duration_s=300.0, warmup_s=5.0)
    result = simulate(config)
    lam, service = 100.0, 1e-3 / (1 - 0.8)
    want = service + lam * service**2 / (2 * (1 - lam * service))
    assert result.lookup_s["mean"] == pytest.approx(want, rel=0.05)
    ops = result.metadata["ops_per_s"]
    assert ops["renewal"] == pytest.approx(800.0)
    assert ops["lookup"] == pytest.approx(100.0, rel=0.05)
    assert result.metadata["utilisation"] == pytest.approx(0.8 + 0.1, rel=0.01)


def test_renewal_load_is_the_configured_rate():
    md = MetadataLoad(lookups_per_request=0, agents_per_node=8, renewal_interval_s=2.0, cores=2)
    result = simulate(_config(prefill=30, decode=70, metadata=md, duration_s=30.0, warmup_s=3.0))
    assert result.metadata["ops_per_s"]["renewal"] == pytest.approx(100 * 8 / 2.0)
    assert result.metadata["ops_per_s"]["lookup"] == 0
    assert result.metadata["utilisation"] == pytest.approx(400 * 0.1e-3 / 2)


def test_failures_follow_the_rate_and_requests_sent_to_a_dead_node_fail():
    # 100 nodes for 1,000 s at 3.6 failures per node-hour: 100 failures expected. Service is
    # fast, so what a failure costs is the requests routed to the node until its lease expires:
    # ttl - U x renewal interval after the failure, 10 - 10/6 s on average.
    md = MetadataLoad(lookups_per_request=0, lease_ttl_s=10.0, renewal_interval_s=10.0 / 3)
    config = _config(
        prefill=50, decode=50, rate=200.0, metadata=md, failure_rate=3.6, restart_s=30.0, duration_s=1000.0
    )
    result = simulate(config)
    f = result.failures
    drawn = f["count"] + f["skipped"]
    assert abs(drawn - 100) < 5 * math.sqrt(100)
    assert f["count"] == f["prefill"] + f["decode"]
    per_node_s = 200.0 / 50
    want = f["count"] * per_node_s * (10.0 - 10.0 / 6)
    assert result.requests["failed_routed"] == pytest.approx(want, rel=0.1)
    r = result.requests
    assert (
        r["arrived"]
        == r["completed"]
        + r["dropped"]
        + r["failed_routed"]
        + r["failed_metadata"]
        + r["unfinished"]
        + r["no_instance"]
    )
    # the metadata service saw each failure: renewals stopped while down, re-registrations
    # (those of the failures in the last restart_s fall after the end)
    registered = round(result.metadata["ops_per_s"]["register"] * 1000.0)
    assert (f["count"] - 10) * 8 <= registered <= f["count"] * 8
    assert registered % 8 == 0
    assert result.metadata["ops_per_s"]["renewal"] < 100 * 8 / (10.0 / 3)


def test_a_failure_drops_the_requests_in_flight_by_littles_law():
    # Detection within a millisecond: what is lost is what the node holds when it fails.
    md = MetadataLoad(lookups_per_request=0, lease_ttl_s=1e-3, renewal_interval_s=1e-3)
    config = _config(
        prefill=20,
        decode=20,
        rate=20.0,  # 1 request/s per instance, prefill 0.5 s: rho 0.5
        prefill_tokens_per_s=2000.0,
        transfer_s=lambda nbytes: 0.2,
        metadata=md,
        failure_rate=36.0,
        restart_s=5.0,
        duration_s=2000.0,
    )
    result = simulate(config)
    f = result.failures
    # held by a prefill node: from arrival to the end of its send; by a decode node: to the end
    wait = result.prefill_wait_s["mean"]
    held_p = wait + 0.5 + 0.2
    held_d = result.ttft_s["mean"]
    want = f["prefill"] * 1.0 * held_p + f["decode"] * 1.0 * held_d
    assert f["count"] > 300
    assert result.requests["dropped"] == pytest.approx(want, rel=0.2)


def test_an_oversubscribed_spine_slows_transfers_between_leaves():
    heavy = {
        "prefill": 32,
        "decode": 32,
        "rate": 1000.0,
        "prefill_tokens_per_s": math.inf,
        "transfer_s": lambda nbytes: nbytes / 1e9,
        "request_bytes": lambda tokens: tokens * 10_000,  # 10 ms a transfer, 0.3 of each NIC
        "nodes_per_leaf": 8,
        "metadata": NO_LOOKUPS,
        "duration_s": 20.0,
        "warmup_s": 2.0,
    }
    flat = simulate(_config(**heavy))
    tight = simulate(_config(**heavy, spine_oversubscription=10.0))
    assert "spine_mean" not in flat.utilisation
    assert tight.offered_load["spine"] > 1.0
    assert "spine" in tight.unstable
    assert tight.utilisation["spine_overloaded_fraction"] > 0.5
    assert tight.transfer_s["mean"] > 1.1 * flat.transfer_s["mean"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"rate": -1.0}, "rate must be"),
        ({"rate": math.nan}, "rate must be"),
        ({"prefill": 0}, "at least one prefill"),
        ({"prompt_tokens": 0}, "prompt_tokens must be >= 1"),
        ({"prompt_tokens": [(100, 0.0)]}, "sum to zero"),
        ({"prompt_tokens": "many"}, "prompt_tokens must be"),
        ({"warmup_s": 60.0}, "warmup_s"),
        ({"spine_oversubscription": 0.5}, "spine_oversubscription"),
        ({"failure_rate": 1e12}, "failures expected"),
        ({"metadata": MetadataLoad(cache_hit_ratio=2.0)}, "cache_hit_ratio"),
        ({"transfer_s": lambda nbytes: -1.0}, "transfer_s"),
        ({"request_bytes": lambda tokens: 0.5}, "request_bytes"),
        ({"prompt_tokens": lambda rng, n: rng.integers(0, 2, n)}, "lengths must be >= 1"),
    ],
)
def test_bad_inputs_raise_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        simulate(_config(**overrides))


def test_an_overloaded_queue_is_reported_not_hung(caplog):
    with caplog.at_level(logging.WARNING, logger="kvx.plan.simulate"):
        result = simulate(_config(rate=600.0, duration_s=20.0))  # prefill rho 1.5
    assert "prefill: offered load 1.50 >= 1" in caplog.text
    assert result.unstable == ["prefill"]
    assert result.offered_load["prefill"] == pytest.approx(1.5)
    assert result.ttft_s["p99"] > 1.0  # the queue grew for the whole run
    assert result.sim["truncated"] is None


def test_saturated_metadata_fails_lookups_instead_of_waiting_forever():
    md = MetadataLoad(agents_per_node=10_000, renewal_interval_s=1.0, cache_hit_ratio=0.0)
    result = simulate(_config(metadata=md, duration_s=10.0))
    assert result.metadata["saturated"]
    assert "metadata" in result.unstable
    assert result.requests["failed_metadata"] == result.requests["arrived"] > 0


def test_the_caps_stop_a_run_and_say_so():
    long_run = _config(rate=100_000.0, prefill_tokens_per_s=math.inf, duration_s=3600.0)
    by_events = simulate(dataclasses.replace(long_run, max_events=50_000))
    assert "max_events" in by_events.sim["truncated"]
    assert by_events.sim["events"] < 50_000 + 20_000
    by_wall = simulate(dataclasses.replace(long_run, max_wall_s=0.3))
    assert "max_wall_s" in by_wall.sim["truncated"]
    assert by_wall.sim["wall_s"] < 10.0


def test_cli_prints_json_and_rejects_bad_flags(capsys):
    argv = ["--prefill", "2", "--decode", "2", "--duration", "5", "--prompt-tokens", "512:1,2048:1", "--json"]
    assert run_simulate_cli(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"]["completed"] > 0
    assert out["offered_load"]["prefill"] == pytest.approx(0.6, rel=0.05)
    assert run_simulate_cli(["--prefill", "2", "--decode", "2", "--rate", "-3"]) == 2
    assert "rate must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_simulate_cli(["--prefill", "2", "--decode", "2", "--prompt-tokens", "lots"])


def test_the_module_runs_as_a_command():
    argv = [
        sys.executable,
        "-m",
        "kvx.plan.simulate",
        "--prefill",
        "2",
        "--decode",
        "3",
        "--duration",
        "5",
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sim"]["nodes"] == 5
