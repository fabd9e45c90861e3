"""A daemon's Prometheus metrics (its own registry: several daemons may share
a process in tests), and the recent transfers ``/v1/status`` lists."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RECENT_TRANSFERS = 32
# 100 us .. 60 s: a 4 KiB transfer on shm to a GiB over tcp.
LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class DaemonMetrics:
    def __init__(self, name: str, role: str, engine: str, version: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("op", "backend", "peer_role", "outcome")
        self.transfers = Counter("kvx_transfers", "KV transfers this daemon started", labels, registry=r)
        self.transfer_bytes = Counter("kvx_transfer_bytes", "bytes of KV transfers", labels, registry=r)
        self.transfer_seconds = Histogram(
            "kvx_transfer_duration_seconds",
            "KV transfer time, posted to done",
            ("op", "backend"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfers_in_flight = Gauge("kvx_transfers_in_flight", "KV transfers under way", registry=r)
        self.requests = Counter("kvx_requests", "completion requests served", ("outcome",), registry=r)
        self.requests_in_flight = Gauge("kvx_requests_in_flight", "completion requests under way", registry=r)
        self.leases_held = Gauge("kvx_leases_held", "requests whose KV prefill holds for decode", registry=r)
        self.leases_expired = Counter(
            "kvx_leases_expired", "leases that ran out before decode read the KV", registry=r
        )
        self.registered_bytes = Gauge(
            "kvx_registered_bytes", "memory registered with the agent", ("memory",), registry=r
        )
        self.blocks_verified = Counter(
            "kvx_blocks_verified", "KV blocks decode checked byte for byte", registry=r
        )
        self.verify_failures = Counter(
            "kvx_verify_failures", "requests whose KV did not match what prefill wrote", registry=r
        )
        self.ready = Gauge("kvx_daemon_ready", "1 when the daemon takes requests", registry=r)
        self.draining = Gauge("kvx_daemon_draining", "1 while the daemon drains", registry=r)
        info = Gauge("kvx_daemon_info", "the daemon", ("name", "role", "engine", "version"), registry=r)
        info.labels(name, role, engine, version).set(1)
        self._lock = threading.Lock()
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_TRANSFERS)
        self.totals = collections.Counter[str]()

    def transfer(
        self, op: str, backend: str, peer: str, peer_role: str, nbytes: int, seconds: float, ok: bool
    ) -> None:
        outcome = "ok" if ok else "failed"
        self.transfers.labels(op, backend, peer_role, outcome).inc()
        self.transfer_bytes.labels(op, backend, peer_role, outcome).inc(nbytes)
        if ok:
            self.transfer_seconds.labels(op, backend).observe(seconds)
        with self._lock:
            self.totals["transfers" if ok else "transfers_failed"] += 1
            if ok:
                self.totals["bytes"] += nbytes
            self.recent.append(
                {
                    "op": op,
                    "peer": peer,
                    "bytes": nbytes,
                    "duration_s": round(seconds, 6),
                    "backend": backend,
                    "outcome": outcome,
                    "unix_ms": int(time.time() * 1000),
                }
            )

    def request(self, ok: bool) -> None:
        self.requests.labels("ok" if ok else "failed").inc()
        with self._lock:
            self.totals["requests" if ok else "requests_failed"] += 1

    def verified(self, blocks: int) -> None:
        self.blocks_verified.inc(blocks)
        with self._lock:
            self.totals["blocks_verified"] += blocks

    def snapshot(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        with self._lock:
            keys = (
                "requests",
                "requests_failed",
                "transfers",
                "transfers_failed",
                "bytes",
                "blocks_verified",
            )
            return list(self.recent), {k: self.totals[k] for k in keys}
