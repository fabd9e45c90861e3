"""KvxConnector's transfer stats, as vLLM's KV-connector stats interface wants them.

Each worker records what its agent moved into ``KvxConnectorStats``; vLLM
takes the batch every step (``get_kv_connector_stats``), sums the ranks'
batches with ``aggregate``, ships ``to_dict()`` to the front end, rebuilds it
there (``build_kv_connector_stats``) and hands it to ``KvxPromMetrics``, which
adds it to the ``vllm:kvx_*`` series of vLLM's ``/metrics``, one set per
engine. The shapes follow vLLM's NIXL connector (``vllm:nixl_*``).

A transfer is one read from one prefill rank: a request whose prefill engine
has tensor parallelism 2 and decode 1 makes two.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# One list per key, one entry per event: lists aggregate across ranks and steps by
# concatenation, and the histograms need every observation, not a sum.
TRANSFER_KEYS = ("transfer_duration", "bytes_transferred", "num_descriptors")
COUNT_KEYS = ("num_failed_transfers", "num_kv_expired_reqs")
BACKEND_KEY = "backends"  # the transport chosen for each prefill rank this engine connected to
KEYS = (*TRANSFER_KEYS, *COUNT_KEYS, BACKEND_KEY)
# vLLM takes a worker's batch every step, and a step moves far fewer; the bound keeps a
# worker whose batches are never taken (a vLLM that does not ask) from growing without end.
MAX_EVENTS_PER_BATCH = 1 << 16

logger = logging.getLogger(__name__)
_warned_full = False

# Upper bounds of the histograms' buckets.
TIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB to 8 GiB
DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)


@dataclasses.dataclass
class KvxConnectorStats(KVConnectorStats):
    """What one worker (or, aggregated, every worker of an engine) moved since the last batch."""

    # As in KVConnectorStats (restated for the type checker): one list per key of KEYS.
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Rebuilt from a payload: keep the known keys, so a peer version with more or fewer
        # keys still aggregates (a missing one is empty).
        data = self.data or {}
        self.data = {key: list(data.get(key) or ()) for key in KEYS}

    def reset(self) -> None:
        self.data = {key: [] for key in KEYS}

    def _full(self, key: str) -> bool:
        global _warned_full
        if len(self.data[key]) < MAX_EVENTS_PER_BATCH:
            return False
        if not _warned_full:  # once per process: the condition persists
            _warned_full = True
            logger.warning(
                "kvx stats: %d %s events since vLLM last took them; dropping more (this vLLM does "
                "not call get_kv_connector_stats each step)",
                MAX_EVENTS_PER_BATCH,
                key,
            )
        return True

    def record_transfer(self, duration_s: float, nbytes: int, descriptors: int) -> None:
        if self._full("transfer_duration"):
            return
        self.data["transfer_duration"].append(float(duration_s))
        self.data["bytes_transferred"].append(int(nbytes))
        self.data["num_descriptors"].append(int(descriptors))

    def record_failed_transfer(self) -> None:
        """A read that ended in an error, or a load that failed before its read was posted."""
        if not self._full("num_failed_transfers"):
            self.data["num_failed_transfers"].append(1)

    def record_kv_expired_req(self) -> None:
        """Prefill freed a request's blocks because decode did not read them within the lease."""
        if not self._full("num_kv_expired_reqs"):
            self.data["num_kv_expired_reqs"].append(1)

    def record_backend(self, backend: str) -> None:
        if not self._full(BACKEND_KEY):
            self.data[BACKEND_KEY].append(str(backend))

    def clone_and_reset(self) -> KvxConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def is_empty(self) -> bool:
        # A batch of failures or expiries alone is not empty: it must reach the counters.
        return not any(self.data[key] for key in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key in KEYS:
                self.data[key].extend(other.data.get(key) or ())
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line's worth for vLLM's periodic log."""
        counts: dict[str, int | float] = {
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num KV expired reqs": len(self.data["num_kv_expired_reqs"]),
        }
        n = self.num_successful_transfers
        if n == 0:
            return {
                "Num successful transfers": 0,
                "Avg xfer time (ms)": 0,
                "P90 xfer time (ms)": 0,
                "Avg MB per transfer": 0,
                "Throughput (MB/s)": 0,
                "Avg number of descriptors": 0,
                **counts,
            }
        time_s = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        total_mb = float(np.sum(np.asarray(self.data["bytes_transferred"], dtype=np.float64))) / 2**20
        total_s = float(time_s.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(time_s.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(time_s, 90)) * 1e3, 3),
            "Avg MB per transfer": round(total_mb / n, 3),
            "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
            "Avg number of descriptors": round(float(np.mean(self.data["num_descriptors"])), 1),
            **counts,
        }


class KvxPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvx_*`` series, labelled per engine like vLLM's own."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.transfer_time = self._per_engine(
            self._histogram_cls(
                name="vllm:kvx_xfer_time_seconds",
                documentation="Histogram of the duration of kvx KV cache transfers (post to completion).",
                buckets=list(TIME_BUCKETS_S),
                labelnames=labelnames,
            )
        )
        self.bytes_transferred = self._per_engine(
            self._histogram_cls(
                name="vllm:kvx_bytes_transferred",
                documentation="Histogram of the bytes moved by each kvx KV cache transfer.",
                buckets=list(BYTES_BUCKETS),
                labelnames=labelnames,
            )
        )
        self.num_descriptors = self._per_engine(
            self._histogram_cls(
                name="vllm:kvx_num_descriptors",
                documentation="Histogram of the number of descriptors in each kvx KV cache transfer.",
                buckets=list(DESCRIPTOR_BUCKETS),
                labelnames=labelnames,
            )
        )
        self.failed_transfers = self._per_engine(
            self._counter_cls(
                name="vllm:kvx_num_failed_transfers",
                documentation="Number of failed kvx KV cache transfers: reads that ended in an error "
                "and loads that failed before their read was posted (handshake, compatibility, "
                "lost peer). Tracked on the decode instance.",
                labelnames=labelnames,
            )
        )
        self.kv_expired_reqs = self._per_engine(
            self._counter_cls(
                name="vllm:kvx_num_kv_expired_reqs",
                documentation="Number of requests whose KV blocks were freed because decode did not "
                "read them within the lease. Tracked on the prefill instance.",
                labelnames=labelnames,
            )
        )
        # Info style: 1 for each transport the engine's reads have used.
        self.backend_info = self._gauge_cls(
            name="vllm:kvx_backend_info",
            documentation="kvx transport in use (label backend: tcp, shm, cuda_ipc, rdma, ...): "
            "1 once this engine connected to a prefill rank over it.",
            labelnames=[*labelnames, "backend"],
            multiprocess_mode="mostrecent",
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for series, key in (
            (self.transfer_time, "transfer_duration"),
            (self.bytes_transferred, "bytes_transferred"),
            (self.num_descriptors, "num_descriptors"),
        ):
            for value in data.get(key) or ():
                series[engine_idx].observe(value)
        for counter, key in (
            (self.failed_transfers, "num_failed_transfers"),
            (self.kv_expired_reqs, "num_kv_expired_reqs"),
        ):
            total = sum(data.get(key) or ())
            if total:
                counter[engine_idx].inc(total)
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for backend in sorted(set(data.get(BACKEND_KEY) or ())):
            self.backend_info.labels(*labelvalues, backend).set(1)
