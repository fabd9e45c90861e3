"""The event loop behind kvx.plan.simulate; the model is described there and in
docs/plan-simulate.md.

Speed matters here (100,000 nodes and ten simulated minutes within minutes), so the loop
keeps its state in flat Python lists indexed by instance, binds everything it touches to
locals, and draws random numbers in numpy batches.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.errors import ConfigError
from kvx.plan._sim_loop import FAIL, Loop

if TYPE_CHECKING:
    from kvx.plan.simulate import SimConfig

# Arrivals drawn per numpy batch: this bounds the batch's memory only. The rest that could
# grow with the run is bounded in _sim_loop: latencies by a sample of SAMPLES_MAX per series,
# transfers waiting for their decode NIC (an unstable queue's backlog) by PENDING_MAX.
_CHUNK = 1 << 16
_SAMPLE = 1 << 16  # prompts drawn to compute the offered loads
_CURVE_CACHE_MAX = 1 << 20  # prompt lengths whose bytes and transfer time are remembered


class Engine:
    """One run of one SimConfig (already checked)."""

    def __init__(self, config: SimConfig, sampler: Callable[[np.random.Generator, int], np.ndarray]) -> None:
        self.c = config
        self.sampler = sampler
        # the fourth child is new: the first three draw what they drew before it
        arrivals, failures, sample, samples = np.random.SeedSequence(config.seed).spawn(4)
        self.rng_arrivals = np.random.default_rng(arrivals)
        self.rng_failures = np.random.default_rng(failures)
        self.rng_sample = np.random.default_rng(sample)
        self.rng_samples = np.random.default_rng(samples)  # which latencies a long run keeps
        self.rnd = random.Random(config.seed)  # router re-draws, detection delays
        self.curve: dict[int, tuple[float, float]] = {}
        nodes = config.prefill + config.decode
        self.leaves = max(1, math.ceil(nodes / config.nodes_per_leaf))
        self.spine = config.spine_oversubscription > 1.0 and self.leaves > 1
        md = config.metadata
        self.watchers = nodes if md.watchers is None else md.watchers

    # -- inputs -------------------------------------------------------------------

    def _tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        tokens = np.asarray(self.sampler(rng, n))
        if tokens.shape != (n,) or not np.issubdtype(tokens.dtype, np.number):
            raise ConfigError(f"the prompt_tokens sampler must return {n} numbers, got shape {tokens.shape}")
        tokens = tokens.astype(np.int64)
        if n and tokens.min() < 1:
            raise ConfigError(f"the prompt_tokens sampler returned {tokens.min()}: lengths must be >= 1")
        return tokens

    def _costs(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes and transfer time per request; the callables run once per distinct length."""
        uniq, inverse = np.unique(tokens, return_inverse=True)
        nbytes = np.empty(uniq.size)
        seconds = np.empty(uniq.size)
        for j, length in enumerate(uniq.tolist()):
            cached = self.curve.get(length)
            if cached is None:
                cached = self._curve_point(length)
                if len(self.curve) < _CURVE_CACHE_MAX:
                    self.curve[length] = cached
            nbytes[j], seconds[j] = cached
        return nbytes[inverse], seconds[inverse]

    def _curve_point(self, tokens: int) -> tuple[float, float]:
        nbytes = self.c.request_bytes(tokens)
        if not (isinstance(nbytes, int | np.integer) and nbytes >= 0):
            raise ConfigError(f"request_bytes({tokens}) returned {nbytes!r}: it must return an int >= 0")
        seconds = float(self.c.transfer_s(int(nbytes)))
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ConfigError(f"transfer_s({nbytes}) returned {seconds!r}: it must be a finite time >= 0")
        return float(nbytes), seconds

    def _arrivals(self) -> Iterator[tuple[list[Any], ...]]:
        """Arrival batches: times, prefill, decode, prefill time, bytes, transfer time, misses."""
        c = self.c
        md = c.metadata
        rng = self.rng_arrivals
        miss_p = 1.0 - md.cache_hit_ratio
        t0 = 0.0
        while t0 < c.duration_s:
            times = t0 + np.cumsum(rng.exponential(1.0 / c.rate, _CHUNK))
            tokens = self._tokens(rng, _CHUNK)
            prefill = rng.integers(0, c.prefill, _CHUNK)
            decode = rng.integers(0, c.decode, _CHUNK)
            if md.lookups_per_request and miss_p > 0:
                misses = rng.binomial(md.lookups_per_request, miss_p, _CHUNK)
            else:
                misses = np.zeros(_CHUNK, dtype=np.int64)
            t0 = float(times[-1])
            n = int(np.searchsorted(times, c.duration_s))
            tokens = tokens[:n]
            busy = np.zeros(n) if math.isinf(c.prefill_tokens_per_s) else tokens / c.prefill_tokens_per_s
            nbytes, seconds = self._costs(tokens)
            yield (
                times[:n].tolist(),
                prefill[:n].tolist(),
                decode[:n].tolist(),
                busy.tolist(),
                nbytes.tolist(),
                seconds.tolist(),
                misses[:n].tolist(),
            )

    def _failures(self) -> tuple[list[tuple[float, int, int, int]], dict[int, list[float]]]:
        """Failure times drawn up front: a Poisson process over all nodes."""
        c = self.c
        nodes = c.prefill + c.decode
        count = int(self.rng_failures.poisson(c.failure_rate * nodes * c.duration_s / 3600.0))
        times = np.sort(self.rng_failures.uniform(0.0, c.duration_s, count))
        who = self.rng_failures.integers(0, nodes, count)
        per_node: dict[int, list[float]] = {}
        events = []
        for t, n in zip(times.tolist(), who.tolist(), strict=True):
            per_node.setdefault(n, []).append(t)
            events.append((t, FAIL, n, 0))
        return events, per_node

    def offered_load(self) -> dict[str, float]:
        """Utilisations the inputs imply, from a sample of prompts (means, not the run)."""
        c = self.c
        md = c.metadata
        tokens = self._tokens(self.rng_sample, _SAMPLE)
        nbytes, seconds = self._costs(tokens)
        busy = 0.0 if math.isinf(c.prefill_tokens_per_s) else float(tokens.mean()) / c.prefill_tokens_per_s
        k = c.nics_per_node
        agents = (c.prefill + c.decode) * md.agents_per_node
        metadata = (
            agents * md.renewal_cost_s / md.renewal_interval_s
            + c.rate * md.lookups_per_request * (1 - md.cache_hit_ratio) * md.lookup_cost_s
        ) / md.cores
        load = {
            "prefill": c.rate / c.prefill * busy,
            "nic_send": c.rate / (c.prefill * k) * float(seconds.mean()),
            "nic_receive": c.rate / (c.decode * k) * float(seconds.mean()),
            "metadata": metadata,
        }
        if self.spine:
            crossing = (self.leaves - 1) / self.leaves
            load["spine"] = (
                c.rate * crossing * float(nbytes.mean()) / (self.leaves * self._leaf_capacity_mean())
            )
        return load

    def _nic_bytes_per_s(self) -> float:
        if self.c.nic_bytes_per_s is not None:
            return self.c.nic_bytes_per_s
        gib = 1 << 30
        slope = float(self.c.transfer_s(2 * gib)) - float(self.c.transfer_s(gib))
        if not (slope > 0 and math.isfinite(slope)):
            raise ConfigError("transfer_s does not grow with size: set nic_bytes_per_s for the spine")
        return gib / slope

    def _leaf_capacity_mean(self) -> float:
        c = self.c
        nodes = c.prefill + c.decode
        return nodes / self.leaves * c.nics_per_node * self._nic_bytes_per_s() / c.spine_oversubscription

    # -- the run ------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        offered = self.offered_load()
        unstable = sorted(name for name, rho in offered.items() if rho >= 1.0)
        failures, per_node = self._failures()
        state = Loop(self, failures, per_node)
        truncated = state.run(self._arrivals(), started)
        wall_s = time.monotonic() - started
        out = state.report()
        out["offered_load"] = offered
        out["unstable"] = unstable
        out["sim"] = {
            "events": state.events,
            "wall_s": wall_s,
            "events_per_s": state.events / wall_s if wall_s > 0 else 0.0,
            "truncated": truncated,
            "seed": self.c.seed,
            "nodes": self.c.prefill + self.c.decode,
            "leaves": self.leaves,
        }
        return out
