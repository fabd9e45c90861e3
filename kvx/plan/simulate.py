"""A discrete-event simulation of a kvx prefill/decode cluster.

It answers what the closed formulas of the plan cannot: tails (TTFT p99), fan-in at the
decode NICs, an oversubscribed spine, node failures and the metadata service's load, at
up to 100,000 nodes. Its inputs are plain numbers and callables (``SimConfig``), so any
model can feed it; ``simulate(config)`` returns a ``SimResult``.

What one request does (pull mode, docs/plan-simulate.md):

1. It arrives (Poisson, ``rate`` per second for the whole cluster) and is routed to a
   prefill and a decode instance drawn uniformly among those the router believes up.
2. Its GetAgent lookups that miss the client-side cache queue at the metadata service.
3. It queues FIFO at its prefill instance (one server at ``prefill_tokens_per_s``).
4. Its KV transfer queues FIFO for a NIC of the prefill node, then FIFO (in the order
   transfers reach it) for a NIC of the decode node; each NIC is busy for the
   transfer's time alone on a NIC, ``transfer_s(request_bytes(tokens))``.
5. TTFT = ``overhead_s`` + lookup latency + prefill wait + prefill + transfer wait +
   transfer. Decode's first step is not included (add it to ``overhead_s``).

The event loop is discrete-event: arrivals (drawn in numpy batches, in time order) are
merged with a heap (heapq) of rare events (failures, failure detection, restarts, spine
windows). FIFO queues served in arrival order (prefill, the sending NIC, the metadata
cores) are advanced by the Lindley recursion when a request arrives. Transfers reaching
a decode NIC are the one stream out of arrival order: they wait in a list that is sorted
in batches up to each time by which all of them are known (the end of an arrival batch,
a rare event on a decode node), which keeps one request at about two events' cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvx.errors import ConfigError
from kvx.plan._sim_engine import Engine
from kvx.plan.links import parse_link
from kvx.plan.model import DEFAULT_PREFILL_TOKENS_PER_S

__all__ = [
    "MetadataLoad",
    "SimConfig",
    "SimResult",
    "add_simulate_parser",
    "config_from_args",
    "format_result",
    "run_simulate",
    "run_simulate_cli",
    "simulate",
]

log = logging.getLogger(__name__)

#: A sampler draws ``n`` prompt lengths (tokens) with the generator it is given.
PromptSampler = Callable[[np.random.Generator, int], np.ndarray]
PromptTokens = int | Sequence[tuple[int, float]] | PromptSampler

_FAILURES_MAX = 1_000_000  # failures are drawn up front; more is a misconfiguration
# Bounds on the inputs: every per-instance list, heap and batch is sized from these, so an
# absurd count is refused up front instead of running out of memory.
NODES_MAX = 1_000_000  # prefill + decode
NICS_MAX = 1024  # per node
METADATA_CORES_MAX = 4096
LOOKUPS_MAX = 1024  # per request
AGENTS_PER_NODE_MAX = 100_000  # only arithmetic: no per-agent state
WATCHERS_MAX = 100_000_000
PROMPT_TOKENS_MAX = 100_000_000
PROMPT_BINS_MAX = 100_000
SEED_MAX = 2**64 - 1
DURATION_MAX_S = 1e8  # about three years
SPINE_WINDOWS_MAX = 10_000_000  # spine windows (events) in one run
FLOAT_MAX = 1e15  # any other rate, time or factor


def _count(name: str, value: Any, low: int, high: int) -> None:
    """An integer in [low, high] (bools and floats are refused: they hide mistakes)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], not {value!r}")


def _number(name: str, value: Any, low: float, high: float = FLOAT_MAX, low_open: bool = False) -> None:
    """A finite real number in [low, high] ((low, high] with low_open)."""
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if ok:
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"({low:g}" if low_open else f"[{low:g}"
        raise ConfigError(f"{name} must be a finite number in {bound}, {high:g}], not {value!r}")


