"""KvxConnector's stats through vLLM's own KV-connector stats machinery.

The path a batch takes in an engine, each hop vLLM's own code: the ranks'
batches summed by ``KVOutputAggregator``, taken by the ``Scheduler`` into its
``SchedulerStats``, msgpack'd to the front end inside ``EngineCoreOutputs``,
rebuilt and logged by ``KVConnectorLogging`` and recorded into Prometheus by
``KVConnectorProm`` (the ``vllm:kvx_*`` series of ``/metrics``). The
end-to-end test (tests/e2e/test_vllm_pd.py) checks the same series against
real engines.

Written against the interface both vLLM 0.32 (the engines) and 0.33 (where
scripts/test.sh runs this directory) have.
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="KV-connector stats tests run in a vLLM environment (.venv-vllm-next, built by scripts/test.sh)",
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvx.connectors.vllm.connector import KvxConnector  # noqa: E402
from kvx.connectors.vllm.stats import MAX_EVENTS_PER_BATCH, KvxConnectorStats, KvxPromMetrics  # noqa: E402
from tests.vllm_scheduler.conftest import make_request, make_scheduler, make_vllm_config  # noqa: E402

KV_CONFIG = KVTransferConfig(
    kv_connector="KvxConnector", kv_connector_module_path="kvx.connectors.vllm", kv_role="kv_consumer"
)


def rank_stats(
    transfers: list[tuple[float, int, int]], failed: int = 0, expired: int = 0
) -> KvxConnectorStats:
    stats = KvxConnectorStats()
    for duration_s, nbytes, descriptors in transfers:
        stats.record_transfer(duration_s, nbytes, descriptors)
    for _ in range(failed):
        stats.record_failed_transfer()
    for _ in range(expired):
        stats.record_kv_expired_req()
    return stats


def runner_output(stats: KvxConnectorStats | None) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        sampled_token_ids=[],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
    )


def test_a_batch_is_taken_once_then_starts_over() -> None:
    stats = rank_stats([(0.5, 1000, 8)], failed=1)
    taken = stats.clone_and_reset()
    assert taken.data["bytes_transferred"] == [1000] and taken.data["num_failed_transfers"] == [1]
    assert stats.is_empty() and stats.data == KvxConnectorStats().data
    stats.record_transfer(0.25, 10, 1)
    assert taken.data["bytes_transferred"] == [1000], "the taken batch must not see later records"


def test_a_batch_nobody_takes_stops_growing() -> None:
    stats = KvxConnectorStats()
    for _ in range(MAX_EVENTS_PER_BATCH + 10):
        stats.record_transfer(0.001, 1, 1)
        stats.record_failed_transfer()
        stats.record_kv_expired_req()
        stats.record_backend("tcp")
    assert {len(v) for v in stats.data.values()} == {MAX_EVENTS_PER_BATCH}
    stats.clone_and_reset()
    stats.record_failed_transfer()
    assert stats.data["num_failed_transfers"] == [1], "a taken batch starts over"


@pytest.mark.parametrize(
    "record",
    [
        lambda s: s.record_failed_transfer(),
        lambda s: s.record_kv_expired_req(),
        lambda s: s.record_backend("tcp"),
        lambda s: s.record_transfer(0.1, 1, 1),
    ],
)
def test_a_batch_of_anything_is_not_empty(record: Any) -> None:
    """A batch of failures or expiries alone must still reach the counters."""
    stats = KvxConnectorStats()
    assert stats.is_empty()
    record(stats)
    assert not stats.is_empty()


def test_ranks_batches_add_up_in_vllms_aggregator() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=3)
    out = aggregator.aggregate(
        [
            runner_output(rank_stats([(0.5, 1000, 8)], failed=1)),
            runner_output(None),  # a rank with nothing to report
            runner_output(rank_stats([(0.25, 3000, 24), (0.75, 5000, 40)], expired=2)),
        ]
    )
    assert out is not None and out.kv_connector_output is not None
    stats = out.kv_connector_output.kv_connector_stats
    assert isinstance(stats, KvxConnectorStats)
    assert stats.data["transfer_duration"] == [0.5, 0.25, 0.75]
    assert stats.data["bytes_transferred"] == [1000, 3000, 5000]
    assert stats.data["num_descriptors"] == [8, 24, 40]
    assert stats.data["num_failed_transfers"] == [1] and stats.data["num_kv_expired_reqs"] == [1, 1]
    reduced = stats.reduce()
    assert reduced["Num successful transfers"] == 3
    assert reduced["Num failed transfers"] == 1 and reduced["Num KV expired reqs"] == 2
    assert reduced["Avg xfer time (ms)"] == 500.0
    assert reduced["Avg number of descriptors"] == 24.0
    assert reduced["Throughput (MB/s)"] == round(9000 / 2**20 / 1.5, 3)


def test_reduce_of_a_batch_of_failures_alone() -> None:
    reduced = rank_stats([], failed=2, expired=1).reduce()
    assert reduced["Num successful transfers"] == 0 and reduced["Throughput (MB/s)"] == 0
    assert reduced["Num failed transfers"] == 2 and reduced["Num KV expired reqs"] == 1


def test_the_scheduler_passes_the_workers_batch_on_and_adds_nothing() -> None:
    """vLLM's Scheduler asks the scheduler-side connector for stats too: it has none."""
    scheduler = make_scheduler(make_vllm_config("kv_consumer"))

    def one_step(stats: KvxConnectorStats | None) -> Any:
        scheduler_output = scheduler.schedule()
        output = ModelRunnerOutput(
            req_ids=["r"],
            req_id_to_index={"r": 0},
            sampled_token_ids=[[9]],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
        )
        engine_outputs = scheduler.update_from_output(scheduler_output, output)
        scheduler_stats = next(iter(engine_outputs.values())).scheduler_stats
        assert scheduler_stats is not None
        return scheduler_stats.kv_connector_stats

    try:
        scheduler.add_request(make_request("r", [5, 6, 7], max_tokens=2))
        assert one_step(rank_stats([(0.5, 4096, 8)])) == rank_stats([(0.5, 4096, 8)]).data
        # A step without a batch carries none.
        assert one_step(None) is None
    finally:
        scheduler.shutdown()


