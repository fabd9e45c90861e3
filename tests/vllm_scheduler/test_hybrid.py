"""KvxConnector with several KV-cache groups (vLLM's hybrid allocator), in vLLM 0.33's Scheduler.

The scheduler runs a model whose layer 0 has a sliding window and layer 1
full attention (two groups, as vLLM lays out Gemma-2 style models). What is
checked: the hybrid allocator stays on with KvxConnector, block ids cross
per group, blocks outside the window are neither offered by prefill nor
read by decode, and kv_transfer_params from a peer are checked before use.
"""

from __future__ import annotations

import logging
import os

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
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvx.connectors.vllm import KvxConnector  # noqa: E402
from kvx.connectors.vllm.meta import (  # noqa: E402
    KvxConnectorMetadata,
    cache_groups,
    check_remote_block_ids,
    window_start_block,
)
from kvx.connectors.vllm.worker import _block_pairs, _group_caches  # noqa: E402
from kvx.errors import ConfigError, ProtocolError  # noqa: E402
from tests.vllm_scheduler.conftest import (  # noqa: E402
    BLOCK_SIZE,
    fake_handshake,
    free_blocks,
    group_block_ids,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    model_output,
    prompt,
    remote_params,
    step,
)

NUM_BLOCKS = 64
ALL_FREE = NUM_BLOCKS - 1  # vLLM keeps the null block (id 0) out of the pool
WINDOW = 32
PROMPT_LEN = 100  # 7 blocks of 16; the window of token 100 starts in block (100 - 32 + 1) // 16 = 4
NUM_PROMPT_BLOCKS = 7
WINDOW_START = 4
GROUPS = cache_groups(make_kv_cache_config(NUM_BLOCKS, WINDOW))


def meta_of(scheduler_output) -> KvxConnectorMetadata:
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, KvxConnectorMetadata)
    return meta


