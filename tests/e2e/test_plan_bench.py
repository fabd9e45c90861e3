"""kvx plan's curve against measurement: calibrate a Curve on some transfer
sizes of a kvx bench run, predict the time of sizes it did not see, measured
in the same run.

Calibration and held-out sizes are measured in one session, in rounds that
alternate between them (ascending, then descending), so that the shared
machine's noise hits both alike; each size's time is the median of all its
samples. shm stays at or below 4 MiB: above that, on a 32 MiB-L3 machine, a
transfer's source and destination stop fitting in the cache and the time per
byte jumps about fourfold between 4 and 6 MiB, which no curve through 4 and
16 MiB can know (docs/plan.md).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from kvx import _bench
from kvx.descs import Descs
from kvx.plan.links import Curve

K, M = 1024, 1 << 20
# The worst error allowed. tcp has more: on 2026-11-29 this 2-core VM's tcp READs of
# exactly 2 and 3 MiB took 10-25% longer than their neighbours (1.875, 2.125, 2.875
# and 3.125 MiB; the cause is not found), so the curve through those calibration sizes
# overestimated 2.5 MiB by 11-19% in nine runs (the code of the day and of the day
# before alike): a step no interpolation knows (docs/plan.md, "Calibrating").
TOLERANCE = {"tcp": 0.25, "shm": 0.15}
ROUNDS = 60
ROUND_BYTES = 16 * M  # per size and round: a few transfers of the large sizes, up to 30 of the small


def measure(backend: str, sizes: list[int]) -> dict[int, list[float]]:
    session = _bench._Session(2 * max(sizes), 1, backend, "host")
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        assert session.peer.backend == backend
        prepared = {}
        for n in sizes:
            block = min(_bench.SWEEP_BLOCK, n)
            ids = np.arange(0, 2 * (n // block), 2)
            prepared[n] = (
                Descs.from_blocks(session.region, ids, block),
                Descs.from_blocks(session.peer.regions[0], ids, block),
            )
        for r in range(ROUNDS):
            for n in sizes if r % 2 == 0 else sizes[::-1]:
                local, remote = prepared[n]
                session.peer.read(local, remote).wait(60)  # not timed: warm
                for _ in range(max(3, min(30, ROUND_BYTES // n))):
                    start = time.perf_counter()
                    session.peer.read(local, remote).wait(60)
                    samples[n].append(time.perf_counter() - start)
    finally:
        session.close()
    return samples


def doubling(low: int, high: int) -> list[int]:
    return [low << k for k in range((high // low).bit_length())]


# Calibration every factor 2 and half-way (x 1.5); held out: x 1.25 of each
# power of 2. Coarser calibration misses where a transfer stops fitting in a
# cache level (on tcp the time per byte rises between 512 KiB and 1 MiB on a
# 512 KiB-L2 machine): at factor-2 spacing the size half-way was predicted
# up to 16% long, at factor 4 up to 23% (docs/plan.md, "Calibrating").
TCP = doubling(64 * K, 16 * M)
SHM = doubling(64 * K, 4 * M)
# Each band is calibrated and checked in a session of its own. On tcp,
# 128-256 KiB transfers measured in rounds with 1-16 MiB ones took up to 20%
# longer at some sizes than at their neighbours (their p50 sits in a broad,
# bimodal spread), bumps that no curve through the neighbours knows; measured
# apart, as `kvx bench --sweep` measures the small sizes before any large one,
# they follow the curve within a few percent. shm showed no such bumps.
BANDS = {"tcp": [(64 * K, 1 * M), (1 * M, 16 * M)], "shm": [(64 * K, 4 * M)]}


def denser(sizes: list[int]) -> list[int]:
    return sorted(sizes + [3 * n // 2 for n in sizes[:-1]])


@pytest.mark.parametrize(
    "backend, calibrate, held_out",
    [
        ("tcp", denser(TCP), [5 * n // 4 for n in TCP[:-1]]),
        ("shm", denser(SHM), [5 * n // 4 for n in SHM[:-1]]),
    ],
)
def test_curve_predicts_held_out_sizes(backend, calibrate, held_out):
    started = time.monotonic()
    errors = {}
    for low, high in BANDS[backend]:
        band_calibrate = [n for n in calibrate if low <= n <= high]
        band_held_out = [n for n in held_out if low < n < high]
        samples = measure(backend, sorted(band_calibrate + band_held_out))
        # The calibration in the format of `kvx bench --sweep --json`.
        sweep = {
            "backend": backend,
            "points": [
                {
                    "bytes": n,
                    "latency_us_p50": statistics.median(samples[n]) * 1e6,
                    "latency_us_p99": float(np.percentile(samples[n], 99)) * 1e6,
                }
                for n in band_calibrate
            ],
        }
        curve = Curve.from_sweep(sweep)
        errors.update({n: curve.transfer_s(n) / statistics.median(samples[n]) - 1 for n in band_held_out})
    assert sorted(errors) == sorted(held_out)  # every held-out size is checked
    report = ", ".join(f"{n // K} KiB {e:+.1%}" for n, e in errors.items())
    print(f"\n{backend}: predicted vs measured p50 ({time.monotonic() - started:.1f} s): {report}")
    assert max(abs(e) for e in errors.values()) <= TOLERANCE[backend], report
