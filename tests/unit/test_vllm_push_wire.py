"""KvxConnector push mode: what a peer sends is checked before anything is written.

The registration checks run on a ``PushWorker`` whose engine lookups are
stubbed: the end-to-end tests (``tests/e2e/test_vllm_push.py``) send the
same messages between real engines.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvx.connectors.kvcache import LayerGeometry, RankCache
from kvx.connectors.vllm.push import (
    MAX_PUSH_BLOCKS,
    PUSH_WIRE_VERSION,
    PushWorker,
    _Send,
    _wait_s,
    parse_push_note,
    push_id_of,
    push_note,
)
from kvx.errors import ConfigError, ProtocolError

DECODE_AGENT = "vllm-decode-tp0"


def test_a_push_note_round_trips() -> None:
    d = parse_push_note(push_note("push_reg", "p-1", blocks=[3, 4]))
    assert d == {"v": PUSH_WIRE_VERSION, "op": "push_reg", "push": "p-1", "blocks": [3, 4]}


@pytest.mark.parametrize("data", [b"not json", b"[]", json.dumps({"op": "done", "req": "r"}).encode()])
def test_other_notes_are_not_push_notes(data: bytes) -> None:
    assert parse_push_note(data) is None


@pytest.mark.parametrize(
    "note,match",
    [
        ({"v": PUSH_WIRE_VERSION + 1, "op": "pushed", "push": "p"}, "version"),
        ({"v": PUSH_WIRE_VERSION, "op": "pushed", "push": "a/b"}, "push id"),
        ({"v": PUSH_WIRE_VERSION, "op": "pushed", "push": "x" * 129}, "push id"),
        ({"v": PUSH_WIRE_VERSION, "op": "pushed", "push": 7}, "push id"),
    ],
)
def test_malformed_push_notes_are_refused(note: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_push_note(json.dumps(note).encode())


def test_push_ids_from_clients() -> None:
    assert push_id_of({"kvx": {"push": "abc-1"}}, decode=True) == "abc-1"
    assert push_id_of({"kvx_push": "abc-1"}, decode=False) == "abc-1"
    assert push_id_of({"kvx": {}}, decode=True) is None
    # Malformed: the request is treated as a pull one, the engine does not stop.
    assert push_id_of({"kvx_push": "../../etc"}, decode=False) is None
    assert push_id_of({"kvx_push": ["a"]}, decode=False) is None


def _cache(num_blocks: int, layers: int = 2) -> RankCache:
    return RankCache(
        tuple(LayerGeometry(0, i * 4096, 64, (0, 32), 32) for i in range(layers)), num_blocks, 1, 2
    )


def _worker(decode_blocks: int = 8, tp_size: int = 1, layers: int = 2) -> PushWorker:
    engine = SimpleNamespace(
        tp_size=tp_size, caches=[_cache(decode_blocks, layers)], peers={0: SimpleNamespace(name=DECODE_AGENT)}
    )
    w = SimpleNamespace(
        _lock=threading.Lock(),
        tp_rank=0,
        tp_size=1,
        cfg=SimpleNamespace(lease_s=10.0),
        _remote_engine=lambda params: engine,
    )
    return PushWorker(w, ["layer.0", "layer.1"], 16)  # type: ignore[arg-type]


def _registration(blocks: Any) -> dict[str, Any]:
    return {"blocks": blocks, "decode": {"remote_engine_id": "d", "kvx": {}}}


def test_a_good_registration_is_taken() -> None:
    engine, blocks = _worker()._check_registration(_Send("r", "p", 3), _registration([5, 6, 7]), DECODE_AGENT)
    assert blocks == [5, 6, 7] and engine.caches[0].num_blocks == 8


@pytest.mark.parametrize(
    "blocks,peer,match",
    [
        ([1, 2, 3], "vllm-other-tp0", "not by decode rank 0's agent"),  # someone else's registration
        ([1, 8], DECODE_AGENT, "outside decode's 8 blocks"),  # past the end of decode's cache
        ([-1], DECODE_AGENT, "outside"),
        ([True], DECODE_AGENT, "outside"),
        (["3"], DECODE_AGENT, "outside"),
        ([1, 1], DECODE_AGENT, "twice"),
        ([1, 2, 3, 4], DECODE_AGENT, "more blocks than the prompt's 3"),
        ("1,2", DECODE_AGENT, "more blocks"),
    ],
)
def test_bad_registrations_are_refused(blocks: Any, peer: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        _worker()._check_registration(_Send("r", "p", 3), _registration(blocks), peer)


def test_more_blocks_than_the_cap_are_refused_before_any_lookup() -> None:
    worker = _worker(decode_blocks=MAX_PUSH_BLOCKS * 2)
    s = _Send("r", "p", MAX_PUSH_BLOCKS * 2)
    with pytest.raises(ProtocolError, match="more blocks"):
        worker._check_registration(s, _registration(list(range(MAX_PUSH_BLOCKS + 1))), DECODE_AGENT)


def test_unequal_tensor_parallelism_or_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match="equal tensor parallelism"):
        _worker(tp_size=2)._check_registration(_Send("r", "p", 3), _registration([1]), DECODE_AGENT)
    with pytest.raises(ConfigError, match="layers"):
        _worker(layers=3)._check_registration(_Send("r", "p", 3), _registration([1]), DECODE_AGENT)


@pytest.mark.parametrize(
    "value,expected", [(5, 5.0), ("7", 7.0), (1e9, 120.0), (float("nan"), 120.0), (-1, 120.0), (None, 120.0)]
)
def test_decode_waits_at_most_its_own_lease(value: Any, expected: float) -> None:
    # The lease in kv_transfer_params comes from a client: it cannot make decode wait for ever.
    assert _wait_s(value, 120.0) == expected


def test_push_mode_refuses_pipeline_parallelism() -> None:
    from kvx.connectors.vllm.push import PushScheduler

    with pytest.raises(ConfigError, match="pipeline_parallel_size 1"):
        PushScheduler(SimpleNamespace(pp_size=2))  # type: ignore[arg-type]


def test_push_mode_refuses_anything_but_one_full_attention_group() -> None:
    from kvx.connectors.vllm.push import check_push_groups

    full = {"kind": "full", "block_size": 16, "num_layers": 2}
    sliding = {"kind": "sliding_window", "window": 128, "retained": 0, "block_size": 16, "num_layers": 1}
    check_push_groups([full])
    for groups in ([sliding, full], [full, full], [sliding]):
        with pytest.raises(ConfigError, match='one full-attention KV-cache group.*"mode": "pull"'):
            check_push_groups(groups)
