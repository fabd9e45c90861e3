"""Helpers for driving vLLM 0.33's real scheduler with KvxConnector, no workers.

The scheduler half of the connector runs inside vLLM's own ``Scheduler``;
the worker half is played by hand: each step's ``ModelRunnerOutput`` carries
the ``KVConnectorOutput`` (finished sending/receiving, failed receives,
invalid blocks) that ``KvxWorker.get_finished`` would have reported.

vLLM is imported inside the helpers, not here: this conftest is loaded even
where vLLM is missing, and a skip raised while loading a conftest is an error
when pytest is pointed at this directory. test_scheduler.py does the skipping
(and sets HF_HUB_OFFLINE, only where these tests run).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 64
EOS_TOKEN_ID = 2
LEASE_S = 30.0

_next_token_base = itertools.count(3)


def make_vllm_config(
    role: str,
    *,
    lease_s: float = LEASE_S,
    load_failure_policy: str = "fail",
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
) -> Any:
    """A VllmConfig for the tiny Llama on CPU with KvxConnector in ``role``."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    with _own_model_info_cache():
        model = ModelConfig(
            model=str(TINY_LLAMA), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=1024
        )
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=model.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    kv = KVTransferConfig(
        kv_connector="KvxConnector",
        kv_connector_module_path="kvx.connectors.vllm",
        kv_role=role,
        kv_connector_extra_config={"lease_s": lease_s},
        kv_load_failure_policy=load_failure_policy,
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


@contextlib.contextmanager
def _own_model_info_cache() -> Iterator[None]:
    """Point vLLM's model-info cache at a directory of this vLLM version's own.

    ModelConfig inspects the architecture in a subprocess (tens of seconds on a
    busy CPU) unless ``$VLLM_CACHE_ROOT/modelinfos/<class>.json`` holds this
    version's answer; the file name has no version in it, so a vLLM 0.32 run
    (the end-to-end engines) overwrites it and every run after pays again.
    Scoped to the call: processes started later keep the usual cache.
    """
    import vllm
    import vllm.envs

    before = os.environ.get("VLLM_CACHE_ROOT")
    own = Path(vllm.envs.VLLM_CACHE_ROOT) / f"kvx-tests-vllm-{vllm.__version__}"
    os.environ["VLLM_CACHE_ROOT"] = str(own)
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_CACHE_ROOT"]
        else:
            os.environ["VLLM_CACHE_ROOT"] = before


def make_kv_cache_config(num_blocks: int, sliding_window: int | None = None) -> Any:
    """One full-attention group; with ``sliding_window``, vLLM's hybrid layout of a model
    whose layer 0 has a sliding window (Gemma-2 style): group 0 sliding, group 1 full."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    geometry = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": NUM_KV_HEADS,
        "head_size": HEAD_SIZE,
        "dtype": torch.bfloat16,
    }
    if sliding_window is None:
        groups = [KVCacheGroupSpec(layers, FullAttentionSpec(**geometry))]
    else:
        groups = [
            KVCacheGroupSpec(layers[:1], SlidingWindowSpec(**geometry, sliding_window=sliding_window)),
            KVCacheGroupSpec(layers[1:], FullAttentionSpec(**geometry)),
        ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(vllm_config: Any, num_blocks: int = 64, sliding_window: int | None = None) -> Any:
    """vLLM's Scheduler (the class the engine core uses) over ``num_blocks`` KV blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    assert not vllm_config.scheduler_config.async_scheduling, "these tests drive the synchronous Scheduler"
    kv_cache_config = make_kv_cache_config(num_blocks, sliding_window)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


@pytest.fixture
def new_scheduler():
    """Factory: ``new_scheduler(role, num_blocks=..., sliding_window=..., **config)``; shut down
    after the test. ``sliding_window`` gives the scheduler two KV-cache groups (hybrid)."""
    made: list[Any] = []

    def new(role: str, num_blocks: int = 64, sliding_window: int | None = None, **config: Any) -> Any:
        scheduler = make_scheduler(make_vllm_config(role, **config), num_blocks, sliding_window)
        made.append(scheduler)
        return scheduler

    yield new
    for scheduler in made:
        scheduler.shutdown()  # closes the prefill side channel server


def prompt(length: int) -> list[int]:
    """Token ids no other call's prompt shares a block with (EOS never appears)."""
    base = next(_next_token_base) * 7
    return [3 + (base + i) % 1000 for i in range(length)]


@functools.cache
def _init_block_hashing() -> None:
    """Once per process, as the engine core does before the first request."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    _init_block_hashing()
    sampling = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    sampling.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    # A copy: the connector marks the params it has acted on.
    request.kv_transfer_params = dict(kv_transfer_params) if kv_transfer_params is not None else None
    return request


def remote_params(
    remote_request_id: str,
    num_tokens: int,
    *,
    engine_id: str = "prefill-engine-0",
    block_ids: list[list[int]] | None = None,
) -> dict[str, Any]:
    """kv_transfer_params shaped as KvxScheduler.request_finished returns them on prefill."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        # Per KV-cache group.
        "remote_block_ids": block_ids if block_ids is not None else [list(range(100, 100 + num_blocks))],
        "remote_engine_id": engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": num_tokens,
        "tp_size": 1,
        "pp_size": 1,
        "kvx": {
            "agents": [f"vllm-{engine_id}-tp0"],
            "epochs": ["0x1"],
            "digest": "0" * 16,
            "lease_s": LEASE_S,
        },
    }


def model_output(
    scheduler_output: Any,
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    token_id: int = 5,
) -> Any:
    """What the workers would return for ``scheduler_output``: one sampled token per
    scheduled request and the connector's report, as KvxWorker.get_finished gives it."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv = None
    if finished_sending or finished_recving or failed_recving or invalid_block_ids:
        kv = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=set(failed_recving or ()),
            invalid_block_ids=set(invalid_block_ids or ()),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token_id] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def step(scheduler: Any, **report: Any) -> tuple[Any, dict[str, Any]]:
    """One engine step: schedule, then feed back a model output with ``report``.

    Returns the SchedulerOutput and the EngineCoreOutput of each request that had one.
    """
    scheduler_output = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(scheduler_output, model_output(scheduler_output, **report))
    outputs = {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}
    return scheduler_output, outputs


def free_blocks(scheduler: Any) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(scheduler: Any, request_id: str) -> list[int]:
    (ids,) = scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(ids)


def group_block_ids(scheduler: Any, request_id: str) -> list[list[int]]:
    """The request's block ids per KV-cache group (0: vLLM's null block)."""
    return [list(ids) for ids in scheduler.kv_cache_manager.get_block_ids(request_id)]


def fake_handshake(scheduler: Any) -> None:
    """Stand in for the workers' handshake metadata (made-up agent values); on
    prefill this also starts the side channel server on 127.0.0.1:0."""
    from kvx.connectors.vllm.meta import KvxHandshakeMetadata

    md = KvxHandshakeMetadata(
        tp_rank=0,
        agent_name="vllm-test-tp0",
        agent_epoch=0xABC,
        agent_metadata=b"made-up agent metadata",
        cache={"num_blocks": 64, "layers": [], "num_heads": NUM_KV_HEADS, "planes": 2},
    )
    scheduler.connector.set_xfer_handshake_metadata({0: md})