def hybrid_params(remote_request_id: str, num_tokens: int = PROMPT_LEN) -> dict:
    """Prefill's kv_transfer_params for the hybrid model: null blocks before the window."""
    n = -(-num_tokens // BLOCK_SIZE)
    start = window_start_block(GROUPS[0], num_tokens)
    sliding = [0] * start + list(range(100 + start, 100 + n))
    return remote_params(remote_request_id, num_tokens, block_ids=[sliding, list(range(200, 200 + n))])


@pytest.fixture
def prefill(new_scheduler):
    scheduler = new_scheduler("kv_producer", NUM_BLOCKS, sliding_window=WINDOW)
    fake_handshake(scheduler)
    return scheduler


@pytest.fixture
def decode(new_scheduler):
    return new_scheduler("kv_consumer", NUM_BLOCKS, sliding_window=WINDOW)


def test_kvx_connector_keeps_the_hybrid_allocator_on():
    # vLLM turns the hybrid allocator off for a connector that is not SupportsHMA (and then
    # runs a sliding-window model as if every layer had full attention, in one group).
    assert supports_hma(KvxConnector)
    config = make_vllm_config("kv_producer")
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert [g["kind"] for g in GROUPS] == ["sliding_window", "full"]


def test_prefill_offers_block_ids_per_group_inside_the_window(prefill):
    prefill.add_request(
        make_request("p1", prompt(PROMPT_LEN), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    _, outputs = step(prefill)
    params = outputs["p1"].kv_transfer_params
    sliding, full = params["remote_block_ids"]
    held_sliding, held_full = group_block_ids(prefill, "p1")

    assert full == held_full[:NUM_PROMPT_BLOCKS] and 0 not in full
    assert len(sliding) == NUM_PROMPT_BLOCKS
    # Out-of-window positions are the null block; in-window ones are blocks prefill still holds.
    assert sliding[:WINDOW_START] == [0] * WINDOW_START
    assert sliding[WINDOW_START:] == held_sliding[WINDOW_START:NUM_PROMPT_BLOCKS]
    assert 0 not in sliding[WINDOW_START:]
    assert params["remote_num_tokens"] == PROMPT_LEN
    check_remote_block_ids(params, GROUPS, 1024)  # what decode will accept

    # Held until decode has read them, then every block goes back.
    assert free_blocks(prefill) < ALL_FREE
    out, _ = step(prefill)
    assert meta_of(out).hold == {"p1": pytest.approx(30.0)}
    step(prefill, finished_sending={"p1"})
    assert not prefill.requests and free_blocks(prefill) == ALL_FREE


def test_decode_metadata_names_blocks_per_group_and_skips_the_out_of_window_ones(decode):
    tokens = prompt(PROMPT_LEN)
    params = hybrid_params("prefill-d1")
    request = make_request("d1", tokens, kv_transfer_params=params)
    decode.add_request(request)

    out, _ = step(decode)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = meta_of(out).recv
    local_sliding, local_full = recv.local_block_ids
    allocated_sliding, allocated_full = group_block_ids(decode, "d1")
    assert local_full == allocated_full and 0 not in local_full
    # vLLM allocates no blocks before the window of the prompt's last token (null block, id 0).
    assert allocated_sliding[:WINDOW_START] == [0] * WINDOW_START
    assert local_sliding == allocated_sliding
    assert 0 not in local_sliding[WINDOW_START:]

    # What KvxWorker reads: all of the full group, only the in-window blocks of the sliding one.
    (sliding_local, sliding_remote), (full_local, full_remote) = _block_pairs(
        recv.local_block_ids, params["remote_block_ids"], remote_num_blocks=512
    )
    assert sliding_local == allocated_sliding[WINDOW_START:]
    assert sliding_remote == params["remote_block_ids"][0][WINDOW_START:]
    assert full_local == allocated_full and full_remote == params["remote_block_ids"][1]

    step(decode, finished_recving={"d1"})
    out, _ = step(decode)
    assert out.num_scheduled_tokens == {"d1": 1}
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert not decode.requests and free_blocks(decode) == ALL_FREE


HOSTILE = {
    "one group": (
        lambda p: p.update(remote_block_ids=p["remote_block_ids"][1:]),
        "one list per KV-cache group",
    ),
    "three groups": (lambda p: p["remote_block_ids"].append([1]), "one list per KV-cache group"),
    "not a list": (lambda p: p.update(remote_block_ids="0-7"), "one list per KV-cache group"),
    "short list": (lambda p: p["remote_block_ids"][1].pop(), "must list 7 blocks"),
    "huge list": (lambda p: p["remote_block_ids"][1].extend(range(1000, 10**6)), "must list 7 blocks"),
    "negative id": (lambda p: p["remote_block_ids"][1].__setitem__(0, -1), "block ids in 0.."),
    "huge id": (lambda p: p["remote_block_ids"][1].__setitem__(0, 1 << 40), "block ids in 0.."),
    "string id": (lambda p: p["remote_block_ids"][1].__setitem__(0, "7"), "block ids in 0.."),
    "bool id": (lambda p: p["remote_block_ids"][1].__setitem__(0, True), "block ids in 0.."),
    "null in full group": (lambda p: p["remote_block_ids"][1].__setitem__(0, 0), "null block at position 0"),
    "null inside window": (
        lambda p: p["remote_block_ids"][0].__setitem__(WINDOW_START, 0),
        f"null block at position {WINDOW_START}",
    ),
    "id twice": (lambda p: p["remote_block_ids"][1].__setitem__(1, p["remote_block_ids"][1][0]), "twice"),
    "tokens not int": (lambda p: p.update(remote_num_tokens="100"), "remote_num_tokens"),
    "tokens too many": (lambda p: p.update(remote_num_tokens=10**9), "remote_num_tokens"),
    "tokens zero": (lambda p: p.update(remote_num_tokens=0), "remote_num_tokens"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_remote_block_ids_are_refused_with_the_reason(case):
    params = hybrid_params("prefill-x")
    mutate, reason = HOSTILE[case]
    mutate(params)
    with pytest.raises(ProtocolError, match=reason):
        check_remote_block_ids(params, GROUPS, 1024)


@pytest.mark.parametrize("case", ["one group", "null inside window", "huge list"])
def test_decode_computes_locally_when_prefill_params_are_hostile(decode, caplog, case):
    # The engine must not fall over on a peer's bad params: the request computes its prompt.
    params = hybrid_params("prefill-d1")
    HOSTILE[case][0](params)
    request = make_request("d1", prompt(PROMPT_LEN), kv_transfer_params=params)
    with caplog.at_level(logging.ERROR, logger="kvx.connectors.vllm.scheduler"):
        decode.add_request(request)
        out, _ = step(decode)
    assert HOSTILE[case][1] in caplog.text and "computing its prompt locally" in caplog.text
    assert out.num_scheduled_tokens == {"d1": PROMPT_LEN} and meta_of(out).recv == []
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert not decode.requests and free_blocks(decode) == ALL_FREE


def test_decode_refuses_prefill_params_for_another_prompt_length(decode, caplog):
    request = make_request("d1", prompt(PROMPT_LEN + 20), kv_transfer_params=hybrid_params("prefill-d1"))
    with caplog.at_level(logging.ERROR, logger="kvx.connectors.vllm.scheduler"):
        decode.add_request(request)
        out, _ = step(decode)
    assert "prefill computed 100 prompt tokens, this request has 120" in caplog.text
    assert out.num_scheduled_tokens == {"d1": PROMPT_LEN + 20}
    decode.finish_requests("d1", RequestStatus.FINISHED_ABORTED)


def test_worker_refuses_remote_ids_outside_prefill_cache_and_missing_window_blocks():
    local = [[0, 0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    remote = hybrid_params("x")["remote_block_ids"]
    with pytest.raises(ProtocolError, match="outside its cache of 150 blocks"):
        _block_pairs(local, remote, remote_num_blocks=150)  # the full group's ids reach 206
    # Decode's window needs block 3, which prefill has nulled (it went on past the prompt).
    with pytest.raises(ConfigError, match="no longer holds block 3"):
        _block_pairs([[0, 0, 0, 10, 11, 12, 13], local[1]], remote, remote_num_blocks=512)
    with pytest.raises(ConfigError, match="2 KV-cache groups here, prefill sent block ids for 1"):
        _block_pairs(local, remote[:1], remote_num_blocks=512)


def test_group_layouts_that_differ_are_refused_saying_what_differs():
    from kvx.connectors.vllm.meta import check_compat

    hybrid = {"kv_cache_groups": GROUPS}
    # The same model with --disable-hybrid-kv-cache-manager: every layer in one full group.
    single = {"kv_cache_groups": cache_groups(make_kv_cache_config(NUM_BLOCKS))}
    with pytest.raises(
        ConfigError, match=r"kv_cache_groups: here \[\{.*sliding_window.*\}\], prefill engine p"
    ):
        check_compat(hybrid, single, "prefill engine p")
    # A prefill rank whose cache description has another group count.
    with pytest.raises(ConfigError, match="describes 1 KV-cache groups, this engine has 2"):
        _group_caches({"groups": [{"layers": [], "num_blocks": 8, "num_heads": 2, "planes": 2}]}, 2, "p")
    with pytest.raises(ConfigError, match="describes no KV-cache groups"):
        _group_caches({"layers": []}, 2, "p")  # a kvx wire 1 description


def test_prefill_nulls_blocks_before_the_window_that_vllm_still_holds(prefill):
    # vLLM 0.33 nulls them itself before request_finished_all_groups; a vLLM that frees them
    # later (the window moved during the last step) still hands them in: kvx does not offer them.
    request = make_request(
        "p1", prompt(PROMPT_LEN), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = PROMPT_LEN
    sliding, full = list(range(1, 8)), list(range(11, 18))
    delay, params = prefill.connector.request_finished_all_groups(request, (sliding, full))
    assert delay
    assert params["remote_block_ids"] == [[0] * WINDOW_START + sliding[WINDOW_START:], full]


def test_vllm_refuses_block_level_load_errors_with_several_groups(decode):
    # Block ids are unique only per group: vLLM stops the engine on block-level load errors
    # from a model with several groups, which is why KvxWorker then reports only the request.
    request = make_request("d1", prompt(PROMPT_LEN), kv_transfer_params=hybrid_params("prefill-d1"))
    decode.add_request(request)
    out, _ = step(decode)
    (recv,) = meta_of(out).recv
    out = decode.schedule()
    report = model_output(
        out, finished_recving={"d1"}, failed_recving={"d1"}, invalid_block_ids={recv.local_block_ids[1][0]}
    )
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        decode.update_from_output(out, report)


def test_a_failed_load_without_block_ids_ends_the_request(decode):
    request = make_request("d1", prompt(PROMPT_LEN), kv_transfer_params=hybrid_params("prefill-d1"))
    decode.add_request(request)
    step(decode)
    step(decode, finished_recving={"d1"}, failed_recving={"d1"})
    assert request.status == RequestStatus.FINISHED_ERROR
    assert not decode.requests and free_blocks(decode) == ALL_FREE


def test_push_mode_refuses_several_groups_at_startup_and_takes_one():
    # Push WRITEs one full-attention group's blocks: a hybrid model in push mode must not start
    # (its per-group block ids would be written as if they were one group's).
    from tests.vllm_scheduler.conftest import make_scheduler

    config = make_vllm_config("kv_consumer")
    config.kv_transfer_config.kv_connector_extra_config["mode"] = "push"
    with pytest.raises(ConfigError, match="push mode supports models with one full-attention KV-cache group"):
        make_scheduler(config, NUM_BLOCKS, sliding_window=WINDOW)
    config = make_vllm_config("kv_consumer")
    config.kv_transfer_config.kv_connector_extra_config["mode"] = "push"
    scheduler = make_scheduler(config, NUM_BLOCKS)
    try:
        assert scheduler.connector._scheduler.push is not None
    finally:
        scheduler.shutdown()
