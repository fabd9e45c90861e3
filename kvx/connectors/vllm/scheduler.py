"""KvxConnector, scheduler side: decides what moves, never moves bytes.

Prefill (``do_remote_decode``): a finished request keeps its blocks (delayed
free) under a lease, and its ``kv_transfer_params`` tell decode where to
read them. Decode (``do_remote_prefill``): the request's prompt KV is
external; once blocks are allocated the worker reads the ones decode lacks
(a local prefix hit covers the rest, and vLLM always leaves at least the last
block to load), and a request that ends before that (abort) or loads nothing
(vLLM skips caches for it) still releases prefill's blocks.

KV-cache groups (vLLM's hybrid allocator, ``SupportsHMA``): block ids go
per group, each list aligned by block position. A sliding-window group
carries only the blocks inside the window of the prompt's last token; the
ones before are vLLM's null block (id 0) on both engines, and are not moved.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvx.connectors.side_channel import SideChannelServer
from kvx.connectors.vllm.config import KvxConnectorConfig
from kvx.connectors.vllm.meta import (
    NULL_BLOCK_ID,
    KvxConnectorMetadata,
    KvxHandshakeMetadata,
    RecvRequest,
    cache_groups,
    check_remote_block_ids,
    compat_fields,
    digest,
    remote_params_ok,
    window_start_block,
)
from kvx.connectors.vllm.push import PushScheduler, check_push_groups, warn_if_push
from kvx.errors import KvxError, ProtocolError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KvxScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        cfg: KvxConnectorConfig,
        engine_id: str,
        layout: str | None,
    ):
        self.cfg = cfg
        self.engine_id = engine_id
        kv = vllm_config.kv_transfer_config
        self.is_producer = bool(kv.is_kv_producer)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.groups = cache_groups(kv_cache_config)
        if cfg.mode == "push":
            check_push_groups(self.groups)
        self.compat = compat_fields(vllm_config, layout, kv_cache_config)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
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
        if not params or not params.get("do_remote_prefill") or not remote_params_ok(params):
            return
        try:
            check_remote_block_ids(params, self.groups, self.max_model_len)
            if params["remote_num_tokens"] != request.num_prompt_tokens:
                raise ProtocolError(
                    f"prefill computed {params['remote_num_tokens']} prompt tokens, this request has "
                    f"{request.num_prompt_tokens}: send both engines the same prompt"
                )
        except KvxError as exc:
            # A peer's (or a client's) words: never trusted, never fatal to the engine.
            logger.error("request %s: %s; computing its prompt locally", request.request_id, exc)
            params["do_remote_prefill"] = False
            return
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
                self._recv.append(RecvRequest(request.request_id, _blocks_to_fill(blocks), params))
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
        meta.idle = scheduler_output is not None and scheduler_output.total_num_scheduled_tokens == 0
        if self.push is not None:
            meta.push = self.push.take_meta(scheduler_output)
        now = time.monotonic()
        if self._waiting and now - self._last_renew >= self.cfg.lease_s / 4:
            meta.renew = list(self._waiting.values())
            self._last_renew = now
        self._recv, self._hold = [], {}
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished_all_groups``: ``block_ids`` holds one list per KV-cache group."""
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
        if not any(block_ids):
            return False, None
        if not self._ranks:
            logger.error(
                "request %s: no kvx agent registered its KV cache; decode will compute it", request.request_id
            )
            return False, None
        assert len(block_ids) == len(self.groups), (len(block_ids), self.groups)
        # Only the prompt's blocks: decode computes from the prompt (prefill may have generated
        # past it), and in a sliding-window group only those inside the window of the prompt's
        # last token (vLLM may not have nulled the rest yet: the window moved during this step).
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        per_group = []
        for group, ids in zip(self.groups, block_ids, strict=True):
            ids = list(ids)[: -(-num_tokens // group["block_size"])]
            start = window_start_block(group, num_tokens)
            per_group.append([NULL_BLOCK_ID] * min(start, len(ids)) + ids[start:])
        self._hold[request.request_id] = self.cfg.lease_s
        ranks = [self._ranks[r] for r in sorted(self._ranks)]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # Per KV-cache group, by block position; NULL_BLOCK_ID outside a sliding window.
            "remote_block_ids": per_group,
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


def _blocks_to_fill(blocks: KVCacheBlocks) -> list[list[int]]:
    """Per group, by block position: the block decode must read, or NULL_BLOCK_ID where it
    must not (a local prefix-cache hit, or vLLM's null block outside a sliding window)."""
    return [
        [NULL_BLOCK_ID if b.is_null or b.block_hash is not None else b.block_id for b in group]
        for group in blocks.blocks
    ]