def test_payload_round_trips_to_the_front_end() -> None:
    stats = rank_stats([(0.5, 1000, 8), (0.125, 7, 1)], failed=1, expired=3)
    stats.record_backend("shm")
    wire = MsgpackEncoder().encode(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    )
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.kv_connector_stats
    rebuilt = KvxConnector.build_kv_connector_stats(got)
    assert isinstance(rebuilt, KvxConnectorStats)
    assert rebuilt.data == stats.data
    empty = KvxConnector.build_kv_connector_stats()
    assert isinstance(empty, KvxConnectorStats) and empty.is_empty()
    # A payload from a version with a key more or less still aggregates.
    other = KvxConnector.build_kv_connector_stats(
        {"bytes_transferred": [5], "transfer_duration": [1.0], "new": [1]}
    )
    assert other is not None
    assert rebuilt.aggregate(other).data["bytes_transferred"] == [1000, 7, 5]


def test_vllms_logging_sums_the_batches_of_an_interval() -> None:
    logging = KVConnectorLogging(KV_CONFIG)
    assert logging.connector_cls is KvxConnector
    logging.observe(rank_stats([(0.5, 1000, 8)]).to_dict())
    logging.observe(rank_stats([(1.5, 3000, 8)], failed=1).to_dict())
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "Num successful transfers=2" in line and "Avg xfer time (ms)=1000.0" in line
    assert "Num failed transfers=1" in line
    lines.clear()
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert not lines, "the interval's batches were logged twice"


class _Prom(KVConnectorProm):
    """vLLM's KVConnectorProm on a registry of the test's own (the default one is global)."""

    registry: CollectorRegistry

    def __init__(self, *args: Any) -> None:
        registry = self.registry = CollectorRegistry()

        def bound(cls: Any) -> Any:
            return lambda *a, **kw: cls(*a, registry=registry, **kw)

        self._gauge_cls, self._counter_cls, self._histogram_cls = (
            bound(Gauge),
            bound(Counter),
            bound(Histogram),
        )
        super().__init__(*args)


def test_prometheus_series_per_engine() -> None:
    prom = _Prom(
        types.SimpleNamespace(kv_transfer_config=KV_CONFIG),
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    assert isinstance(prom.prom_metrics, KvxPromMetrics)
    first = rank_stats([(0.004, 131072, 8), (0.02, 393216, 24)], failed=1)
    first.record_backend("shm")
    prom.observe(first.to_dict(), engine_idx=1)
    prom.observe(rank_stats([(0.3, 262144, 16)], failed=2, expired=1).to_dict(), engine_idx=1)
    prom.observe(rank_stats([], expired=4).to_dict(), engine_idx=0)

    def value(name: str, engine: str, **labels: str) -> float | None:
        return prom.registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})

    assert value("vllm:kvx_xfer_time_seconds_count", "1") == 3
    assert value("vllm:kvx_xfer_time_seconds_sum", "1") == pytest.approx(0.324)
    assert value("vllm:kvx_xfer_time_seconds_bucket", "1", le="0.005") == 1
    assert value("vllm:kvx_xfer_time_seconds_bucket", "1", le="0.025") == 2
    assert value("vllm:kvx_bytes_transferred_sum", "1") == 131072 + 393216 + 262144
    assert value("vllm:kvx_bytes_transferred_bucket", "1", le="131072.0") == 1
    assert value("vllm:kvx_num_descriptors_sum", "1") == 48
    assert value("vllm:kvx_num_failed_transfers_total", "1") == 3
    assert value("vllm:kvx_num_kv_expired_reqs_total", "1") == 1
    assert value("vllm:kvx_backend_info", "1", backend="shm") == 1
    assert value("vllm:kvx_backend_info", "1", backend="tcp") is None
    # The other engine's series are its own.
    assert value("vllm:kvx_xfer_time_seconds_count", "0") == 0
    assert value("vllm:kvx_num_failed_transfers_total", "0") == 0
    assert value("vllm:kvx_num_kv_expired_reqs_total", "0") == 4
    assert value("vllm:kvx_backend_info", "0", backend="shm") is None