@dataclass(frozen=True)
class MetadataLoad:
    """The metadata service's work and capacity.

    Costs are CPU seconds per operation on one core of the service, from
    benchmarks/RESULTS.md (kvx metadata, memory store): about 0.5 ms per GetAgent and
    0.1 ms per lease renewal. ``register_cost_s`` and ``notify_cost_s`` (one change
    sent to one watcher) are estimates. Agents renew every ``renewal_interval_s``
    (kvx: a third of the lease ttl). ``watchers``: watch streams receiving every
    change; None means one per node. A lookup that has not finished after
    ``timeout_s`` fails its request.
    """

    lookups_per_request: int = 1
    cache_hit_ratio: float = 0.9
    agents_per_node: int = 8
    lease_ttl_s: float = 10.0
    renewal_interval_s: float = 10.0 / 3
    watchers: int | None = None
    cores: int = 1
    lookup_cost_s: float = 0.5e-3
    renewal_cost_s: float = 0.1e-3
    register_cost_s: float = 0.5e-3
    notify_cost_s: float = 0.02e-3
    timeout_s: float = 5.0

    def check(self) -> None:
        _count("metadata lookups_per_request", self.lookups_per_request, 0, LOOKUPS_MAX)
        _number("metadata cache_hit_ratio", self.cache_hit_ratio, 0.0, 1.0)
        _count("metadata agents_per_node", self.agents_per_node, 0, AGENTS_PER_NODE_MAX)
        _count("metadata cores", self.cores, 1, METADATA_CORES_MAX)
        if self.watchers is not None:
            _count("metadata watchers (None: one per node)", self.watchers, 0, WATCHERS_MAX)
        for name in ("lease_ttl_s", "renewal_interval_s", "timeout_s"):
            _number(f"metadata {name}", getattr(self, name), 0.0, DURATION_MAX_S, low_open=True)
        for name in ("lookup_cost_s", "renewal_cost_s", "register_cost_s", "notify_cost_s"):
            _number(f"metadata {name}", getattr(self, name), 0.0, DURATION_MAX_S)


@dataclass(frozen=True)
class SimConfig:
    """One cluster and its load. Times in seconds, sizes in bytes.

    prompt_tokens: a fixed length, a histogram ``[(tokens, weight), ...]``, or a
        sampler ``f(generator, n) -> array of n lengths``.
    prefill_tokens_per_s: each prefill instance is one FIFO server at this speed;
        ``math.inf`` makes prefill instantaneous.
    request_bytes(tokens): KV bytes one request moves.
    transfer_s(bytes): time of one transfer alone on one NIC (a calibrated curve).
    nics_per_node: a transfer takes the NIC of its node that frees first.
    spine_oversubscription: > 1 makes transfers between leaves (``nodes_per_leaf``
        nodes each, prefill and decode spread evenly) share each leaf's uplink of
        nodes x NICs x ``nic_bytes_per_s`` / oversubscription. ``nic_bytes_per_s``
        None: from ``transfer_s`` (the slope between 1 GiB and 2 GiB).
    failure_rate: failures per node-hour (prefill and decode nodes alike); a failed
        node comes back after ``restart_s``.
    warmup_s: requests arriving before it are simulated but not counted.
    max_events, max_wall_s: hard caps; a run that hits one stops and says so.
    """

    prefill: int
    decode: int
    rate: float
    prompt_tokens: PromptTokens
    prefill_tokens_per_s: float
    request_bytes: Callable[[int], int]
    transfer_s: Callable[[int], float]
    nics_per_node: int = 1
    spine_oversubscription: float = 1.0
    nodes_per_leaf: int = 32
    nic_bytes_per_s: float | None = None
    spine_window_s: float = 1.0
    overhead_s: float = 0.0
    metadata: MetadataLoad = field(default_factory=MetadataLoad)
    failure_rate: float = 0.0
    restart_s: float = 60.0
    duration_s: float = 60.0
    warmup_s: float = 0.0
    seed: int = 0
    max_events: int = 1_000_000_000
    max_wall_s: float = 1800.0

    def check(self) -> None:
        """Raise ConfigError on an input the simulation cannot run."""
        if not (isinstance(self.prefill, int | np.integer) and isinstance(self.decode, int | np.integer)):
            raise ConfigError(f"prefill and decode must be integers, not {self.prefill!r}/{self.decode!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ConfigError(
                f"need at least one prefill and one decode instance, not {self.prefill}/{self.decode}"
            )
        if self.prefill + self.decode > NODES_MAX:
            raise ConfigError(
                f"at most {NODES_MAX:,} nodes (prefill + decode) are simulated, not "
                f"{self.prefill + self.decode:,}"
            )
        _number("rate", self.rate, 0.0, low_open=True)
        if self.prefill_tokens_per_s != math.inf:
            _number("prefill_tokens_per_s (math.inf: instant)", self.prefill_tokens_per_s, 0.0, low_open=True)
        _count("nics_per_node", self.nics_per_node, 1, NICS_MAX)
        _number("spine_oversubscription (1: non-blocking)", self.spine_oversubscription, 1.0)
        _count("nodes_per_leaf", self.nodes_per_leaf, 1, NODES_MAX)
        if self.nic_bytes_per_s is not None:
            _number("nic_bytes_per_s (or None)", self.nic_bytes_per_s, 0.0, low_open=True)
        for name in ("spine_window_s", "duration_s", "max_wall_s"):
            _number(name, getattr(self, name), 0.0, DURATION_MAX_S, low_open=True)
        for name in ("overhead_s", "restart_s"):
            _number(name, getattr(self, name), 0.0, DURATION_MAX_S)
        _number("failure_rate", self.failure_rate, 0.0)
        if not 0 <= self.warmup_s < self.duration_s:
            raise ConfigError(f"warmup_s must be in [0, duration_s={self.duration_s}), not {self.warmup_s}")
        _count("seed", self.seed, 0, SEED_MAX)
        _count("max_events", self.max_events, 1, 2**62)
        windows = self.duration_s / self.spine_window_s
        if self.spine_oversubscription > 1.0 and windows > SPINE_WINDOWS_MAX:
            raise ConfigError(
                f"{windows:.3g} spine windows (duration_s / spine_window_s); at most {SPINE_WINDOWS_MAX:,} "
                "are simulated: shorten duration_s (--duration) or lengthen spine_window_s"
            )
        expected = self.failure_rate * (self.prefill + self.decode) * self.duration_s / 3600
        if expected > _FAILURES_MAX:
            raise ConfigError(
                f"{expected:.0f} failures expected; at most {_FAILURES_MAX} are simulated: "
                "lower failure_rate or duration_s"
            )
        self.metadata.check()
        _check_prompt_tokens(self.prompt_tokens)


