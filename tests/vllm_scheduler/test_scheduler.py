"""KvxConnector's scheduler half inside vLLM 0.33's real Scheduler.

No worker, no model: each step's model output is written by hand, with the
connector report (finished sending/receiving, failed receives, invalid
blocks) that KvxWorker would give. What is checked is the contract between
KvxScheduler and vLLM: which blocks are held or freed and when, what the
metadata tells the workers, and how requests move between states.
"""

from __future__ import annotations

import os
import types

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="scheduler-level tests run in the vLLM 0.33 environment "
    "(.venv-vllm-next, built by scripts/test.sh)",
)
if not vllm.__version__.startswith("0.33."):
    pytest.skip(
        f"scheduler-level tests are written against vLLM 0.33's Scheduler, not {vllm.__version__}",
        allow_module_level=True,
    )
# huggingface_hub reads this once, when vLLM's config modules first import it:
# the model is a local config.json and nothing may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvx.connectors import side_channel  # noqa: E402
from kvx.connectors.vllm import scheduler as kvx_scheduler  # noqa: E402
from kvx.connectors.vllm.meta import KvxConnectorMetadata, remote_params_ok  # noqa: E402
from tests.vllm_scheduler.conftest import (  # noqa: E402
    BLOCK_SIZE,
    LEASE_S,
    block_ids,
    fake_handshake,
    free_blocks,
    make_request,
    prompt,
    remote_params,
    step,
)

NUM_BLOCKS = 64
ALL_FREE = NUM_BLOCKS - 1  # vLLM keeps one null block out of the pool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def meta_of(scheduler_output) -> KvxConnectorMetadata:
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, KvxConnectorMetadata)
    return meta


def assert_empty(scheduler) -> None:
    """Nothing left behind: no request, every block back in the pool."""
    assert not scheduler.requests
    assert not scheduler.waiting and not scheduler.kv_holding_waiting and not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids and not scheduler.failed_recving_kv_req_ids
    assert free_blocks(scheduler) == ALL_FREE


@pytest.fixture
def prefill(new_scheduler):
    scheduler = new_scheduler("kv_producer", NUM_BLOCKS)
    fake_handshake(scheduler)
    return scheduler


@pytest.fixture
def decode(new_scheduler):
    return new_scheduler("kv_consumer", NUM_BLOCKS)


def add_prefill(scheduler, request_id: str, tokens: list[int], max_tokens: int = 1):
    """A prefill request as the proxy sends it: decode will read its KV."""
    request = make_request(
        request_id, tokens, max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True}
    )
    scheduler.add_request(request)
    return request


def add_remote(scheduler, request_id: str, tokens: list[int], **kwargs):
    """A decode request carrying the kv_transfer_params prefill handed out."""
    request = make_request(
        request_id, tokens, kv_transfer_params=remote_params(f"prefill-{request_id}", len(tokens)), **kwargs
    )
    scheduler.add_request(request)
    return request


# 1. Prefill.


def test_prefill_holds_blocks_until_decode_has_read_them(prefill):
    request = add_prefill(prefill, "p1", prompt(40))

    out, outputs = step(prefill)
    assert out.num_scheduled_tokens == {"p1": 40}
    assert meta_of(out).recv == [] and meta_of(out).hold == {}
    held = block_ids(prefill, "p1")
    assert len(held) == cdiv(40, BLOCK_SIZE)

    finished = outputs["p1"]
    assert finished.finish_reason == FinishReason.LENGTH
    params = finished.kv_transfer_params
    assert remote_params_ok(params)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [held]  # one list per KV-cache group
    assert params["remote_engine_id"] == prefill.vllm_config.kv_transfer_config.engine_id
    assert params["remote_request_id"] == "p1"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_num_tokens"] == 40
    assert params["tp_size"] == 1 and params["pp_size"] == 1
    kvx = params["kvx"]
    assert kvx["agents"] == ["vllm-test-tp0"] and kvx["epochs"] == ["0xabc"]
    assert isinstance(kvx["digest"], str) and len(kvx["digest"]) == 16
    assert set(params) >= set(remote_params("x", 40))  # the shape the decode tests use
    # remote_host:remote_port is the side channel, serving the workers' handshake.
    doc = side_channel.fetch(params["remote_host"], params["remote_port"], timeout_s=5)
    assert doc["engine_id"] == params["remote_engine_id"]
    assert [r["agent_name"] for r in doc["ranks"]] == kvx["agents"]

    # Finished, but its blocks stay allocated for decode to read.
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "p1" in prefill.requests
    assert free_blocks(prefill) == ALL_FREE - len(held)

    # The worker learns of the hold (and its lease) with the next step.
    out, _ = step(prefill)
    assert out.total_num_scheduled_tokens == 0
    assert meta_of(out).hold == {"p1": LEASE_S}
    assert free_blocks(prefill) == ALL_FREE - len(held)

    # Decode said "done": the worker reports the send finished and vLLM frees.
    step(prefill, finished_sending={"p1"})
    assert_empty(prefill)


