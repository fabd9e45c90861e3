"""The kvx command as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def kvx(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvx.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_demo_moves_verifies_and_says_so():
    result = kvx("demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "verified: all" in out and "MISMATCH" not in out
    assert "prefill got notification b'request demo-1: KV received'" in out
    assert "push:" in out and "landed" in out


@pytest.mark.slow
def test_bench_json_has_the_promised_fields():
    result = kvx(
        "bench",
        "--blocks",
        "64",
        "--block-size",
        "8KiB",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--streams",
        "2",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("throughput_gbps", "limit_gbps", "ratio", "latency_us_p50", "latency_us_p99"):
        assert isinstance(data[key], float) and data[key] > 0, key
    assert data["verified"] is True and data["streams"] == 2 and data["bytes_per_transfer"] == 64 * 8192
    assert abs(data["ratio"] - data["throughput_gbps"] / data["limit_gbps"]) < 1e-9


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, limit", [("tcp", "raw socket"), ("shm", "process_vm_readv"), ("auto", "process_vm_readv")]
)
def test_bench_write_text_output(backend, limit):
    result = kvx(
        "bench", "--op", "write", "--blocks", "16", "--iters", "2", "--warmup", "0", "--backend", backend
    )
    assert result.returncode == 0, result.stderr
    assert f"of the {limit} limit" in result.stdout and "NOT VERIFIED" not in result.stdout
    assert f"backend:          {'shm' if backend == 'auto' else backend}:" in result.stdout


def test_bad_arguments_are_clear_errors():
    result = kvx("bench", "--block-size", "12 parsecs")
    assert result.returncode == 2 and "not a size" in result.stderr
    result = kvx("demo", "--blocks", "10", "--num-blocks", "5")
    assert result.returncode == 2 and "--blocks must not exceed" in result.stderr
    assert kvx("--help").returncode == 0 and "demo" in kvx("--help").stdout


@pytest.mark.slow
def test_bench_sweep_prints_the_curve_and_plots_it(tmp_path):
    png = tmp_path / "curve.png"
    result = kvx("bench", "--sweep", "--backend", "shm", "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    sizes = [p["bytes"] for p in data["points"]]
    assert sizes == [4096 << (2 * k) for k in range(8)]  # 4 KiB to 64 MiB
    for p in data["points"]:
        assert p["verified"] is True and p["blocks"] * p["block_size_bytes"] == p["bytes"]
        assert p["block_size_bytes"] == min(16384, p["bytes"])
        assert 0 < p["latency_us_p50"] <= p["latency_us_p99"]
        assert abs(p["ratio"] - p["throughput_gbps"] / p["limit_gbps"]) < 1e-9
    assert data["backend"] == "shm" and data["limit"] == "process_vm_readv"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_plot_needs_sweep(tmp_path):
    result = kvx("bench", "--plot", str(tmp_path / "x.png"))
    assert result.returncode != 0 and "--plot draws the curve of --sweep" in result.stderr
    assert not (tmp_path / "x.png").exists()
