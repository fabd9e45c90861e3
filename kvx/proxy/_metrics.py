"""The proxy's Prometheus metrics, one registry per app (served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Prompt tokens found cached on the chosen prefill instance.
CACHED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.route = Counter(
            "kvx_proxy_route_total",
            "Instances chosen, by leg and reason: prefix (the longest cached prefix), "
            "load_over_prefix (a shorter prefix, or none, on a less loaded instance), "
            "load (no cached prefix known anywhere; decode: the fewest requests in flight), "
            "kv_usage (decode: as loaded as others, with less of its KV cache in use)",
            ["leg", "reason"],
            registry=self.registry,
        )
        self.cached_tokens = Histogram(
            "kvx_proxy_prefill_cached_tokens",
            "Prompt tokens cached on the chosen prefill instance, per KV-aware choice",
            buckets=CACHED_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.kv_events = Counter(
            "kvx_proxy_kv_event_batches_total",
            "KV event batches from prefill instances, by outcome: applied, gap (batches were "
            "missed before it), restart (the index was cleared), malformed or frames (dropped), "
            "disconnected (the publisher was lost or cut off; a new connection follows), "
            "replayed (a missed batch recovered from the replay endpoint), replay_failed",
            ["instance", "outcome"],
            registry=self.registry,
        )
        self.tokenize_failures = Counter(
            "kvx_proxy_tokenize_failures_total",
            "Prompts that could not be tokenized for KV-aware routing (routed by load)",
            registry=self.registry,
        )
