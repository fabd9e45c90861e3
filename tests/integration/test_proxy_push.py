"""``kvx proxy --mode push`` against fake vLLM servers on real loopback sockets.

The fakes are ``tests/integration/test_proxy.py``'s: they record what they
receive, and a request's ``"test"`` field makes one role fail or hold its answer.
"""

from __future__ import annotations

import time

import pytest

from kvx.proxy._legs import PREFILL_KV_TRANSFER_PARAMS
from tests.integration.test_proxy import HOLD_MAX_S, fakes, make_proxy, upstreams  # noqa: F401 (fixtures)

KVX = {"agents": ["vllm-p0-tp0"], "epochs": ["0x1"], "digest": "d1", "lease_s": 120}


@pytest.fixture
def push_proxy(make_proxy, upstreams):  # noqa: F811 (fixtures)
    prefill, decode = upstreams.prefill[0], upstreams.decode[0]
    prefill.kv_params = dict(prefill.kv_params, kvx=KVX, pp_size=1)
    return make_proxy(mode="push", prefill_urls=(prefill.url,), decode_urls=(decode.url,))


def learn(proxy, upstreams) -> None:  # noqa: F811
    """The first request to a prefill instance runs in pull mode: the proxy learns its identity."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 3}
    assert proxy.post("/v1/completions", json=body).status_code == 200
    [pre] = upstreams.got("prefill")
    assert pre["body"]["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    upstreams.reset()


def test_both_legs_carry_one_push_id_and_decode_names_prefill(push_proxy, upstreams) -> None:  # noqa: F811
    learn(push_proxy, upstreams)
    body = {"model": "m", "prompt": "hello", "max_tokens": 20}
    response = push_proxy.post("/v1/completions", json=body, headers={"X-Request-Id": "req-1"})
    assert response.status_code == 200, response.text
    [pre], [dec] = upstreams.got("prefill"), upstreams.got("decode")
    push_id = pre["body"]["kv_transfer_params"]["kvx_push"]
    assert push_id.startswith("req-1-")
    assert pre["body"]["kv_transfer_params"] == dict(PREFILL_KV_TRANSFER_PARAMS, kvx_push=push_id)
    assert pre["body"]["max_tokens"] == 1
    params = dec["body"]["kv_transfer_params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_request_id"] == push_id and params["kvx"] == dict(KVX, push=push_id)
    prefill = upstreams.prefill[0]
    for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size"):
        assert params[key] == prefill.kv_params[key]
    assert dec["body"]["max_tokens"] == 20


def test_a_failed_prefill_leg_ends_decode_and_is_forgotten(push_proxy, upstreams) -> None:  # noqa: F811
    learn(push_proxy, upstreams)
    body = {"model": "m", "prompt": "x", "test": {"status": {"prefill": 500}, "hold": "decode"}}
    start = time.monotonic()
    response = push_proxy.post("/v1/completions", json=body)
    # Decode was cut off rather than waited for: its engine then releases the push.
    assert time.monotonic() - start < HOLD_MAX_S / 2
    assert response.status_code == 500 and response.headers["x-kvx-failed-leg"] == "prefill"
    upstreams.release()
    upstreams.reset()
    # Forgotten (a restarted engine has new epochs): the next request runs in pull mode again.
    learn(push_proxy, upstreams)


def test_a_failed_decode_leg_ends_prefill(push_proxy, upstreams) -> None:  # noqa: F811
    learn(push_proxy, upstreams)
    body = {"model": "m", "prompt": "x", "test": {"status": {"decode": 503}, "hold": "prefill"}}
    start = time.monotonic()
    response = push_proxy.post("/v1/completions", json=body)
    assert time.monotonic() - start < HOLD_MAX_S / 2
    assert response.status_code == 503 and response.headers["x-kvx-failed-leg"] == "decode"


def test_streamed_push_relays_decode(push_proxy, upstreams) -> None:  # noqa: F811
    learn(push_proxy, upstreams)
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    response = push_proxy.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.text.count("data: ") == 4 and response.text.endswith("data: [DONE]\n\n")
    [dec] = upstreams.got("decode")
    assert "push" in dec["body"]["kv_transfer_params"]["kvx"]