def _check_prompt_tokens(spec: PromptTokens) -> None:
    if callable(spec):
        return
    if isinstance(spec, int | np.integer) and not isinstance(spec, bool):
        if not 1 <= spec <= PROMPT_TOKENS_MAX:
            raise ConfigError(f"prompt_tokens must be >= 1 and <= {PROMPT_TOKENS_MAX:,}, not {spec}")
        return
    try:
        pairs = [(tokens, float(weight)) for tokens, weight in spec]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ConfigError(
            f"prompt_tokens must be an int, [(tokens, weight), ...] or a sampler f(rng, n), not {spec!r}"
        ) from None
    if not 1 <= len(pairs) <= PROMPT_BINS_MAX:
        raise ConfigError(f"a prompt_tokens histogram needs 1..{PROMPT_BINS_MAX:,} bins, not {len(pairs)}")
    for tokens, weight in pairs:
        if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer):
            raise ConfigError(f"prompt_tokens histogram lengths must be integers, not {tokens!r}")
        if not (1 <= tokens <= PROMPT_TOKENS_MAX and 0 <= weight <= FLOAT_MAX):
            raise ConfigError(
                f"a prompt_tokens histogram needs lengths in [1, {PROMPT_TOKENS_MAX:,}] and finite "
                f"weights in [0, {FLOAT_MAX:g}], not ({tokens!r}, {weight!r})"
            )
    if not sum(weight for _, weight in pairs) > 0:
        raise ConfigError(f"prompt_tokens histogram weights sum to zero: {spec!r}")


def _prompt_sampler(spec: PromptTokens) -> PromptSampler:
    if callable(spec):
        return spec
    if isinstance(spec, int | np.integer):
        fixed = int(spec)
        return lambda rng, n: np.full(n, fixed, dtype=np.int64)
    values = np.array([int(tokens) for tokens, _ in spec], dtype=np.int64)
    weights = np.array([float(weight) for _, weight in spec])
    probs = weights / weights.sum()
    return lambda rng, n: values[rng.choice(len(values), size=n, p=probs)]


