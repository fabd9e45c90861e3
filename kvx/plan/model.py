"""The analytical model of KV transfer in a prefill/decode cluster.

Pure functions, no I/O. Requests arrive as a Poisson stream at ``rate_rps``,
spread evenly over the prefill instances. Each prefill instance is one FIFO
server working at ``prefill_tokens_per_s`` (an M/G/1 queue; M/D/1 for a fixed
prompt length). Each request's KV then leaves over the instance's NICs, split
evenly among them; every NIC sees every request of its instance, so the NICs
move in step and one NIC's queue (M/G/1 again) stands for them all.

TTFT = prefill wait + prefill compute + transfer wait + transfer + overhead.
The two waits are taken as independent (their sum is a convolution). Means
are the Pollaczek-Khinchine formula; percentiles come from each queue's whole
waiting-time distribution, computed numerically as the compound geometric
sum of residual service times (Pollaczek-Khinchine / Benes) on a grid with
FFTs; docs/plan.md gives the formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from kvx.errors import ConfigError
from kvx.plan.links import Curve
from kvx.plan.shapes import KVShape

# 8 x H100 at about 40% of 989 TFLOPS (bf16, dense) over 2 x 70e9 FLOP per
# token: about 22,600 tokens/s for a 70B model on one node; rounded down. A
# placeholder of the right order, not a measurement: pass your own.
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
DEFAULT_OVERHEAD_S = 0.002  # HTTP and proxy hops per request
DEFAULT_TARGET_SHARE = 0.1
GRID_CELLS = 1 << 15
TAIL_MASS = 1e-7  # the probability beyond the grid's end
# The grid resolves a wait only while its step is well under the mean service
# time; past that (a queue within about 0.5% of saturation) the waiting time
# is taken as exponential with the Cramer-Lundberg decay rate instead.
GRID_STEP_PER_SERVICE_MAX = 1 / 8
PROMPT_BINS_MAX = 10_000
NICS_SEARCH_MAX = 1024

Services = Sequence[tuple[float, float]]  # (service seconds, weight)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What the model needs to know about one P/D cluster and its load."""

    shape: KVShape
    prompt: tuple[tuple[int, float], ...]  # (tokens, weight); weights need not sum to 1
    rate_rps: float
    curve: Curve
    prefill_instances: int = 1
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    overhead_s: float = DEFAULT_OVERHEAD_S
    nics: int = 1
    block_tokens: int = 16
    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    decode_pp: int = 1
    target_share: float = DEFAULT_TARGET_SHARE

    def __post_init__(self) -> None:
        if not 1 <= len(self.prompt) <= PROMPT_BINS_MAX:
            raise ConfigError(f"the prompt lengths need 1..{PROMPT_BINS_MAX} entries, not {len(self.prompt)}")
        for tokens, weight in self.prompt:
            if not isinstance(tokens, int) or not 1 <= tokens <= 1 << 24:
                raise ConfigError(f"a prompt length must be 1..16777216 tokens, not {tokens!r}")
            if not (math.isfinite(weight) and weight >= 0):
                raise ConfigError(f"a prompt length's weight must be >= 0, not {weight!r}")
        total = sum(w for _, w in self.prompt)
        if not total > 0:
            raise ConfigError("the prompt lengths' weights sum to 0")
        if not math.isfinite(total):
            raise ConfigError(
                "the prompt lengths' weights sum past the largest float; scale them down (they are relative)"
            )
        _positive("request rate", self.rate_rps, allow_zero=True)
        _positive("prefill tokens/s", self.prefill_tokens_per_s)
        _positive("overhead", self.overhead_s, allow_zero=True)
        if not 0 < self.target_share < 1:
            raise ConfigError(f"the target share of TTFT must be between 0 and 1, not {self.target_share!r}")
        for name in ("prefill_instances", "nics"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= NICS_SEARCH_MAX:
                raise ConfigError(f"{name.replace('_', ' ')} must be 1..{NICS_SEARCH_MAX}, not {value!r}")
        # Splits are checked by the shape (heads over TP, layers over PP).
        self.shape.request_bytes(1, self.prefill_tp, self.prefill_pp, self.block_tokens)
        self.shape.request_bytes(1, self.decode_tp, self.decode_pp, self.block_tokens)

    @functools.cached_property
    def weights(self) -> np.ndarray:
        w = np.array([w for _, w in self.prompt], float)
        return w / w.sum()

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """Each prompt length, in the order of ``prompt``."""
        return np.array([t for t, _ in self.prompt], float)

    @functools.cached_property
    def wire_bytes(self) -> np.ndarray:
        """:meth:`request_bytes` of each prompt length, computed once: the
        NIC search asks for them again at every NIC count."""
        return np.array([self.request_bytes(t) for t, _ in self.prompt], float)

    @property
    def instance_rate_rps(self) -> float:
        return self.rate_rps / self.prefill_instances

    def request_bytes(self, tokens: int) -> int:
        """Bytes one request puts on the wire: every decode rank gets its
        share (its own copy of replicated heads or an MLA latent)."""
        s = self.shape
        per_rank = s.request_bytes(tokens, self.decode_tp, self.decode_pp, self.block_tokens)
        return per_rank * self.decode_tp * self.decode_pp

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def transfer_service_s(self, tokens: int, nics: int | None = None) -> float:
        """One request's transfer with no wait: each NIC moves its share at once."""
        return self.curve.transfer_s(self.request_bytes(tokens) / (nics or self.nics))


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, not {value!r}")


def utilisation(rate_rps: float, services: Services) -> float:
    """rho = lambda E[S]."""
    total = sum(w for _, w in services)
    return rate_rps * sum(s * w for s, w in services) / total


def mg1_wait_mean_s(rate_rps: float, services: Services) -> float:
    """Pollaczek-Khinchine: E[W] = lambda E[S^2] / (2 (1 - rho)); inf at rho >= 1."""
    total = sum(w for _, w in services)
    rho = utilisation(rate_rps, services)
    if rho >= 1:
        return math.inf
    second = sum(s * s * w for s, w in services) / total
    return rate_rps * second / (2 * (1 - rho))


def transfer_queue_mean_s(
    rate_rps: float, curve: Curve, sizes: Sequence[int] | Sequence[tuple[int, float]]
) -> float:
    """Mean time of one transfer on one link, waiting included (M/G/1, FIFO):
    transfers arrive at ``rate_rps`` (Poisson), each of a size drawn from
    ``sizes`` (bytes, or (bytes, weight)), each taking ``curve.transfer_s``."""
    services = [
        (curve.transfer_s(s[0]), float(s[1])) if isinstance(s, tuple) else (curve.transfer_s(s), 1.0)
        for s in sizes
    ]
    total = sum(w for _, w in services)
    mean_service = sum(s * w for s, w in services) / total
    return mg1_wait_mean_s(rate_rps, services) + mean_service


def decay_rate(rate_rps: float, services: Services) -> float:
    """The Cramer-Lundberg exponent delta of the waiting time's tail,
    P(W > t) ~ C exp(-delta t): the positive root of
    lambda (E[exp(delta S)] - 1) = delta."""
    s = np.array([x for x, _ in services])
    w = np.array([x for _, x in services])
    w = w / w.sum()
    smax = float(s.max())

    def f(d: float) -> float:
        # expm1: near saturation d * s is tiny and exp(.) - 1 would cancel.
        return rate_rps * float(np.dot(w, np.expm1(d * s))) - d

    hi = 1.0 / float(np.dot(w, s))
    while f(hi) <= 0:
        if hi * smax > 600:
            return hi  # the root lies past what exp can hold: the tail is that short
        hi *= 2
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


def wait_span_s(rate_rps: float, services: Services) -> float:
    """A time the waiting time exceeds with probability about TAIL_MASS."""
    rho = utilisation(rate_rps, services)
    if rho <= 0:
        return 0.0
    return math.log(1 / TAIL_MASS) / decay_rate(rate_rps, services) + max(s for s, _ in services)


def wait_pmf(rate_rps: float, services: Services, dt: float, cells: int) -> np.ndarray:
    """P(W in cell j), cell j centred on j * dt: W is a geometric number
    (P(N = n) = (1 - rho) rho^n) of residual service times, whose density is
    (1 - F_S(x)) / E[S]; its transform is (1 - rho) / (1 - rho H)."""
    rho = utilisation(rate_rps, services)
    pmf = np.zeros(cells)
    if rho <= 0:
        pmf[0] = 1.0
        return pmf
    assert rho < 1, "wait_pmf of an overloaded queue"
    if coarse(services, dt):
        return _exponential_wait_pmf(rate_rps, services, dt, cells)
    s = np.array([x for x, _ in services])
    w = np.array([x for _, x in services])
    w = w / w.sum()
    order = np.argsort(s)
    s, w = s[order], w[order]
    # E[min(x, S)] at the cells' edges, then the residual's mass per cell.
    edges = (np.arange(cells + 1) - 0.5) * dt
    edges[0] = 0.0
    below_s = np.concatenate(([0.0], np.cumsum(s * w)))
    above_w = np.concatenate((1 - np.concatenate(([0.0], np.cumsum(w)))[:-1], [0.0]))
    k = np.searchsorted(s, edges)
    emin = below_s[k] + edges * np.clip(above_w[k], 0, 1)
    h = np.diff(emin) / float(np.dot(s, w))
    n = 2 * cells
    hf = np.fft.rfft(h, n)
    pmf = np.fft.irfft((1 - rho) / (1 - rho * hf), n)[:cells]
    pmf = np.clip(pmf, 0, None)
    return pmf / pmf.sum()


def coarse(services: Services, dt: float) -> bool:
    """Whether a grid step of ``dt`` is too coarse for the residual service
    time: most of its mass would fall into cell 0 and the waiting time
    would collapse to 0 (the percentiles with it)."""
    return dt > GRID_STEP_PER_SERVICE_MAX * _mean(services)


def _exponential_wait_pmf(rate_rps: float, services: Services, dt: float, cells: int) -> np.ndarray:
    """The heavy-traffic waiting time on the grid: P(W > t) = rho exp(-delta t)
    (Cramer-Lundberg, with the constant at rho as in M/M/1; near saturation
    both the constant and the mean rho / delta tend to the exact ones)."""
    rho = utilisation(rate_rps, services)
    delta = decay_rate(rate_rps, services)
    edges = (np.arange(cells) + 0.5) * dt  # upper edges of cells 0..cells-1
    cdf = 1 - rho * np.exp(-delta * edges)
    pmf = np.diff(np.concatenate(([0.0], cdf)))
    return pmf / pmf.sum()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The model's answer for one cluster; times in seconds, sizes in bytes."""

    bytes_per_token: int
    prefill_rank_bytes: float  # mean over the prompt lengths
    decode_rank_bytes: float
    request_bytes: float  # on the wire, all ranks
    nic_bytes: float  # one NIC's share of a request
    prefill_s: float
    prefill_utilisation: float
    prefill_wait_mean_s: float
    prefill_wait_p50_s: float
    prefill_wait_p99_s: float
    transfer_service_s: float  # mean, no waiting
    nic_utilisation: float
    transfer_wait_mean_s: float
    transfer_mean_s: float  # waiting included
    transfer_p50_s: float
    transfer_p99_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    transfer_share: float  # transfer_mean_s / ttft_mean_s
    target_share: float
    nics: int
    nics_needed: int | None  # fewest NICs keeping transfer_share <= target; None: none does
    layer_compute_s: float  # the mean prompt's compute per layer
    layer_transfer_s: float  # its transfer per layer
    overlap_hides: bool  # layer by layer, the transfer hides behind compute
    overlap_exposed_s: float  # what of the transfer is left after compute, layer by layer
    overloaded: str | None  # which server is at or past 100%
    approximation: str | None = None  # which waits' percentiles come from the exponential tail

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _services(
    cluster: Cluster, nics: int | None = None
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    w = cluster.weights.tolist()
    prefill_s = (cluster.tokens / cluster.prefill_tokens_per_s).tolist()
    transfer_s = cluster.curve.transfer_s_many(cluster.wire_bytes / (nics or cluster.nics)).tolist()
    return list(zip(prefill_s, w, strict=True)), list(zip(transfer_s, w, strict=True))


def _mean(services: Services) -> float:
    return sum(s * w for s, w in services) / sum(w for _, w in services)


def mean_ttft_s(cluster: Cluster, nics: int | None = None) -> tuple[float, float]:
    """(mean TTFT, mean transfer with its wait): the Pollaczek-Khinchine means."""
    lam = cluster.instance_rate_rps
    prefill, transfer = _services(cluster, nics)
    transfer_mean = mg1_wait_mean_s(lam, transfer) + _mean(transfer)
    ttft = mg1_wait_mean_s(lam, prefill) + _mean(prefill) + transfer_mean + cluster.overhead_s
    return ttft, transfer_mean


def nics_needed(cluster: Cluster) -> int | None:
    """The fewest NICs per prefill instance that keep the transfer's mean
    share of the mean TTFT at or under the target; None when no count does
    (the overhead, or the curve's fixed cost, alone is over it, or prefill
    is overloaded, which no NIC count helps).

    A bisection: more NICs make each NIC's share smaller, so (on a curve that
    rises with size) the transfer, waiting included, shorter; its share
    T / (P + T + overhead) of TTFT rises with T, so it falls as NICs are
    added. On a measured curve whose noise dips between points the count
    found keeps the share under the target but may not be the fewest."""

    def meets(nics: int) -> bool:
        ttft, transfer = mean_ttft_s(cluster, nics)
        return math.isfinite(ttft) and transfer <= cluster.target_share * ttft

    prefill, _ = _services(cluster)
    if utilisation(cluster.instance_rate_rps, prefill) >= 1 or not meets(NICS_SEARCH_MAX):
        return None
    lo, hi = 0, NICS_SEARCH_MAX  # meets(hi); lo fails or is 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _quantile(cdf: np.ndarray, dt: float, shifts: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-quantile of the mixture over k of (shift_k + X), X with the
    given cdf on the grid (value j * dt at cell j)."""
    grid = np.arange(len(cdf)) * dt

    def at(t: float) -> float:
        return float(np.dot(weights, np.interp(t - shifts, grid, cdf, left=0.0, right=1.0)))

    lo, hi = float(shifts.min()), float(shifts.max()) + grid[-1]
    for _ in range(100):
        mid = (lo + hi) / 2
        if at(mid) >= q:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(hi, 1e-9):
            break
    return hi


def _distributions(lam: float, prefill: Services, transfer: Services) -> tuple[np.ndarray, np.ndarray, float]:
    """The two waits' pmfs on one grid (for their sum), and its step. Where
    one wait is far longer than the other, the shorter lies within a few of
    the grid's cells: it adds at most a few steps (span / GRID_CELLS) to TTFT."""
    span = wait_span_s(lam, prefill) + wait_span_s(lam, transfer)
    dt = max(span, 1e-9) / GRID_CELLS
    return wait_pmf(lam, prefill, dt, GRID_CELLS), wait_pmf(lam, transfer, dt, GRID_CELLS), dt


def _own_cdf(lam: float, services: Services) -> tuple[np.ndarray, float, bool]:
    """One wait's cdf on a grid of its own span, its step, and whether that
    step is coarse (the wait near saturation: the exponential tail)."""
    dt = max(wait_span_s(lam, services), 1e-9) / GRID_CELLS
    rho = utilisation(lam, services)
    return np.cumsum(wait_pmf(lam, services, dt, GRID_CELLS)), dt, rho > 0 and coarse(services, dt)


def _percent(x: float) -> str:
    # An exponent past 10,000%: a tiny --prefill-tokens-per-s is valid input.
    return f"{x:.0%}" if x < 100 else f"{x * 100:.3g}%"


def evaluate(cluster: Cluster) -> Plan:
    """The whole model for one cluster."""
    c, s = cluster, cluster.shape
    lam = c.instance_rate_rps
    w = c.weights
    tokens = c.tokens
    prefill, transfer = _services(c)
    rho_p, rho_t = utilisation(lam, prefill), utilisation(lam, transfer)
    mean_tokens = float(np.dot(w, tokens))
    wire = float(np.dot(w, c.wire_bytes))
    ttft_mean, transfer_mean = mean_ttft_s(c)
    overloaded = None
    if rho_p >= 1:
        overloaded = f"prefill instances at {_percent(rho_p)}"
    elif rho_t >= 1:
        overloaded = f"NICs at {_percent(rho_t)}"
    pw = tt = ttft = (math.inf, math.inf)
    approximation = None
    if overloaded is None:
        pmf_p, pmf_t, dt = _distributions(lam, prefill, transfer)
        # Each wait's own percentiles on a grid of its own span: on the shared
        # one a short wait next to a long one would fall into cell 0.
        cdf_p, dt_p, coarse_p = _own_cdf(lam, prefill)
        cdf_t, dt_t, coarse_t = _own_cdf(lam, transfer)
        approx = [name for name, flag in (("prefill", coarse_p), ("transfer", coarse_t)) if flag]
        if approx:
            approximation = (
                f"{' and '.join(approx)} wait near saturation: percentiles from the exponential "
                "tail (Cramer-Lundberg)"
            )
        both = np.cumsum(
            np.fft.irfft(np.fft.rfft(pmf_p, 2 * GRID_CELLS) * np.fft.rfft(pmf_t, 2 * GRID_CELLS))[:GRID_CELLS]
        )
        zero = np.zeros(1)
        one = np.ones(1)
        pw = (_quantile(cdf_p, dt_p, zero, one, 0.5), _quantile(cdf_p, dt_p, zero, one, 0.99))
        t_shift = np.array([x for x, _ in transfer])
        tt = (_quantile(cdf_t, dt_t, t_shift, w, 0.5), _quantile(cdf_t, dt_t, t_shift, w, 0.99))
        shifts = np.array([p + x for (p, _), (x, _) in zip(prefill, transfer, strict=True)]) + c.overhead_s
        ttft = (_quantile(both, dt, shifts, w, 0.5), _quantile(both, dt, shifts, w, 0.99))
    layers = s.layers_per_stage(c.prefill_pp)
    stage_layers = max(1, sum(layers))
    prefill_mean = _mean(prefill)
    layer_compute = prefill_mean / (c.prefill_pp * stage_layers)
    layer_transfer = c.curve.transfer_s(wire / c.nics / s.layers)
    if layer_transfer <= layer_compute:
        exposed = layer_transfer
    else:
        exposed = s.layers * (layer_transfer - layer_compute) + layer_compute
    return Plan(
        bytes_per_token=s.bytes_per_token(),
        prefill_rank_bytes=float(
            np.dot(w, [s.request_bytes(int(t), c.prefill_tp, c.prefill_pp, c.block_tokens) for t in tokens])
        ),
        decode_rank_bytes=float(
            np.dot(w, [s.request_bytes(int(t), c.decode_tp, c.decode_pp, c.block_tokens) for t in tokens])
        ),
        request_bytes=wire,
        nic_bytes=wire / c.nics,
        prefill_s=mean_tokens / c.prefill_tokens_per_s,
        prefill_utilisation=rho_p,
        prefill_wait_mean_s=mg1_wait_mean_s(lam, prefill),
        prefill_wait_p50_s=pw[0],
        prefill_wait_p99_s=pw[1],
        transfer_service_s=_mean(transfer),
        nic_utilisation=rho_t,
        transfer_wait_mean_s=mg1_wait_mean_s(lam, transfer),
        transfer_mean_s=transfer_mean,
        transfer_p50_s=tt[0],
        transfer_p99_s=tt[1],
        ttft_mean_s=ttft_mean,
        ttft_p50_s=ttft[0],
        ttft_p99_s=ttft[1],
        transfer_share=transfer_mean / ttft_mean if math.isfinite(ttft_mean) else math.nan,
        target_share=c.target_share,
        nics=c.nics,
        nics_needed=nics_needed(c),
        layer_compute_s=layer_compute,
        layer_transfer_s=layer_transfer,
        overlap_hides=layer_transfer <= layer_compute,
        overlap_exposed_s=exposed,
        overloaded=overloaded,
        approximation=approximation,
    )
