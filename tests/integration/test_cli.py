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