@dataclass
class SimResult:
    """What one run measured, over requests arriving in [warmup_s, duration_s).

    Latency summaries (``ttft_s``, ``transfer_s``, ``prefill_wait_s``, ``lookup_s``) hold
    count, mean, p50, p90, p99 and max of completed requests; ``transfer_s`` runs from
    the end of prefill to the last byte at decode, NIC waits included; ``lookup_s`` only
    counts requests with at least one cache miss. ``utilisation`` is the work of the
    requests arriving in the window over the window (so over 1 where a queue is unstable
    or the window short against the service times). ``offered_load`` is the utilisation the
    inputs imply (from a sample of prompts); ``unstable`` names the queues at or above 1.
    """

    requests: dict[str, int]
    ttft_s: dict[str, float]
    transfer_s: dict[str, float]
    prefill_wait_s: dict[str, float]
    lookup_s: dict[str, float]
    utilisation: dict[str, float]
    metadata: dict[str, Any]
    failures: dict[str, float]
    offered_load: dict[str, float]
    unstable: list[str]
    sim: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ttft_s": self.ttft_s,
            "transfer_s": self.transfer_s,
            "prefill_wait_s": self.prefill_wait_s,
            "lookup_s": self.lookup_s,
            "utilisation": self.utilisation,
            "metadata": self.metadata,
            "failures": self.failures,
            "offered_load": self.offered_load,
            "unstable": self.unstable,
            "sim": self.sim,
        }


def simulate(config: SimConfig) -> SimResult:
    """Run one simulation; deterministic for ``config.seed``."""
    config.check()
    result = SimResult(**Engine(config, _prompt_sampler(config.prompt_tokens)).run())
    for name in result.unstable:
        log.warning(
            "%s: offered load %.2f >= 1, its queue grows without bound", name, result.offered_load[name]
        )
    if result.sim["truncated"]:
        log.warning("the simulation %s", result.sim["truncated"])
    return result


# -- the command line (``kvx plan simulate``) ---------------------------------------


def _histogram(text: str) -> PromptTokens:
    """``4096`` or ``1024:3,8192:1`` (tokens:weight, ...)."""
    try:
        if ":" not in text:
            return int(text)
        pairs = []
        for item in text.split(","):
            tokens, weight = item.split(":")
            pairs.append((int(tokens), float(weight)))
        return pairs
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-tokens takes a length (4096) or a histogram (1024:3,8192:1), not {text!r}"
        ) from None


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``simulate`` to a command's subparsers; ``run_simulate(args)`` runs it."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a P/D cluster: TTFT tails, NIC and spine load, failures, metadata load",
        description="A discrete-event simulation of a prefill/decode cluster (docs/plan-simulate.md). "
        "The transfer time of one request is --link's default curve (as kvx plan model --link), "
        "--fixed-us + bytes / --link-gbps, or a measured --curve; its bytes prompt tokens x "
        "--bytes-per-token (or from --model's KV shape).",
    )
    add = parser.add_argument
    add("--prefill", type=int, required=True, help="prefill instances (one per node)")
    add("--decode", type=int, required=True, help="decode instances (one per node)")
    add("--rate", type=float, help="requests/s to the whole cluster (default: 60%% of the prefill capacity)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-tokens", type=_histogram, default=4096, help="a length or tokens:weight,... (default 4096)"
    )
    prompt.add_argument(
        "--prompt-hist",
        metavar="FILE",
        help="prompt lengths from a histogram file, as kvx plan model --prompt-hist "
        "(JSON [[tokens, weight], ...] or CSV tokens,weight)",
    )
    add(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help=f"per prefill instance (default {DEFAULT_PREFILL_TOKENS_PER_S:g}, as kvx plan model)",
    )
    add(
        "--bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes per token (default 131072: llama-3.1-8b)",
    )
    add(
        "--model",
        metavar="PRESET|CONFIG.json",
        help="KV bytes per request from a model's shape (as kvx plan model --model) instead of "
        "--bytes-per-token",
    )
    add("--block-size", type=int, default=16, help="with --model: tokens per KV block (default 16)")
    add(
        "--link",
        help="a link as kvx plan model --link names it (rdma[:GBITS], tcp[:GBITS], NxGBITS, nvlink4, "
        "pcie5, ...): its default curve, the same as the model's; NxGBITS also sets --nics. "
        "Not with --link-gbps or --fixed-us",
    )
    add("--link-gbps", type=float, help="NIC bandwidth, Gbit/s (default 400, without --link)")
    add(
        "--curve",
        metavar="SWEEP.json",
        help="a measured transfer curve (kvx bench --sweep --json) for the transfer times; the spine's "
        "capacity still comes from the link's nominal bandwidth (--link or --link-gbps)",
    )
    add("--fixed-us", type=float, help="fixed cost of one transfer, us (default 20, without --link)")
    add("--nics", type=int, help="NICs per node (default: N of --link NxGBITS, else 1)")
    add("--spine-oversubscription", type=float, default=1.0, help="leaf uplink oversubscription (default 1)")
    add("--nodes-per-leaf", type=int, default=32, help="nodes per leaf switch (default 32)")
    add("--overhead-ms", type=float, default=0.0, help="fixed per-request overhead added to TTFT (default 0)")
    add("--failure-rate", type=float, default=0.0, help="node failures per node-hour (default 0)")
    add("--restart-s", type=float, default=60.0, help="time a failed node takes to come back (default 60)")
    add("--metadata-cores", type=int, default=1, help="cores of the metadata service (default 1)")
    add("--agents-per-node", type=int, default=8, help="agents registered per node (default 8)")
    add("--lookups-per-request", type=int, default=1, help="GetAgent lookups per request (default 1)")
    add(
        "--cache-hit-ratio",
        type=float,
        default=0.9,
        help="share of lookups the client cache answers (default 0.9)",
    )
    add("--duration", type=float, default=60.0, help="simulated seconds (default 60)")
    add("--warmup", type=float, default=None, help="seconds not counted (default: a tenth of --duration)")
    add("--seed", type=int, default=0, help="random seed, >= 0 (default 0)")
    add("--max-wall-s", type=float, default=1800.0, help="stop after this much wall time (default 1800)")
    add("--max-events", type=int, default=1_000_000_000, help="stop after this many events (default 1e9)")
    add("--json", action="store_true", help="print one JSON object")
    return parser


