"""KvxConnector: vLLM's KV connector (V1 API) over kvx agents.

A thin front: scheduler-side calls go to ``KvxScheduler``, worker-side calls
to ``KvxWorker``; only ``KvxConnectorMetadata`` crosses between them.
Configure with ``--kv-transfer-config``::

    {"kv_connector": "KvxConnector", "kv_role": "kv_producer"}          # prefill
    {"kv_connector": "KvxConnector", "kv_role": "kv_consumer"}          # decode

(``"kv_connector_module_path": "kvx.connectors.vllm"`` when the plugin entry
point is not installed) and ``kv_connector_extra_config`` as in
``KvxConnectorConfig``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvx.connectors.vllm.config import KvxConnectorConfig
from kvx.connectors.vllm.meta import KvxConnectorMetadata, KvxHandshakeMetadata
from kvx.connectors.vllm.scheduler import KvxScheduler
from kvx.connectors.vllm.stats import KvxConnectorStats, KvxPromMetrics
from kvx.connectors.vllm.worker import KvxWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """vLLM configures only its own loggers: give kvx's a handler in engine processes."""
    import os

    root = logging.getLogger("kvx")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(
            "(kvx pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"
        )
    )
    root.addHandler(handler)
    root.setLevel(os.environ.get("KVX_LOG_LEVEL", "INFO").upper())


class KvxConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: models with several KV-cache groups keep vLLM's hybrid allocator."""

    # Prompt KV loaded by this connector came from a peer engine.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        kv = vllm_config.kv_transfer_config
        cfg = KvxConnectorConfig.from_extra(kv.kv_connector_extra_config)
        engine_id = str(kv.engine_id)
        layout = type(self).get_required_kvcache_layout(vllm_config)
        self._scheduler: KvxScheduler | None = None
        self._worker: KvxWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvxScheduler(vllm_config, kv_cache_config, cfg, engine_id, layout)
        else:
            self._worker = KvxWorker(vllm_config, kv_cache_config, cfg, engine_id, layout)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Head-major block interiors let a decode rank read exactly its heads
        # when prefill and decode differ in tensor parallelism. MLA caches
        # have no head axis to slice.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KvxHandshakeMetadata | None:
        return self._worker.handshake_metadata() if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pull mode loads whole requests between steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Pull mode saves nothing: decode reads after prefill finished. Push WRITEs the layer now.
        if self._worker is not None and self._worker.push is not None:
            meta = self._get_connector_metadata()
            if isinstance(meta, KvxConnectorMetadata) and meta.push is not None:
                self._worker.push.save_layer(meta.push, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        # The WRITEs complete in the background; the push only stops counting this step.
        if self._worker is not None and self._worker.push is not None:
            self._worker.push.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Worker side only: the scheduler half moves no bytes.
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxConnectorStats(data=data) if data is not None else KvxConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # Scheduler side.

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._scheduler is not None
        ranks = {}
        for rank, md in metadata.items():
            if not isinstance(md, KvxHandshakeMetadata):
                raise TypeError(f"KvxConnector expects KvxHandshakeMetadata from rank {rank}, not {type(md)}")
            ranks[int(rank)] = md
        self._scheduler.set_handshake(ranks)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