def test_prefill_request_without_kv_transfer_params_is_not_held(prefill):
    prefill.add_request(make_request("plain", prompt(20), max_tokens=1))
    out, outputs = step(prefill)
    assert outputs["plain"].kv_transfer_params is None
    assert_empty(prefill)
    assert meta_of(prefill.schedule()).hold == {}


def test_prefill_aborted_request_is_not_held(prefill):
    add_prefill(prefill, "p1", prompt(40), max_tokens=4)
    step(prefill)
    prefill.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    assert_empty(prefill)
    assert meta_of(prefill.schedule()).hold == {}


def test_prefill_hands_over_only_the_prompt_blocks(prefill):
    add_prefill(prefill, "p1", prompt(32), max_tokens=2)
    step(prefill)
    _, outputs = step(prefill)  # the second token's KV starts a third block
    params = outputs["p1"].kv_transfer_params
    assert len(block_ids(prefill, "p1")) == 3
    assert params["remote_block_ids"] == [block_ids(prefill, "p1")[:2]]
    assert params["remote_num_tokens"] == 32


def test_prefill_without_worker_handshake_refuses_to_hold(new_scheduler):
    # No agent has registered a KV cache: nothing could serve decode's read.
    scheduler = new_scheduler("kv_producer", NUM_BLOCKS)
    add_prefill(scheduler, "p1", prompt(40))
    _, outputs = step(scheduler)
    assert outputs["p1"].kv_transfer_params is None
    assert_empty(scheduler)


# 2. Decode.


@pytest.mark.parametrize("prompt_len", [7, 32, 37])
def test_decode_waits_for_remote_kv_then_runs_the_last_token(decode, prompt_len):
    request = add_remote(decode, "d1", prompt(prompt_len))

    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0
    meta = meta_of(out)
    assert meta.idle  # nothing computed: the worker may wait for the load there
    assert len(meta.recv) == 1
    recv = meta.recv[0]
    assert recv.request_id == "d1" and not recv.release_only
    assert len(recv.local_block_ids[0]) == cdiv(prompt_len, BLOCK_SIZE)
    assert recv.local_block_ids == [block_ids(decode, "d1")]  # one list per KV-cache group
    assert recv.params["remote_request_id"] == "prefill-d1"
    assert meta.renew == []  # allocated in the same step: nothing to renew
    assert request.kv_transfer_params["do_remote_prefill"] is False  # one load per request

    # Still loading: the request is not scheduled and nothing is asked twice.
    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0 and meta_of(out).recv == []

    # The worker reports the load; the next step runs the last prompt token.
    step(decode, finished_recving={"d1"})
    out, outputs = step(decode)
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"d1": 1} and not meta_of(out).idle
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "d1" and new.num_computed_tokens == prompt_len - 1
    assert list(new.block_ids[0]) == recv.local_block_ids[0]
    assert meta_of(out).recv == []
    assert outputs["d1"].new_token_ids == [5]

    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert_empty(decode)


# 3. and 4. Load errors.


def test_decode_load_failure_with_policy_fail_finishes_the_request(decode):
    request = add_remote(decode, "d1", prompt(37))
    out, _ = step(decode)
    (local,) = meta_of(out).recv[0].local_block_ids

    # KvxWorker reports a failed read in finished_recving and failed_recving,
    # and its blocks as load errors.
    _, outputs = step(decode, finished_recving={"d1"}, failed_recving={"d1"}, invalid_block_ids=set(local))
    assert request.status == RequestStatus.FINISHED_ERROR
    assert outputs["d1"].finish_reason == FinishReason.ERROR
    assert_empty(decode)

    out, outputs = step(decode)
    assert out.total_num_scheduled_tokens == 0 and outputs == {}


def test_decode_load_failure_with_policy_fail_is_reported_by_request_alone(decode):
    # failed_recving without block ids (e.g. the side channel was unreachable).
    request = add_remote(decode, "d1", prompt(20))
    step(decode)
    step(decode, finished_recving={"d1"}, failed_recving={"d1"})
    assert request.status == RequestStatus.FINISHED_ERROR
    assert_empty(decode)


def test_decode_load_failure_with_policy_recompute_computes_the_prompt_locally(new_scheduler):
    decode = new_scheduler("kv_consumer", NUM_BLOCKS, load_failure_policy="recompute")
    request = add_remote(decode, "d1", prompt(37))
    out, _ = step(decode)
    (local,) = meta_of(out).recv[0].local_block_ids

    step(decode, finished_recving={"d1"}, failed_recving={"d1"}, invalid_block_ids=set(local))
    assert not request.is_finished()

    out, _ = step(decode)
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"d1": 37}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0
    assert meta_of(out).recv == []  # no second read

    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert_empty(decode)


# 5. Local prefix cache hits on decode.


