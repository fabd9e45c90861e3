"""``kvx proxy --mode push`` against fake vLLM servers on real loopback sockets.

The fakes are ``tests/integration/test_proxy.py``'s: they record what they
receive, and a request's ``"test"`` field makes one role fail or hold its answer.
"""

from __future__ import annotations

import json
import re
import socket
import threading
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


class _KnownThenTrickling:
    """A prefill instance on a raw socket: its first answer is a pull-mode
    prefill's (the proxy learns it, as from vLLM); later ones send their
    headers a byte every 50 ms, for as long as the test lasts."""

    def __init__(self, kv_params: dict) -> None:
        self.kv_params = kv_params
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.answered = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while not self.stop.is_set():
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                found = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                length = int(found.group(1)) if found else 0
                while len(rest) < length:
                    rest += conn.recv(65536)
                buf = rest[length:]
                if self.answered:
                    conn.sendall(b"HTTP/1.1 200 OK\r\n")
                    while not self.stop.wait(0.05):  # never a second's silence
                        try:
                            conn.sendall(b"X")
                        except OSError:
                            return
                    return
                self.answered += 1
                body = json.dumps(
                    {
                        "id": "cmpl-raw",
                        "choices": [{"index": 0, "text": "!"}],
                        "kv_transfer_params": self.kv_params,
                    }
                ).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                    % len(body)
                    + body
                )

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_pushing_prefill_instance_trickling_its_headers_is_cut_off(make_proxy, upstreams) -> None:  # noqa: F811
    """Push mode sends its prefill leg itself: an instance sending that
    answer's headers a byte at a time held the client's request (the decode
    leg waits for it) and the instance's slot for as long as it went on."""
    decode = upstreams.decode[0]
    prefill = _KnownThenTrickling(dict(upstreams.prefill[0].kv_params, kvx=KVX, pp_size=1))
    try:
        proxy = make_proxy(
            mode="push",
            prefill_urls=(prefill.url,),
            decode_urls=(decode.url,),
            timeout_s=1.0,
            connect_timeout_s=0.5,
        )
        body = {"model": "m", "prompt": "hi", "max_tokens": 3}
        assert proxy.post("/v1/completions", json=body).status_code == 200  # learned, in pull mode
        started = time.monotonic()
        response = proxy.post("/v1/completions", json=body)
        assert time.monotonic() - started < 10
        assert response.status_code == 504 and response.headers["x-kvx-failed-leg"] == "prefill", (
            response.text
        )
        assert "did not send its answer's headers within 1.5 s" in response.json()["error"]["message"]
        healthz = proxy.get("/healthz").json()
        assert all(i["in_flight"] == 0 for i in healthz["prefill"]), healthz
    finally:
        prefill.close()
