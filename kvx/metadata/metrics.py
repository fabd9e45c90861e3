"""Prometheus metrics of the metadata service (one registry per server)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvx.metadata.store import Store
from kvx.v1 import metadata_pb2

# A store that reads every record to count them (etcd) is counted at most this
# often, one count shared by the scrapes that arrive meanwhile: a scrape a second
# of 100,000 agents, or a stranger asking for /metrics in a loop, must not read
# them all each time on the event loop that answers lookups.
COUNT_EVERY_S = 10.0


class _StoreCollector:
    """Agents by role and lease expiries, read from the store at scrape time.

    The agent counts come from ``refresh()`` (async, called by /metrics
    before it renders) because prometheus collectors are synchronous. A
    store that keeps its counts is asked every time; one that reads its
    records to count them, at most every COUNT_EVERY_S.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.by_role: dict[str, int] = {}
        self._counted_at = float("-inf")
        self._counting: asyncio.Future[None] | None = None

    async def refresh(self) -> None:
        if self.store.counts_kept:
            await self._count()
            return
        if time.monotonic() - self._counted_at < COUNT_EVERY_S:
            return
        if self._counting is None or self._counting.done():
            self._counting = asyncio.ensure_future(self._count())
            # Its error reaches the scrapes that wait for it; none may be left to read it.
            self._counting.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(self._counting)  # a scrape that goes away leaves the count to the others

    async def _count(self) -> None:
        try:
            counts = await self.store.count_by_role()
            named = {
                metadata_pb2.Role.Name(role).removeprefix("ROLE_").lower(): n for role, n in counts.items()
            }
            self.by_role = {
                role: named.get(role, 0) for role in ("prefill", "decode", "other", "unspecified")
            }
        finally:
            # A failed count (etcd down) is not tried again at once either: the scrapes
            # meanwhile show the last counts, and kvx_metadata_store_ready says why.
            self._counted_at = time.monotonic()

    def collect(self):
        agents = GaugeMetricFamily("kvx_metadata_agents", "Registered agents, by role", labels=["role"])
        for role, count in sorted(self.by_role.items()):
            agents.add_metric([role], count)
        yield agents
        yield CounterMetricFamily(
            "kvx_metadata_lease_expiries",
            "Leases that expired without renewal",
            value=getattr(self.store, "expired_leases", 0),
        )
        yield CounterMetricFamily(
            "kvx_metadata_lease_clock_stalled_seconds",
            "Seconds the service's event loop stalled, by which leases were extended (memory store)",
            value=getattr(self.store, "stalled_s", 0.0),
        )


class GcPauses:
    """How long each collection of Python's cycle collector held the process (so
    the event loop that answers lookups), by generation: a gc callback, installed
    while the server serves. The callback runs inside a collection, on whichever
    thread set it off, so it takes no lock (a metric's own lock could be held by
    that same thread): it only adds to lists, rendered at scrape time."""

    BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

    def __init__(self) -> None:
        self._started: float | None = None
        # Per generation: a count per bucket (the last: past every bound), and the sum.
        self._counts = [[0] * (len(self.BUCKETS_S) + 1) for _ in range(3)]
        self._sums = [0.0] * 3

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        started, self._started = self._started, None
        generation = info.get("generation", 2)
        if started is None or not 0 <= generation < 3:
            return  # its start was not seen (installed meanwhile)
        took = time.perf_counter() - started
        self._counts[generation][bisect.bisect_left(self.BUCKETS_S, took)] += 1
        self._sums[generation] += took

    def collect(self):
        family = HistogramMetricFamily(
            "kvx_metadata_gc_pause_seconds",
            "Time each collection of Python's cycle collector held the service, by generation",
            labels=["generation"],
        )
        for generation in range(3):
            counts, total, buckets = self._counts[generation], 0, []
            for bound, count in zip((*self.BUCKETS_S, float("inf")), counts, strict=True):
                total += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family


class ServiceMetrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.registrations = Counter(
            "kvx_metadata_registrations",
            "Successful registrations (RegisterAgent calls and RegisterAgents entries)",
            registry=self.registry,
        )
        # Leases renewed (answered with a ttl above 0) and the KeepAlive messages and streams
        # that carried them: service CPU per renewal is CPU over kvx_metadata_lease_renewals.
        self.lease_renewals = Counter(
            "kvx_metadata_lease_renewals", "Leases renewed by KeepAlive", registry=self.registry
        )
        self.keep_alive_messages = Counter(
            "kvx_metadata_keep_alive_messages", "KeepAlive request messages served", registry=self.registry
        )
        self.keep_alive_streams = Counter(
            "kvx_metadata_keep_alive_streams", "KeepAlive streams opened", registry=self.registry
        )
        self.request_seconds = Histogram(
            "kvx_metadata_request_seconds",
            "Time to serve a metadata RPC",
            ["method"],
            registry=self.registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
        )
        # Set by the servicer (functions of its counts): agents' watches against
        # --max-watch-streams, read replicas' against --max-replica-watch-streams.
        self.watch_streams = Gauge(
            "kvx_metadata_watch_streams",
            "WatchAgents streams open, by the slots they take (agent, replica)",
            ["slots"],
            registry=self.registry,
        )
        self.store_ready = Gauge(
            "kvx_metadata_store_ready", "1 when the store answers", registry=self.registry
        )
        self.store_collector = _StoreCollector(store)
        self.registry.register(self.store_collector)
        self.gc_pauses = GcPauses()
        self.registry.register(self.gc_pauses)