@pytest.mark.parametrize("prompt_len", [32, 40])
def test_decode_full_prefix_hit_reads_only_the_uncached_tail(decode, prompt_len):
    # vLLM 0.33 caps a local hit at prompt_len - 1 tokens in whole blocks, so
    # even a prompt that is cached in full leaves the connector at least its
    # last block to load: the read is not skipped, it is shortened.
    tokens = prompt(prompt_len)
    decode.add_request(make_request("plain", tokens, max_tokens=1))
    step(decode)
    assert_empty(decode)
    cached_blocks = (prompt_len - 1) // BLOCK_SIZE

    request = add_remote(decode, "d1", tokens)
    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = meta_of(out).recv
    assert not recv.release_only
    allocated = block_ids(decode, "d1")
    assert len(allocated) == cdiv(prompt_len, BLOCK_SIZE)
    # By block position; 0 (vLLM's null block id) where the local cache already holds the block.
    assert recv.local_block_ids == [[0] * cached_blocks + allocated[cached_blocks:]]
    assert len(recv.local_block_ids[0]) == len(recv.params["remote_block_ids"][0])

    step(decode, finished_recving={"d1"})
    out, _ = step(decode)
    assert out.num_scheduled_tokens == {"d1": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == prompt_len - 1
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert_empty(decode)


def test_decode_request_that_must_not_read_caches_releases_prefill_blocks(decode):
    # Prompt logprobs make vLLM skip every cache (local and external): no
    # tokens come from prefill, so it must only be told to free its blocks.
    request = add_remote(decode, "d1", prompt(37), prompt_logprobs=1)
    out, _ = step(decode)
    (recv,) = meta_of(out).recv
    assert recv.release_only and recv.local_block_ids == []
    assert recv.params["remote_request_id"] == "prefill-d1"
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"d1": 37}
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert_empty(decode)


# 6. Aborts on decode.


def test_decode_abort_before_allocation_releases_prefill_blocks(decode):
    add_remote(decode, "d1", prompt(37))
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert_empty(decode)

    out = decode.schedule()
    meta = meta_of(out)
    (recv,) = meta.recv
    assert recv.request_id == "d1" and recv.release_only and recv.local_block_ids == []
    assert recv.params["remote_request_id"] == "prefill-d1"
    assert meta.renew == []  # no longer waiting
    assert meta_of(decode.schedule()).recv == []  # said once


def test_decode_abort_while_loading_frees_blocks_only_after_the_load_ends(decode):
    request = add_remote(decode, "d1", prompt(37))
    step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    used = free_blocks(decode)
    assert used == ALL_FREE - cdiv(37, BLOCK_SIZE)

    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    # The worker may still be writing into these blocks.
    assert "d1" in decode.requests and free_blocks(decode) == used
    out, _ = step(decode)
    assert meta_of(out).recv == []  # the read in flight will tell prefill "done"
    assert free_blocks(decode) == used

    step(decode, finished_recving={"d1"})
    assert_empty(decode)


def test_decode_abort_while_loading_then_a_failed_load_frees_blocks(decode):
    add_remote(decode, "d1", prompt(37))
    out, _ = step(decode)
    (local,) = meta_of(out).recv[0].local_block_ids
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    step(decode, finished_recving={"d1"}, failed_recving={"d1"}, invalid_block_ids=set(local))
    assert_empty(decode)


# 7. Leases.


def test_decode_renews_the_lease_of_requests_waiting_for_blocks(new_scheduler, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(kvx_scheduler, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    # 8 blocks (7 usable): a long local request takes 6, so the remote one
    # (3 blocks) cannot be allocated and waits in the queue.
    decode = new_scheduler("kv_consumer", 8)
    decode.add_request(make_request("busy", prompt(90), max_tokens=100))
    step(decode)
    assert free_blocks(decode) == 1
    request = add_remote(decode, "d1", prompt(40))

    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING
    meta = meta_of(out)
    assert meta.recv == []
    assert [p["remote_request_id"] for p in meta.renew] == ["prefill-d1"]
    assert meta.renew[0]["remote_engine_id"] == "prefill-engine-0"

    # Renewals go out every lease_s / 4, not every step.
    clock[0] += LEASE_S / 8
    assert meta_of(step(decode)[0]).renew == []
    clock[0] += LEASE_S / 8
    assert [p["remote_request_id"] for p in meta_of(step(decode)[0]).renew] == ["prefill-d1"]

    # Once it has blocks it is read, and renewed no more.
    decode.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [r.request_id for r in meta_of(out).recv] == ["d1"]
    clock[0] += LEASE_S
    assert meta_of(step(decode)[0]).renew == []


def test_prefill_hold_is_announced_once_and_kept_until_the_worker_reports(prefill):
    add_prefill(prefill, "p1", prompt(40))
    step(prefill)
    held = free_blocks(prefill)
    assert held == ALL_FREE - cdiv(40, BLOCK_SIZE)

    holds = [meta_of(step(prefill)[0]).hold for _ in range(5)]
    # The lease is the worker's clock: the scheduler announces it once and
    # frees nothing until the worker reports the send finished (or expired).
    assert holds == [{"p1": LEASE_S}, {}, {}, {}, {}]
    assert "p1" in prefill.requests and free_blocks(prefill) == held

    step(prefill, finished_sending={"p1"})
    assert_empty(prefill)
