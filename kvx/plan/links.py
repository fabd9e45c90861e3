"""Links and their curves: how long one transfer of ``n`` bytes takes.

A :class:`Curve` is either a default (``fixed_s + n / bandwidth``, from a
link's nominal peak and an efficiency) or a measurement: the points of
``kvx bench --sweep --json``. Between measured sizes the time is interpolated
linearly in the size (each segment is a local ``fixed + bytes / bandwidth``);
beyond the largest size it grows at the bandwidth of the last segment, below
the smallest it is the smallest size's time. docs/plan.md says why (held-out
sizes predicted best that way on this machine's sweeps).

The defaults are nominal figures from vendor data sheets and published
measurements, not measurements of kvx; see :data:`LINKS` and docs/plan.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvx.errors import ConfigError

SWEEP_POINTS_MAX = 4096


@dataclasses.dataclass(frozen=True)
class Curve:
    """The p50 (and p99) time of one transfer against its size in bytes."""

    fixed_s: float
    bandwidth_bytes_per_s: float
    # Measured (bytes, p50 seconds, p99 seconds), sizes strictly increasing.
    points: tuple[tuple[int, float, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ConfigError(f"a curve's fixed cost must be >= 0 seconds, not {self.fixed_s!r}")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ConfigError(f"a curve's bandwidth must be > 0 bytes/s, not {self.bandwidth_bytes_per_s!r}")
        sizes = [p[0] for p in self.points]
        assert sizes == sorted(set(sizes)), "curve points must have strictly increasing sizes"

    def transfer_s(self, nbytes: float) -> float:
        """The p50 time of one transfer of ``nbytes``."""
        return self._at(nbytes, 1)

    def p99_s(self, nbytes: float) -> float:
        """The p99 time of one transfer of ``nbytes`` (the p50 for a default curve)."""
        return self._at(nbytes, 2)

    def transfer_s_many(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`transfer_s` of each of an array of sizes, at once."""
        n = np.asarray(nbytes, float)
        pts = self.points
        if not pts:
            out = self.fixed_s + n / self.bandwidth_bytes_per_s
        else:
            sizes = np.array([p[0] for p in pts], float)
            times = np.array([p[1] for p in pts], float)
            # np.interp holds the first point's time below the smallest size,
            # as _at does; past the largest size the rest goes at the bandwidth.
            out = np.interp(n, sizes, times) + np.maximum(n - sizes[-1], 0.0) / self.bandwidth_bytes_per_s
        return np.where(n > 0, out, 0.0)

    def _at(self, nbytes: float, column: int) -> float:
        if nbytes <= 0:
            return 0.0
        pts = self.points
        if not pts:
            return self.fixed_s + nbytes / self.bandwidth_bytes_per_s
        if nbytes <= pts[0][0]:
            return pts[0][column]
        if nbytes > pts[-1][0]:
            # Past the largest size: the last point plus the rest at the curve's bandwidth.
            return pts[-1][column] + (nbytes - pts[-1][0]) / self.bandwidth_bytes_per_s
        # Bisect for the segment (b0, b1] holding nbytes: sweeps have up to
        # SWEEP_POINTS_MAX points and the model asks for many sizes.
        i = bisect.bisect_left(self._sizes, nbytes)
        (b0, *t0), (b1, *t1) = pts[i - 1], pts[i]
        a, b = t0[column - 1], t1[column - 1]
        return a + (b - a) * (nbytes - b0) / (b1 - b0)

    @property
    def _sizes(self) -> list[int]:
        cached = self.__dict__.get("_sizes_cache")
        if cached is None:
            cached = [p[0] for p in self.points]
            object.__setattr__(self, "_sizes_cache", cached)
        return cached

    @classmethod
    def from_points(cls, points: list[tuple[int, float, float]], source: str = "measured") -> Curve:
        """A curve through measured (bytes, p50_s, p99_s) points; repeated
        sizes are merged by their median."""
        by_size: dict[int, list[tuple[float, float]]] = {}
        for nbytes, p50, p99 in points:
            by_size.setdefault(nbytes, []).append((p50, p99))
        if len(by_size) < 2:
            raise ConfigError("a measured curve needs at least two transfer sizes")
        merged = []
        for nbytes in sorted(by_size):
            p50s = sorted(t[0] for t in by_size[nbytes])
            p99s = sorted(t[1] for t in by_size[nbytes])
            merged.append((nbytes, _median(p50s), max(_median(p99s), _median(p50s))))
        (b0, t0, _), (b1, t1, _) = merged[-2], merged[-1]
        # The last segment's bandwidth carries the curve past its largest size; a
        # noisy last segment that does not rise falls back to the whole range's.
        slope = (t1 - t0) / (b1 - b0)
        if slope <= 0:
            slope = (t1 - merged[0][1]) / (b1 - merged[0][0])
        if slope <= 0:
            raise ConfigError(
                "the measured curve does not rise with size; measure again on a quieter machine"
            )
        fixed = max(0.0, merged[0][1] - merged[0][0] * slope)
        return cls(fixed, 1.0 / slope, tuple(merged), source)

    @classmethod
    def from_sweep(cls, data: Any, source: str = "kvx bench --sweep") -> Curve:
        """The curve of one ``kvx bench --sweep --json`` result (a dict)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("points"), list):
            raise ConfigError(
                "a sweep file must be the JSON object of `kvx bench --sweep --json`, with 'points'"
            )
        raw = data["points"]
        if not 2 <= len(raw) <= SWEEP_POINTS_MAX:
            raise ConfigError(f"a sweep needs 2..{SWEEP_POINTS_MAX} points, not {len(raw)}")
        points = []
        for i, p in enumerate(raw):
            if not isinstance(p, Mapping):
                raise ConfigError(f"sweep point {i} is not an object")
            nbytes, p50 = p.get("bytes"), p.get("latency_us_p50")
            p99 = p.get("latency_us_p99", p50)
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
                raise ConfigError(f"sweep point {i}: 'bytes' must be a positive whole number, not {nbytes!r}")
            for key, value in (("latency_us_p50", p50), ("latency_us_p99", p99)):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1e12:
                    raise ConfigError(f"sweep point {i}: {key!r} must be a positive number, not {value!r}")
            points.append((nbytes, float(p50) / 1e6, float(p99) / 1e6))  # type: ignore[arg-type]
        backend = data.get("backend")
        return cls.from_points(points, f"{source} ({backend})" if isinstance(backend, str) else source)


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


@dataclasses.dataclass(frozen=True)
class Link:
    """One path's nominal peak (one direction, one GPU's link or one NIC),
    the share of it a transfer reaches, and a fixed cost per transfer."""

    name: str
    kind: str  # nvlink, pcie, rdma, tcp
    peak_bytes_per_s: float
    efficiency: float
    fixed_s: float
    source: str

    def curve(self) -> Curve:
        return Curve(self.fixed_s, self.peak_bytes_per_s * self.efficiency, (), f"default for {self.name}")


GB = 1e9
# Defaults, not measurements: peaks from the vendors' data sheets, efficiencies
# from published measurements (docs/plan.md gives each source).
LINKS: dict[str, Link] = {
    "nvlink3": Link(
        "nvlink3", "nvlink", 300 * GB, 0.8, 10e-6, "A100 SXM: NVLink 3, 600 GB/s both directions"
    ),
    "nvlink4": Link(
        "nvlink4", "nvlink", 450 * GB, 0.8, 10e-6, "H100 SXM: NVLink 4, 900 GB/s both directions"
    ),
    "nvlink5": Link("nvlink5", "nvlink", 900 * GB, 0.8, 10e-6, "B200: NVLink 5, 1.8 TB/s both directions"),
    "pcie4": Link("pcie4", "pcie", 31.5 * GB, 0.8, 10e-6, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b"),
    "pcie5": Link("pcie5", "pcie", 63 * GB, 0.8, 10e-6, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b"),
}
RDMA_EFFICIENCY = 0.87  # Mooncake: 87 GB/s over 4 x 200 Gb/s RoCE
TCP_EFFICIENCY = 0.36  # Mooncake: about 36 GB/s over TCP on the same 4 x 200 Gb/s
RDMA_DEFAULT_GBITS = 400
TCP_DEFAULT_GBITS = 100
NICS_MAX = 1024


def rdma_link(gbits: float) -> Link:
    return Link(
        f"rdma {gbits:g} Gb/s",
        "rdma",
        gbits / 8 * GB,
        RDMA_EFFICIENCY,
        20e-6,
        "Mooncake Transfer Engine, RoCE",
    )


def tcp_link(gbits: float) -> Link:
    return Link(
        f"tcp {gbits:g} Gb/s", "tcp", gbits / 8 * GB, TCP_EFFICIENCY, 50e-6, "Mooncake, TCP transport"
    )


def parse_link(spec: str) -> tuple[Link, int | None]:
    """A link and, where the spec names it, the NICs per instance:
    ``nvlink3|nvlink4|nvlink5|pcie4|pcie5``, ``rdma[:GBITS]``, ``tcp[:GBITS]``
    or ``NxGBITS`` (N RDMA NICs of GBITS Gb/s each, e.g. 8x400)."""
    text = spec.strip().lower()
    if text in LINKS:
        return LINKS[text], None
    m = re.fullmatch(r"(rdma|tcp)(?::(\d+(?:\.\d+)?))?", text)
    if m:
        gbits = (
            float(m.group(2))
            if m.group(2)
            else (RDMA_DEFAULT_GBITS if m.group(1) == "rdma" else TCP_DEFAULT_GBITS)
        )
        _check_gbits(gbits, spec)
        return (rdma_link(gbits) if m.group(1) == "rdma" else tcp_link(gbits)), None
    m = re.fullmatch(r"(\d+)\s*x\s*(\d+(?:\.\d+)?)", text)
    if m:
        nics, gbits = int(m.group(1)), float(m.group(2))
        if not 1 <= nics <= NICS_MAX:
            raise ConfigError(f"link {spec!r}: 1..{NICS_MAX} NICs, not {nics}")
        _check_gbits(gbits, spec)
        return rdma_link(gbits), nics
    raise ConfigError(
        f"link {spec!r} is none of {', '.join(LINKS)}, rdma[:GBITS], tcp[:GBITS] or NxGBITS (e.g. 8x400)"
    )


def _check_gbits(gbits: float, spec: str) -> None:
    if not 0.1 <= gbits <= 100_000:
        raise ConfigError(f"link {spec!r}: a NIC's speed must be 0.1..100000 Gb/s, not {gbits:g}")
