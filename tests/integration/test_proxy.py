"""``kvx proxy`` against fake vLLM servers, all on real loopback sockets.

Two fake prefill and two fake decode servers (FastAPI under uvicorn, each in
its own thread) record what they receive; the prefill ones answer with
distinctive ``kv_transfer_params`` and the decode ones echo what they got.
A request's ``"test"`` field steers them: an error status per role, holding
an answer until the test releases it, or breaking a stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gzip
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvx.errors import ConfigError
from kvx.metadata.client import MetadataClient
from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.proxy import ProxyConfig, build_app
from kvx.proxy._instances import InstancePool
from kvx.proxy._legs import PREFILL_KV_TRANSFER_PARAMS, content_encoding, prefill_body
from kvx.proxy._serve import uvicorn_config
from kvx.v1 import metadata_pb2
from tests.conftest import native_pass_only, wait_until

pytestmark = [pytest.mark.timeout(60), native_pass_only]

HTTP_TIMEOUT_S = 10.0
HOLD_MAX_S = 10.0  # a held fake answer goes on by itself after this


class Served:
    """An ASGI app under uvicorn on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, app: Any, proxy_config: ProxyConfig | None = None) -> None:
        """``proxy_config``: serve ``app`` with the settings ``kvx proxy`` uses for it."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if proxy_config is not None:
            config = uvicorn_config(app, proxy_config, log_level="warning", timeout_graceful_shutdown=2)
        else:
            config = uvicorn.Config(
                app,
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=2,
            )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="test-uvicorn", daemon=True
        )
        self.thread.start()
        assert wait_until(lambda: self.server.started or not self.thread.is_alive()) and self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        assert not self.thread.is_alive()


class FakeVllm:
    """Answers like a vLLM OpenAI server running a KV connector, and records each request."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.received: list[dict[str, Any]] = []
        self.gate = threading.Event()
        self.kv_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{name}",
            "remote_block_ids": [7, 8, 9],
            "remote_host": "10.1.2.3",
            "remote_port": 5600,
            "tp_size": 1,
        }
        app = FastAPI()
        app.post("/v1/completions")(self.complete)
        app.post("/v1/chat/completions")(self.complete)
        app.get("/v1/models")(self.models)
        self.served = Served(app)
        self.url = self.served.url

    async def models(self, request: Request) -> dict:
        self.received.append({"path": "/v1/models", "headers": dict(request.headers), "body": None})
        return {"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]}

    async def complete(self, request: Request) -> Any:
        body = await request.json()
        self.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        test = body.get("test", {})
        if test.get("hold") == self.role:
            await asyncio.to_thread(self.gate.wait, HOLD_MAX_S)
        status = test.get("status", {}).get(self.role)
        if status:
            return JSONResponse(
                {"error": {"message": f"{self.name} says no", "code": status}}, status_code=status
            )
        if test.get("gzip") == self.role:  # a gzip bomb: 16 KiB on the wire, 16 MiB decoded
            if body.get("stream"):

                async def bomb():
                    yield _bomb()

                return StreamingResponse(
                    bomb(), media_type="text/event-stream", headers={"content-encoding": "gzip"}
                )
            return Response(_bomb(), media_type="application/json", headers={"content-encoding": "gzip"})
        if test.get("huge") == self.role:  # an answer of this many bytes
            return JSONResponse({"pad": "x" * test["bytes"], "kv_transfer_params": self.kv_params})
        if test.get("trickle") == self.role:  # an answer a byte at a time, for 10 s

            async def trickle():
                for _ in range(200):  # a byte every 0.05 s: never a second's silence, even on a busy host
                    yield b" "
                    await asyncio.sleep(0.05)
                yield json.dumps({"kv_transfer_params": self.kv_params}).encode()

            return StreamingResponse(trickle(), media_type="application/json")
        if self.role == "prefill":
            answer = {"id": f"cmpl-{self.name}", "choices": [{"index": 0, "text": "!"}]}
            if not test.get("no_kv"):
                answer["kv_transfer_params"] = self.kv_params
            return answer
        if body.get("stream"):
            return StreamingResponse(self.events(body, test), media_type="text/event-stream")
        return {
            "id": f"cmpl-{self.name}",
            "served_by": self.name,
            "max_tokens": body.get("max_tokens"),
            "kv_transfer_params": body.get("kv_transfer_params"),
            "choices": [{"index": 0, "text": "ok"}],
        }

    async def events(self, body: dict, test: dict):
        for i in range(body.get("max_tokens", 3)):
            if i == test.get("break_after"):
                raise RuntimeError("the fake decode crashes mid-stream")
            if i == test.get("stall_after"):
                await asyncio.to_thread(self.gate.wait, HOLD_MAX_S)
            yield f"data: {json.dumps({'i': i, 'served_by': self.name})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def bodies(self) -> list[dict]:
        return [r["body"] for r in self.received]


@functools.cache
def _bomb() -> bytes:
    return gzip.compress(b" " * (16 * MiB), compresslevel=9)


class Upstreams:
    def __init__(self, fakes: dict[str, list[FakeVllm]]) -> None:
        self.prefill, self.decode = fakes["prefill"], fakes["decode"]
        self.all = self.prefill + self.decode

    def reset(self) -> None:
        for fake in self.all:
            fake.received.clear()
            fake.gate.clear()

    def release(self) -> None:
        for fake in self.all:
            fake.gate.set()

    def got(self, role: str) -> list[dict]:
        return [r for fake in getattr(self, role) for r in fake.received]


@pytest.fixture(scope="module")
def fakes():
    made = {"prefill": [], "decode": []}
    try:
        for role in made:
            for i in range(2):
                made[role].append(FakeVllm(f"{role[0]}{i}", role))
        yield made
    finally:
        for fake in made["prefill"] + made["decode"]:
            fake.gate.set()
            fake.served.server.should_exit = True
        for fake in made["prefill"] + made["decode"]:
            fake.served.stop()


@pytest.fixture
def upstreams(fakes):
    ups = Upstreams(fakes)
    ups.reset()
    yield ups
    ups.release()


@pytest.fixture
def make_proxy(upstreams):
    """make_proxy(**ProxyConfig fields) -> an httpx.Client on a running proxy (both fake pools by default)."""
    started: list[tuple[Served, httpx.Client]] = []

    def make(**fields: Any) -> httpx.Client:
        fields.setdefault("prefill_urls", tuple(f.url for f in upstreams.prefill))
        fields.setdefault("decode_urls", tuple(f.url for f in upstreams.decode))
        config = ProxyConfig(**fields)
        served = Served(build_app(config), config)
        client = httpx.Client(base_url=served.url, timeout=HTTP_TIMEOUT_S)
        started.append((served, client))
        return client

    yield make
    upstreams.release()  # held answers finish, so the proxies stop at once
    for served, client in started:
        client.close()
        served.stop()


@pytest.fixture
def proxy(make_proxy):
    return make_proxy()


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# -- the two legs ----------------------------------------------------------------


def test_completion_is_prefilled_then_decoded_with_the_prefill_kv_params(proxy, upstreams):
    body = {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0.5}
    response = proxy.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-abc"})
    assert response.status_code == 200, response.text
    [pre], [dec] = upstreams.got("prefill"), upstreams.got("decode")
    assert pre["path"] == dec["path"] == "/v1/completions"
    assert pre["body"] == {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    served_prefill = next(f for f in upstreams.prefill if f.received)
    assert dec["body"] == {**body, "kv_transfer_params": served_prefill.kv_params}
    answer = response.json()
    assert answer["kv_transfer_params"] == served_prefill.kv_params and answer["max_tokens"] == 20
    request_id = response.headers["x-request-id"]
    assert (
        len(request_id) == 32
        and pre["headers"]["x-request-id"] == dec["headers"]["x-request-id"] == request_id
    )
    assert pre["headers"]["authorization"] == dec["headers"]["authorization"] == "Bearer sk-abc"

    response = proxy.post("/v1/completions", json=body, headers={"X-Request-Id": "client-id-1"})
    assert response.headers["x-request-id"] == "client-id-1"
    assert [
        r["headers"]["x-request-id"] for r in upstreams.got("prefill")[1:] + upstreams.got("decode")[1:]
    ] == ["client-id-1"] * 2
    assert "authorization" not in upstreams.got("decode")[1]["headers"]


def test_streaming_relays_the_decode_events_in_order(proxy, upstreams):
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with proxy.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = sse_data(text)
    assert events[-1] == "[DONE]" and [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    [pre], [dec] = upstreams.got("prefill"), upstreams.got("decode")
    assert (
        pre["body"]["stream"] is False
        and "stream_options" not in pre["body"]
        and pre["body"]["max_tokens"] == 1
    )
    assert dec["body"]["stream"] is True and dec["body"]["stream_options"] == {"include_usage": True}
    assert dec["body"]["kv_transfer_params"]["remote_engine_id"].startswith("engine-p")


def test_chat_completions_limit_both_token_counts_on_prefill(proxy, upstreams):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    response = proxy.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [pre], [dec] = upstreams.got("prefill"), upstreams.got("decode")
    assert pre["path"] == dec["path"] == "/v1/chat/completions"
    assert pre["body"]["max_completion_tokens"] == 1 and pre["body"]["max_tokens"] == 1
    assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert dec["body"]["max_completion_tokens"] == 50 and "max_tokens" not in dec["body"]


def test_models_and_health(proxy, upstreams):
    response = proxy.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and response.json()["data"][0]["owned_by"] in ("d0", "d1")
    [got] = upstreams.got("decode")
    assert got["headers"]["authorization"] == "Bearer k" and not upstreams.got("prefill")
    for path in ("/healthz", "/health"):
        health = proxy.get(path)
        assert health.status_code == 200
        data = health.json()
        assert data["status"] == "ok" and data["metadata"] is None
        assert [i["url"] for i in data["prefill"]] == [f.url for f in upstreams.prefill]
        assert [i["in_flight"] for i in data["decode"]] == [0, 0]


def test_the_least_loaded_instance_gets_the_next_request(proxy, upstreams):
    held = {"model": "m", "prompt": "slow", "max_tokens": 4, "test": {"hold": "decode"}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(proxy.post, "/v1/completions", json=held)
        assert wait_until(lambda: len(upstreams.got("decode")) == 1)
        busy = next(f for f in upstreams.decode if f.received)
        idle = next(f for f in upstreams.decode if f is not busy)
        decode_health = {i["url"]: i["in_flight"] for i in proxy.get("/healthz").json()["decode"]}
        assert decode_health == {busy.url: 1, idle.url: 0}
        # Round robin would send one of these two to the busy instance.
        for _ in range(2):
            response = proxy.post("/v1/completions", json={"model": "m", "prompt": "fast"})
            assert response.status_code == 200 and response.json()["served_by"] == idle.name
        assert len(busy.received) == 1
        upstreams.release()
        assert slow.result(HTTP_TIMEOUT_S).json()["served_by"] == busy.name
    assert all(f.received for f in upstreams.prefill), "idle prefill instances take turns"


# -- errors -----------------------------------------------------------------------


def test_an_instance_error_comes_back_with_its_status_body_and_leg(proxy, upstreams):
    response = proxy.post("/v1/completions", json={"prompt": "x", "test": {"status": {"prefill": 400}}})
    assert response.status_code == 400 and response.headers["x-kvx-failed-leg"] == "prefill"
    assert response.json()["error"]["message"].endswith("says no") and response.headers["x-request-id"]
    assert not upstreams.got("decode")
    for stream in (False, True):
        response = proxy.post(
            "/v1/completions", json={"prompt": "x", "stream": stream, "test": {"status": {"decode": 429}}}
        )
        assert response.status_code == 429 and response.headers["x-kvx-failed-leg"] == "decode"
        assert response.json()["error"]["code"] == 429
    response = proxy.post("/v1/completions", json={"prompt": "x", "test": {"no_kv": True}})
    assert (
        response.status_code == 502
        and "returned no kv_transfer_params" in response.json()["error"]["message"]
    )
    assert response.json()["error"]["leg"] == "prefill" and len(upstreams.got("decode")) == 2


def test_bad_request_bodies_are_400(proxy, upstreams):
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = proxy.post(
            "/v1/completions", content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert not upstreams.got("prefill")


# -- hostile clients ----------------------------------------------------------------

MiB = 1024 * 1024


def raw_connect(client: httpx.Client) -> socket.socket:
    """A plain socket to the proxy behind ``client``, for requests httpx would not send."""
    return socket.create_connection((client.base_url.host, client.base_url.port), timeout=HTTP_TIMEOUT_S)


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or HTTP_TIMEOUT_S passes)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def post_head(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def nested(depth: int) -> dict:
    """An object whose arrays and objects nest ``depth`` levels, the object itself included."""
    inner: Any = []
    for _ in range(depth - 2):
        inner = [inner]
    return {"prompt": "x", "deep": inner}


def test_deep_json_is_400_with_the_limit_not_a_crash(proxy, upstreams):
    flood = b'{"prompt": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for content in (flood, json.dumps(nested(65)).encode()):
        response = proxy.post("/v1/completions", content=content)
        assert response.status_code == 400, response.text
        assert "deeper than 64 levels" in response.json()["error"]["message"]
    # A string left open, full of escaped quotes: refused at once, not scanned for hours.
    unclosed = b'{"prompt": "' + b'\\"' * (2 * MiB)
    response = proxy.post("/v1/completions", content=unclosed)
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.json()["error"]["message"]
    assert not upstreams.got("prefill")
    # At the limit, and brackets inside strings, which do not nest anything.
    for body in (nested(64), {"prompt": "[{" * 50_000}):
        assert proxy.post("/v1/completions", json=body).status_code == 200
    assert len(upstreams.got("prefill")) == 2


def test_a_body_over_the_limit_is_413_before_it_is_read(make_proxy, upstreams):
    proxy = make_proxy()  # the default limit, 8 MiB
    # 60 MiB announced: refused on the headers, while /healthz answers as usual.
    with raw_connect(proxy) as sock:
        sock.sendall(post_head(60 * MiB) + b'{"prompt": "')
        assert proxy.get("/healthz").status_code == 200
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"over 8388608 bytes" in answer, answer[:300]

    # Chunked, so no length to refuse up front: cut off once 1 MiB has come, and the
    # connection closed, so the client cannot go on to send its 64 MiB.
    small = make_proxy(max_body_bytes=1 * MiB)
    sent = [0]

    def send_chunks(sock: socket.socket) -> None:
        chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
        with contextlib.suppress(OSError):
            while sent[0] < 64 * MiB:
                sock.sendall(chunk)
                sent[0] += 64 * 1024

    with raw_connect(small) as sock, concurrent.futures.ThreadPoolExecutor(1) as pool:
        sock.sendall(post_head(None) + b"1\r\n{\r\n")
        sender = pool.submit(send_chunks, sock)
        answer = read_answer(sock)
        with contextlib.suppress(OSError):  # the sender stops if the proxy has not reset it yet
            sock.shutdown(socket.SHUT_RDWR)
        sender.result(HTTP_TIMEOUT_S)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"over 1048576 bytes" in answer, answer[:300]
    assert sent[0] < 32 * MiB, f"the proxy read on: the client sent {sent[0]} bytes"
    assert not upstreams.got("prefill")
    assert small.get("/healthz").status_code == 200


def test_slow_clients_are_cut_off_and_do_not_stall_health(make_proxy, upstreams):
    """A slowloris client (headers a line at a time) and one that trickles its body,
    while /healthz is polled: health answers at once throughout; the slowloris is
    closed after header_timeout_s, the trickler gets 408 after body_timeout_s."""
    proxy = make_proxy(header_timeout_s=1.0, body_timeout_s=1.0)
    clients = {"headers": raw_connect(proxy), "body": raw_connect(proxy)}
    clients["headers"].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\n")
    clients["body"].sendall(post_head(100_000) + b"{")
    trickle = {"headers": b"X-Slow: 1\r\n", "body": b" "}
    ended: dict[str, tuple[float, bytes]] = {}
    health_s: list[float] = []
    started = time.monotonic()
    try:
        while len(ended) < 2 and time.monotonic() - started < 20:
            for name, sock in clients.items():
                if name in ended:
                    continue
                try:
                    sock.sendall(trickle[name])
                    answer = sock.recv(65536) if select.select([sock], [], [], 0)[0] else None
                except OSError:
                    answer = b""
                if answer is not None:
                    ended[name] = (time.monotonic() - started, answer)
            before = time.monotonic()
            assert proxy.get("/healthz").status_code == 200
            health_s.append(time.monotonic() - before)
            time.sleep(0.2)
    finally:
        for sock in clients.values():
            sock.close()
    assert set(ended) == {"headers", "body"}, f"not cut off within 20 s: {set(clients) - set(ended)}"
    after_s, answer = ended["headers"]
    assert answer == b"" and after_s < 10, (after_s, answer[:200])  # closed, no answer
    after_s, answer = ended["body"]
    assert answer.startswith(b"HTTP/1.1 408 ") and after_s < 10, (after_s, answer[:200])
    assert len(health_s) >= 3 and max(health_s) < 5, health_s
    assert not upstreams.got("prefill")


def test_a_decode_instance_that_is_down_is_502_and_skipped_while_another_is_up(make_proxy, upstreams):
    alone = make_proxy(decode_urls=(dead_url(),))
    response = alone.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 502 and response.headers["x-kvx-failed-leg"] == "decode"
    error = response.json()["error"]
    assert (
        error["type"] == "upstream_unavailable"
        and error["leg"] == "decode"
        and "unavailable" in error["message"]
    )

    dead, live = dead_url(), upstreams.decode[0]
    both = make_proxy(decode_urls=(dead, live.url))
    for _ in range(3):
        response = both.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 200 and response.json()["served_by"] == live.name
    decode = {i["url"]: i for i in both.get("/healthz").json()["decode"]}
    assert decode[dead]["cooling_down"] and decode[dead]["failures"] == 1  # tried once, then skipped


def test_a_slow_instance_is_504(make_proxy, upstreams):
    proxy = make_proxy(timeout_s=0.3)
    started = time.monotonic()
    response = proxy.post("/v1/completions", json={"prompt": "x", "test": {"hold": "prefill"}})
    assert response.status_code == 504 and time.monotonic() - started < 5
    assert (
        response.json()["error"]["type"] == "upstream_timeout"
        and response.headers["x-kvx-failed-leg"] == "prefill"
    )


def test_a_stream_that_breaks_or_stalls_ends_with_an_error_event(make_proxy, upstreams):
    proxy = make_proxy(timeout_s=0.5)
    for test, kind in (
        ({"break_after": 2}, "upstream_unavailable"),
        ({"stall_after": 2}, "upstream_timeout"),
    ):
        body = {"prompt": "x", "max_tokens": 5, "stream": True, "test": test}
        with proxy.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = sse_data(response.read().decode())
        assert [json.loads(e).get("i") for e in events[:2]] == [0, 1] and len(events) == 3
        error = json.loads(events[2])["error"]
        assert error["type"] == kind and error["leg"] == "decode"
    upstreams.release()
    assert wait_until(lambda: all(i["in_flight"] == 0 for i in proxy.get("/healthz").json()["decode"]))


def test_a_client_that_leaves_mid_stream_frees_the_decode_instance(proxy, upstreams):
    body = {"prompt": "x", "max_tokens": 5, "stream": True, "test": {"stall_after": 1}}
    with proxy.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # held: a dropped iterator would close the response
        assert json.loads(next(lines)[len("data: ") :])["i"] == 0
        assert sum(i["in_flight"] for i in proxy.get("/healthz").json()["decode"]) == 1
    assert wait_until(lambda: sum(i["in_flight"] for i in proxy.get("/healthz").json()["decode"]) == 0, 5)


def test_a_client_that_stops_reading_is_cut_off_and_frees_the_decode_instance(make_proxy, upstreams, caplog):
    """A client that asks for a long stream and never reads it: once its
    socket's buffers are full, uvicorn waited for it without end, and the
    decode instance stayed busy (and a pooled upstream connection taken)
    for as long. Now each piece of an answer must reach the client within
    send_timeout_s (1 s here): then its connection is closed and the
    instance released, while health answers throughout."""
    proxy = make_proxy(send_timeout_s=1.0)
    body = json.dumps({"prompt": "x", "max_tokens": 100_000, "stream": True}).encode()
    sock = raw_connect(proxy)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(post_head(len(body)) + body)
        assert wait_until(lambda: sum(i["in_flight"] for i in proxy.get("/healthz").json()["decode"]) == 1, 5)
        with caplog.at_level(logging.WARNING, logger="kvx._http"):
            assert wait_until(
                lambda: sum(i["in_flight"] for i in proxy.get("/healthz").json()["decode"]) == 0, 15
            ), "the decode instance is still held for a client that reads nothing"
        assert any("took under 65536 bytes of its answer in 1.0 s" in r.getMessage() for r in caplog.records)
        sock.settimeout(HTTP_TIMEOUT_S)
        with pytest.raises(ConnectionResetError):  # aborted: what the proxy had buffered is dropped
            while sock.recv(1 << 20):
                pass
        assert proxy.get("/healthz").status_code == 200
    finally:
        sock.close()


def test_an_instance_answer_is_bounded_in_bytes_and_in_time(make_proxy, upstreams):
    """An answer that is not a stream (a prefill's) was read whole whatever its
    size, and an instance sending it a byte at a time was never cut off (the
    timeout runs between bytes). Now it is read within timeout_s in all and
    up to max_answer_bytes (1 s and 1 MiB here): 504 and 502 past them."""
    proxy = make_proxy(timeout_s=1.0, max_answer_bytes=1 * MiB)
    huge = {"prompt": "x", "test": {"huge": "prefill", "bytes": 2 * MiB}}
    response = proxy.post("/v1/completions", json=huge)
    assert response.status_code == 502, response.text
    assert "answered more than 1048576 bytes" in response.json()["error"]["message"]
    fits = {"prompt": "x", "test": {"huge": "prefill", "bytes": MiB // 2}}
    assert proxy.post("/v1/completions", json=fits).status_code == 200
    started = time.monotonic()
    response = proxy.post("/v1/completions", json={"prompt": "x", "test": {"trickle": "prefill"}})
    assert response.status_code == 504 and time.monotonic() - started < 5, response.text
    assert "did not finish its answer within 1.0 s" in response.json()["error"]["message"]
    assert wait_until(lambda: all(i["in_flight"] == 0 for i in proxy.get("/healthz").json()["prefill"]))


def test_a_compressed_answer_is_refused_not_decoded(make_proxy, upstreams):
    """The attack: an instance answers in gzip, a bomb of 16 KiB that decodes to 16 MiB.
    httpx decoded each read whole before the byte bound was looked at (and a stream was
    relayed decoded, unbounded). The proxy asks for identity, reads answers raw, and
    refuses an encoded one with 502, on either leg and as a stream."""
    proxy = make_proxy(max_answer_bytes=1 * MiB)
    for role, stream in (("prefill", False), ("decode", False), ("decode", True)):
        response = proxy.post(
            "/v1/completions", json={"prompt": "x", "stream": stream, "test": {"gzip": role}}
        )
        assert response.status_code == 502, (role, stream, response.text[:200])
        assert "Content-Encoding 'gzip' though asked for identity" in response.json()["error"]["message"]
    asked = {r["headers"].get("accept-encoding") for r in upstreams.got("prefill") + upstreams.got("decode")}
    assert asked == {"identity"}, asked
    assert proxy.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert wait_until(lambda: all(i["in_flight"] == 0 for i in proxy.get("/healthz").json()["decode"]))


def test_content_encodings_besides_identity_are_named():
    def named(*values: str) -> str:
        return content_encoding(httpx.Response(200, headers=[("content-encoding", v) for v in values]))

    assert named() == named("") == named("identity") == named("Identity, identity ") == ""
    assert named("identity, gzip") == named("identity", " GZIP") == "gzip"
    assert named("br") == "br" and named("gzip, br") == "gzip, br"


def test_an_instance_trickling_its_headers_is_cut_off(make_proxy, upstreams):
    """httpx's timeout runs between reads: an instance sending its headers a
    byte at a time held the request (and its slot on that instance) for as
    long as it kept going. The headers must be in within connect_timeout_s +
    timeout_s of sending (push mode's own prefill leg: test_proxy_push.py)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(0.2)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.is_set():  # a header byte every 0.05 s: never a second's silence
                try:
                    conn.sendall(b"X")
                except OSError:
                    return
                stop.wait(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        proxy = make_proxy(
            prefill_urls=(f"http://127.0.0.1:{listener.getsockname()[1]}",),
            timeout_s=1.0,
            connect_timeout_s=0.5,
        )
        started = time.monotonic()
        response = proxy.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 504 and time.monotonic() - started < 10, response.text
        assert "did not send its answer's headers within 1.5 s" in response.json()["error"]["message"]
        assert wait_until(lambda: all(i["in_flight"] == 0 for i in proxy.get("/healthz").json()["prefill"]))
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def test_without_a_decode_instance_health_is_503_and_nothing_is_prefilled(make_proxy, upstreams):
    proxy = make_proxy(decode_urls=())
    health = proxy.get("/healthz")
    assert health.status_code == 503 and health.json()["reason"] == "no decode instance"
    response = proxy.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "no_instance"
    assert not upstreams.got("prefill")


# -- discovery --------------------------------------------------------------------


def _agent(name: str, role: int, api_url: str | None) -> metadata_pb2.AgentRecord:
    record = metadata_pb2.AgentRecord(name=name, epoch=7, role=role, started_unix_ms=int(time.time() * 1000))
    record.metadata.name, record.metadata.epoch = name, 7
    if api_url is not None:
        record.engine_info["api_url"] = api_url
    return record


def test_instances_are_discovered_from_the_metadata_service(make_proxy, upstreams):
    p0, p1 = upstreams.prefill
    d0, d1 = upstreams.decode
    service = ThreadedServer(MetadataServer("127.0.0.1:0"), start_timeout_s=20)
    try:
        client = MetadataClient(service.address)
        leases = {}
        for record in (
            _agent("p-rank0", metadata_pb2.ROLE_PREFILL, p0.url),
            _agent("p-rank1", metadata_pb2.ROLE_PREFILL, p0.url + "/"),  # one engine, two ranks
            _agent("p-worker", metadata_pb2.ROLE_PREFILL, None),
            _agent("p-bad", metadata_pb2.ROLE_PREFILL, "not a url"),
            _agent("d-rank0", metadata_pb2.ROLE_DECODE, d1.url),
        ):
            leases[record.name] = client.register(record, ttl_s=60).lease_id
        proxy = make_proxy(
            prefill_urls=(), decode_urls=(d0.url,), metadata_target=service.address, refresh_s=0.1
        )
        health = proxy.get("/healthz").json()  # the first refresh happens before serving
        assert [(i["url"], i["source"]) for i in health["prefill"]] == [(p0.url, "metadata")]
        assert [(i["url"], i["source"]) for i in health["decode"]] == [
            (d0.url, "static"),
            (d1.url, "metadata"),
        ]
        assert health["metadata"]["ok"] and health["metadata"]["target"] == service.address
        assert proxy.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert len(p0.received) == 1

        client.unregister("p-rank0", lease_id=leases["p-rank0"])  # only the registrant unregisters
        client.unregister("p-rank1", lease_id=leases["p-rank1"])
        client.register(_agent("p1-rank0", metadata_pb2.ROLE_PREFILL, p1.url), ttl_s=60)
        assert wait_until(lambda: [i["url"] for i in proxy.get("/healthz").json()["prefill"]] == [p1.url])
        client.close()
    finally:
        service.stop()
    # While the service is gone, the last known instances stay in use.
    assert wait_until(lambda: not proxy.get("/healthz").json()["metadata"]["ok"])
    assert proxy.post("/v1/completions", json={"prompt": "x"}).status_code == 200 and len(p1.received) == 1


def test_an_instance_marked_draining_gets_no_new_requests(make_proxy, upstreams):
    """A daemon that drains publishes draining=1; the proxy stops routing there, even
    when another record (one of the engine's ranks) still names the same URL."""
    p0, p1 = upstreams.prefill
    (d0,) = upstreams.decode[:1]
    service = ThreadedServer(MetadataServer("127.0.0.1:0"), start_timeout_s=20)
    try:
        client = MetadataClient(service.address)
        daemon = _agent("p0-daemon", metadata_pb2.ROLE_PREFILL, p0.url)
        lease = client.register(daemon, ttl_s=60).lease_id
        client.register(_agent("p0-rank0", metadata_pb2.ROLE_PREFILL, p0.url), ttl_s=60)
        client.register(_agent("p1-daemon", metadata_pb2.ROLE_PREFILL, p1.url), ttl_s=60)
        sglang = _agent("sglang-daemon", metadata_pb2.ROLE_PREFILL, "http://127.0.0.1:1")
        sglang.engine_info["engine"] = "sglang"  # speaks SGLang's protocol, not this proxy's
        client.register(sglang, ttl_s=60)
        proxy = make_proxy(
            prefill_urls=(), decode_urls=(d0.url,), metadata_target=service.address, refresh_s=0.1
        )
        urls = lambda: sorted(i["url"] for i in proxy.get("/healthz").json()["prefill"])  # noqa: E731
        assert urls() == sorted([p0.url, p1.url])
        daemon.engine_info["draining"] = "1"
        client.register(daemon, ttl_s=60, lease_id=lease)
        assert wait_until(lambda: urls() == [p1.url])
        for _ in range(4):
            assert proxy.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert len(p1.received) == 4 and not p0.received
        client.close()
    finally:
        service.stop()


# -- pieces and the command -------------------------------------------------------


def test_config_and_prefill_body():
    config = ProxyConfig(prefill_urls=["http://h:1/", "http://h:1"], decode_urls=("https://d:2",))
    assert config.prefill_urls == ("http://h:1",) and config.decode_urls == ("https://d:2",)
    for bad in (
        {"prefill_urls": ("h:1",)},
        {"decode_urls": "http://d:2"},
        {"timeout_s": 0},
        {"listen": "8000"},
        {"prefill_urls": ("http://h:port",)},
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
        {"send_timeout_s": 0},
        {"max_body_bytes": 0},
        {"max_json_depth": 0},
    ):
        with pytest.raises(ConfigError):
            ProxyConfig(**bad)
    body = {
        "prompt": "p",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"stale": 1},
    }
    out = prefill_body(body)
    assert out == {
        "prompt": "p",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    assert body["max_tokens"] == 9 and "stream_options" in body  # the client's body is left alone


def test_pool_ties_go_round_robin_and_cooling_instances_only_when_nothing_else():
    pool = InstancePool("decode", ["http://a:1", "http://b:1", "http://c:1"], cooldown_s=60)
    picks = [pool.acquire() for _ in range(3)]
    assert [i.url for i in picks] == ["http://a:1", "http://b:1", "http://c:1"]
    pool.release(picks[1])
    assert pool.acquire().url == "http://b:1"  # the only one with nothing in flight
    for instance in pool.instances():
        pool.release(instance)
    a, b, c = pool.instances()
    pool.cool_down(a)
    pool.cool_down(b)
    assert {pool.acquire().url for _ in range(3)} == {"http://c:1"}
    pool.cool_down(c)
    assert pool.acquire() is not None  # all cooling down: still try one
    assert (
        pool.set_discovered(["http://d:1", "http://a:1"])
        and [i.source for i in pool.instances()][-1] == "metadata"
    )
    assert not pool.set_discovered(["http://d:1"])


def test_missing_httpx_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ConfigError, match=r"pip install kvx\[proxy\]"):
        build_app(ProxyConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",)))


def test_the_command_serves_and_stops_on_sigint(upstreams):
    lines: queue.Queue[str] = queue.Queue()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvx.cli",
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--prefill",
            upstreams.prefill[0].url,
            "--decode",
            upstreams.decode[0].url,
            "--max-body-size",
            "4KiB",
            "--header-timeout-s",
            "5",
            "--body-timeout-s",
            "5",
        ],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        deadline, url = time.monotonic() + 30, None
        while url is None and time.monotonic() < deadline:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if "kvx proxy on http://" in line:
                url = line.rsplit(" ", 1)[-1].strip()
        assert url, "the proxy did not say where it listens"
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
            assert wait_until(lambda: client.get("/healthz").status_code == 200, tolerate=(httpx.HTTPError,))
            assert client.post("/v1/completions", json={"prompt": "x"}).json()["served_by"] == "d0"
            too_large = client.post("/v1/completions", json={"prompt": "x" * 5000})
            assert too_large.status_code == 413 and "over 4096 bytes" in too_large.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    result = subprocess.run(
        [sys.executable, "-m", "kvx.cli", "proxy", "--prefill", "http://p:1"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1 and "--decode URL" in result.stderr