def _transfer(args: argparse.Namespace) -> tuple[Callable[[int], float], float, int]:
    """The transfer curve, the NIC's nominal bytes/s (for the spine) and NICs per node."""
    spec_nics = None
    if args.link:
        if args.link_gbps is not None or args.fixed_us is not None:
            raise ConfigError("--link sets the curve: give --link or --link-gbps/--fixed-us, not both")
        link, spec_nics = parse_link(args.link)
        curve = link.curve()
        transfer_s: Callable[[int], float] = curve.transfer_s
        bytes_per_s = link.peak_bytes_per_s
    else:
        gbps = 400.0 if args.link_gbps is None else args.link_gbps
        fixed_us = 20.0 if args.fixed_us is None else args.fixed_us
        _number("--link-gbps", gbps, 0.0, 1e6, low_open=True)
        _number("--fixed-us", fixed_us, 0.0, 1e12)
        bytes_per_s, fixed_s = gbps * 1e9 / 8, fixed_us * 1e-6
        transfer_s = lambda nbytes: fixed_s + nbytes / bytes_per_s  # noqa: E731
    if args.nics is not None and spec_nics is not None and args.nics != spec_nics:
        raise ConfigError(f"--link {args.link} names {spec_nics} NICs and --nics {args.nics}; give one")
    nics = args.nics if args.nics is not None else (spec_nics or 1)
    if args.curve:
        from kvx.plan.files import read_curve

        transfer_s = read_curve(args.curve).transfer_s
    return transfer_s, bytes_per_s, nics


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A SimConfig from the ``simulate`` flags, checked."""
    per_token = args.bytes_per_token
    _count("--bytes-per-token", per_token, 0, 1 << 40)
    transfer_s, bytes_per_s, nics = _transfer(args)
    prompt: PromptTokens = args.prompt_tokens
    if args.prompt_hist:
        from kvx.plan.files import read_histogram

        prompt = list(read_histogram(args.prompt_hist))
    # validated before the default rate samples them
    _check_prompt_tokens(prompt)
    _number("--duration", args.duration, 0.0, DURATION_MAX_S, low_open=True)
    rate = args.rate
    if rate is None:
        if args.prefill_tokens_per_s == math.inf:
            raise ConfigError("--rate is needed with an infinite --prefill-tokens-per-s")
        _number("--prefill-tokens-per-s", args.prefill_tokens_per_s, 0.0, low_open=True)
        _count("--seed", args.seed, 0, SEED_MAX)
        sample = _prompt_sampler(prompt)(np.random.default_rng(args.seed), 1 << 14)
        rate = 0.6 * args.prefill * args.prefill_tokens_per_s / float(np.mean(sample))
    warmup = args.duration / 10 if args.warmup is None else args.warmup
    request_bytes: Callable[[int], int] = lambda tokens: tokens * per_token  # noqa: E731
    if args.model:
        from kvx.plan.shapes import load_shape

        if args.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, not {args.block_size}")
        shape, block = load_shape(args.model), args.block_size
        request_bytes = lambda tokens: shape.request_bytes(tokens, block_tokens=block)  # noqa: E731
    config = SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        rate=rate,
        prompt_tokens=prompt,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        request_bytes=request_bytes,
        transfer_s=transfer_s,
        nics_per_node=nics,
        spine_oversubscription=args.spine_oversubscription,
        nodes_per_leaf=args.nodes_per_leaf,
        nic_bytes_per_s=bytes_per_s,
        overhead_s=args.overhead_ms / 1e3,
        metadata=MetadataLoad(
            cores=args.metadata_cores,
            agents_per_node=args.agents_per_node,
            lookups_per_request=args.lookups_per_request,
            cache_hit_ratio=args.cache_hit_ratio,
        ),
        failure_rate=args.failure_rate,
        restart_s=args.restart_s,
        duration_s=args.duration,
        warmup_s=warmup,
        seed=args.seed,
        max_events=args.max_events,
        max_wall_s=args.max_wall_s,
    )
    config.check()
    return config


def _ms(summary: dict[str, float], key: str) -> str:
    value = summary.get(key)
    return "-" if value is None else f"{value * 1e3:.2f}"


def format_result(config: SimConfig, result: SimResult) -> str:
    """The result as a few lines of text."""
    r = result.requests
    u = result.utilisation
    md = result.metadata
    lines = [
        f"cluster: {config.prefill} prefill + {config.decode} decode, {config.rate:.1f} requests/s, "
        f"{config.duration_s:g} s simulated ({config.warmup_s:g} s warm-up)",
        f"requests: {r['arrived']} arrived, {r['completed']} completed, {r['dropped']} dropped by failures, "
        f"{r['failed_routed']} sent to a failed node, {r['failed_metadata']} lookup timeouts, "
        f"{r['unfinished']} unfinished",
    ]
    for name, summary in (
        ("TTFT", result.ttft_s),
        ("transfer (incl. NIC waits)", result.transfer_s),
        ("prefill wait", result.prefill_wait_s),
        ("metadata lookup", result.lookup_s),
    ):
        lines.append(
            f"{name} ms: mean {_ms(summary, 'mean')}  p50 {_ms(summary, 'p50')}  "
            f"p90 {_ms(summary, 'p90')}  p99 {_ms(summary, 'p99')}"
        )
    lines.append(
        "utilisation: "
        + ", ".join(f"{k} {v:.3f}" for k, v in u.items())
        + f"; metadata {md['utilisation']:.3f} of {md['cores']} cores"
    )
    lines.append("metadata ops/s: " + ", ".join(f"{k} {v:,.1f}" for k, v in md["ops_per_s"].items()))
    f = result.failures
    lines.append(f"failures: {f['count']} ({f['per_node_hour']:.4f} per node-hour)")
    if result.unstable:
        lines.append("UNSTABLE (offered load >= 1): " + ", ".join(result.unstable))
    sim = result.sim
    lines.append(f"sim: {sim['events']:,} events in {sim['wall_s']:.1f} s ({sim['events_per_s']:,.0f}/s)")
    if sim["truncated"]:
        lines.append(f"TRUNCATED: {sim['truncated']}")
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    """Run the ``simulate`` command from parsed flags; 0 on success."""
    config = config_from_args(args)
    result = simulate(config)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_result(config, result))
    return 0


def run_simulate_cli(argv: Sequence[str] | None = None) -> int:
    """``python -m kvx.plan.simulate ...``: the same flags as ``kvx plan simulate``."""
    parser = argparse.ArgumentParser(prog="python -m kvx.plan.simulate")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_simulate(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_simulate_cli())
