"""KvxConnector, scheduler side: decides what moves, never moves bytes.

Prefill (``do_remote_decode``): a finished request keeps its blocks (delayed
free) under a lease, and its ``kv_transfer_params`` tell decode where to
read them. Decode (``do_remote_prefill``): the request's prompt KV is
external; once blocks are allocated the worker reads the ones decode lacks
(a local prefix hit covers the rest, and vLLM always leaves at least the last
block to load), and a request that ends before that (abort) or loads nothing
(vLLM skips caches for it) still releases prefill's blocks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvx.connectors.side_channel import SideChannelServer
from kvx.connectors.vllm.config import KvxConnectorConfig
from kvx.connectors.vllm.meta import (
    KvxConnectorMetadata,
    KvxHandshakeMetadata,
    RecvRequest,
    compat_fields,
    digest,
    remote_params_ok,
)
from kvx.connectors.vllm.push import PushScheduler, warn_if_push

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KvxScheduler:
    def __init__(self, vllm_config: VllmConfig, cfg: KvxConnectorConfig, engine_id: str, layout: str | None):
        self.cfg = cfg
        self.engine_id = engine_id
        kv = vllm_config.kv_transfer_config
        self.is_producer = bool(kv.is_kv_producer)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.compat = compat_fields(vllm_config, layout)
        self._recv: list[RecvRequest] = []
        self._hold: dict[str, float] = {}
        self._waiting: dict[str, dict[str, Any]] = {}  # decode: params of requests not yet allocated
        self._last_renew = 0.0
        self._ranks: dict[int, KvxHandshakeMetadata] = {}
        self._server: SideChannelServer | None = None
        self.push = PushScheduler(self) if cfg.mode == "push" else None

    # Handshake metadata from the workers (once, after their caches are registered).

    def set_handshake(self, ranks: dict[int, KvxHandshakeMetadata]) -> None:
        self._ranks.update(ranks)
        if not self.is_producer and self.push is None:
            return  # push: prefill finds a decode engine's agents through its side channel
        if self._server is None:
            self._server = SideChannelServer(self.cfg.host, self.cfg.side_channel_port)
            logger.info(
                "kvx side channel for engine %s on %s:%d", self.engine_id, self.cfg.host, self._server.port
            )
        self._server.publish(
            {
                "engine_id": self.engine_id,
                "tp_size": self.tp_size,
                "compat": self.compat,
                "ranks": [self._ranks[r].to_json() for r in sorted(self._ranks)],
            }
        )

    # Decode side.

    def on_new_request(self, request: Request) -> None:
        if self.push is None:
            warn_if_push(request.kv_transfer_params, request.request_id)
        elif self.push.on_new_request(request):
            return
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and remote_params_ok(params):
            self._waiting[request.request_id] = params

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and remote_params_ok(params):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if self.push is not None and self.push.after_alloc(request, blocks, num_external_tokens):
            self._waiting.pop(request.request_id, None)
            return
        if remote_params_ok(params):
            if num_external_tokens > 0:
                local = blocks.get_unhashed_block_ids()
                self._recv.append(RecvRequest(request.request_id, local, params))
            else:
                # No external tokens (vLLM skips caches for this request, e.g. prompt logprobs):
                # nothing to read, but prefill must free its blocks.
                self._recv.append(RecvRequest(request.request_id, [], params, release_only=True))
        else:
            logger.warning(
                "request %s: incomplete kv_transfer_params %s; computing its prompt locally",
                request.request_id,
                params,
            )
        params["do_remote_prefill"] = False  # one load per request
        self._waiting.pop(request.request_id, None)

    # Both sides.

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> KvxConnectorMetadata:
        meta = KvxConnectorMetadata(recv=self._recv, hold=self._hold)
        if self.push is not None:
            meta.push = self.push.take_meta(scheduler_output)
        now = time.monotonic()
        if self._waiting and now - self._last_renew >= self.cfg.lease_s / 4:
            meta.renew = list(self._waiting.values())
            self._last_renew = now
        self._recv, self._hold = [], {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.push is not None:
            answer = self.push.request_finished(request, block_ids)
            if answer is not None:
                return answer
        if params.get("do_remote_prefill"):
            # Finished before its blocks were allocated (aborted while queued): free prefill's blocks.
            self._waiting.pop(request.request_id, None)
            if remote_params_ok(params):
                self._recv.append(RecvRequest(request.request_id, [], params, release_only=True))
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed on prefill: free now, nothing to hand over
        if not block_ids:
            return False, None
        if not self._ranks:
            logger.error(
                "request %s: no kvx agent registered its KV cache; decode will compute it", request.request_id
            )
            return False, None
        # Only the prompt's blocks: decode computes from the prompt, and aligns prefill's blocks
        # with its own from the end (prefill may have generated past the prompt).
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        block_ids = list(block_ids)[: -(-num_tokens // self.block_size)]
        self._hold[request.request_id] = self.cfg.lease_s
        ranks = [self._ranks[r] for r in sorted(self._ranks)]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # Per KV-cache group (one group: the hybrid allocator is off for this connector).
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.cfg.host,
            "remote_port": self._server.port if self._server else None,
            "remote_num_tokens": num_tokens,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "kvx": {
                "agents": [r.agent_name for r in ranks],
                "epochs": [f"{r.agent_epoch:#x}" for r in ranks],
                "digest": digest(self.compat),
                "lease_s": self.cfg.lease_s,
            },
        }

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
