"""The proxy's HTTP app: each completion is a prefill leg, then a decode leg.

The prefill leg computes the prompt's KV cache and keeps it for a remote
decode (``max_tokens=1``, ``do_remote_decode``); its answer carries the
``kv_transfer_params`` that tell the decode instance where to pull the KV
cache from. The decode leg gets the client's request unchanged but for those
parameters, and its answer (JSON or a server-sent event stream) goes back to
the client as it comes. With ``mode="push"`` both legs go out at once
(``kvx.proxy._push``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from kvx._version import __version__
from kvx.errors import ConfigError, ProtocolError
from kvx.proxy._body import parse_object
from kvx.proxy._config import ProxyConfig
from kvx.proxy._instances import Discovery, Instance, InstancePool
from kvx.proxy._kv_routing import Choice, DecodeUsage, KvRouting, prompt_tokens, tokenize_request
from kvx.proxy._legs import (
    FAILED_LEG_HEADER,
    _dumps,
    _LegFailed,
    _passthrough,
    content_encoding,
    prefill_body,
)
from kvx.proxy._metrics import ProxyMetrics
from kvx.proxy._push import PushFlow

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_CONNECT_ATTEMPTS = 3  # instances tried for one leg while they cannot be reached
CLOSE_TIMEOUT_S = 5.0  # closing an upstream stream
# An instance's JSON answer up to this size is parsed on the event loop; larger, on a thread.
_PARSE_INLINE_BYTES = 64 * 1024


def require_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ConfigError("kvx proxy needs httpx: pip install kvx[proxy]") from exc
    return httpx


def error_body(message: str, kind: str, leg: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind}
    if leg is not None:
        error["leg"] = leg
    return {"error": error}


async def _parse_json(raw: bytes) -> Any:
    """An instance's JSON answer; a large one parsed off the event loop, as request bodies are."""
    if len(raw) < _PARSE_INLINE_BYTES:
        return json.loads(raw)
    return await anyio.to_thread.run_sync(json.loads, raw)


def _check_identity(response: Any, leg: str, url: str) -> None:
    """_LegFailed (502) for an answer with a content encoding: the proxy asks for none
    (Accept-Encoding: identity), and reads answers raw, bounded in bytes."""
    encoding = content_encoding(response)
    if encoding:
        raise _LegFailed(
            _error(
                502,
                f"the {leg} instance {url} answered with Content-Encoding {encoding[:40]!r} though "
                "asked for identity",
                "bad_upstream_response",
                leg,
            )
        )


async def _raw_bytes(response: Any, leg: str, url: str) -> AsyncIterator[bytes]:
    """An answer's body as it came (de-chunked, never decoded): as many bytes in
    memory as were read, which a compressed answer's decoding would not bound."""
    _check_identity(response, leg, url)
    async for chunk in response.aiter_raw():
        yield chunk


def _error(status: int, message: str, kind: str, leg: str | None = None, close: bool = False) -> JSONResponse:
    headers = {FAILED_LEG_HEADER: leg} if leg is not None else {}
    if close:  # the server then closes the connection instead of reading what the client still sends
        headers["Connection"] = "close"
    return JSONResponse(error_body(message, kind, leg), status_code=status, headers=headers)


def _too_large(limit: int) -> JSONResponse:
    return _error(
        413,
        f"request body over {limit} bytes; send less, or raise max_body_bytes (--max-body-size)",
        "invalid_request_error",
        close=True,
    )


class _Stream(StreamingResponse):
    """A relayed stream; ``on_close`` runs however it ends: done, failed, or the client gone."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class _Router:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.httpx = require_httpx()
        self.pools = {
            role: InstancePool(role, urls, config.cooldown_s)
            for role, urls in (("prefill", config.prefill_urls), ("decode", config.decode_urls))
        }
        self.discovery = (
            Discovery(config.metadata_target, config.metadata_options, self.pools, config.refresh_s)
            if config.metadata_target
            else None
        )
        self.metrics = ProxyMetrics()
        self.kv = (
            KvRouting(
                dict(config.prefill_kv_events),
                self.metrics,
                config.kv_alpha,
                config.kv_max_blocks,
                config.kv_max_message_bytes,
            )
            if config.prefill_kv_events
            else None
        )
        self.client: Any = None
        self.push = PushFlow(self) if config.mode == "push" else None
        self._usage_task: asyncio.Task | None = None

    async def start(self) -> None:
        httpx = self.httpx
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=self.config.max_connections,
                max_keepalive_connections=self.config.max_connections,
            ),
            # The instances are cluster-local: an HTTP(S)_PROXY meant for the internet must not apply.
            trust_env=False,
            # Answers are read raw and bounded in bytes: a compressed one (a gzip bomb turns 64
            # KiB read into 64 MiB decoded) is refused, not decoded (_raw_bytes).
            headers={"Accept-Encoding": "identity"},
        )
        if self.discovery is not None:
            await self.discovery.start()
        if self.kv is not None:
            self.kv.start()
        if self.config.decode_kv_usage:
            usage = DecodeUsage(
                self.pools, self.client, httpx, self.config.refresh_s, self.config.kv_tokenize_timeout_s
            )
            self._usage_task = asyncio.create_task(usage.run(), name="kvx-proxy-decode-usage")
        logger.info(
            "kvx proxy: prefill %s; decode %s%s",
            ", ".join(i.url for i in self.pools["prefill"].instances()) or "none yet",
            ", ".join(i.url for i in self.pools["decode"].instances()) or "none yet",
            f"; discovering more at {self.config.metadata_target}" if self.discovery else "",
        )

    async def stop(self) -> None:
        if self._usage_task is not None:
            self._usage_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._usage_task
        if self.kv is not None:
            await anyio.to_thread.run_sync(self.kv.stop)
        if self.discovery is not None:
            await self.discovery.stop()
        if self.client is not None:
            await self.client.aclose()

    # -- the legs ---------------------------------------------------------

    def _transport_error(self, exc: Exception, leg: str, url: str) -> JSONResponse:
        name = type(exc).__name__
        if isinstance(exc, self.httpx.TimeoutException):
            limit_s = (
                self.config.connect_timeout_s
                if isinstance(exc, self.httpx.ConnectTimeout)
                else self.config.timeout_s
            )
            return _error(
                504,
                f"the {leg} instance {url} did not answer within {limit_s} s ({name}); "
                "if it is only busy, raise --timeout-s",
                "upstream_timeout",
                leg,
            )
        return _error(
            502,
            f"the {leg} instance {url} is unavailable ({name}: {str(exc) or 'connection failed'})",
            "upstream_unavailable",
            leg,
        )

    async def send(
        self,
        leg: str,
        method: str,
        path: str,
        headers: dict[str, str],
        request_id: str,
        content: bytes | None = None,
        stream: bool = False,
        prompt: list[int] | None = None,
        first: tuple[Instance, Choice | None] | None = None,
    ) -> tuple[Instance, Any, int]:
        """Send to the least loaded instance of ``leg`` (for prefill with a
        ``prompt`` and KV events: the one with the best score, see
        ``_kv_routing``), moving on to another while one cannot be reached. The
        instance comes back acquired, with the queued tokens to release it with.
        ``first``: an instance already acquired (with its choice) to try first."""
        pool = self.pools[leg]
        tried: list[Instance] = []
        failure: JSONResponse | None = None
        while len(tried) < MAX_CONNECT_ATTEMPTS:
            instance: Instance | None
            if first is not None:
                (instance, choice), first = first, None
            else:
                instance, choice = self.acquire(leg, prompt, tried)
            if instance is None:
                break
            queued = choice.queued_tokens if choice else 0
            request = self.client.build_request(method, instance.url + path, headers=headers, content=content)
            try:
                response = await self.send_request(request, leg, instance.url)
                if not stream:
                    response = await self.whole(response, leg, instance.url)
            except (self.httpx.ConnectError, self.httpx.ConnectTimeout) as exc:
                # Nothing reached the instance, so another one may take the request.
                pool.release(instance, queued)
                pool.cool_down(instance)
                tried.append(instance)
                failure = self._transport_error(exc, leg, instance.url)
                logger.warning(
                    "request %s: cannot reach %s instance %s (%s); skipping it for %s s",
                    request_id,
                    leg,
                    instance.url,
                    exc,
                    pool.cooldown_s,
                )
                continue
            except self.httpx.RequestError as exc:
                pool.release(instance, queued)
                if not isinstance(exc, self.httpx.TimeoutException):
                    pool.cool_down(instance)
                logger.warning("request %s: %s instance %s failed: %r", request_id, leg, instance.url, exc)
                raise _LegFailed(self._transport_error(exc, leg, instance.url)) from None
            except BaseException:
                pool.release(instance, queued)
                raise
            self._count_choice(leg, instance, choice, request_id)
            return instance, response, queued
        raise _LegFailed(failure or self._no_instance(leg))

    @property
    def headers_within_s(self) -> float:
        """How long an instance has for the headers of its answer, from sending: a
        connection (connect_timeout_s), then timeout_s."""
        return self.config.connect_timeout_s + self.config.timeout_s

    async def send_request(self, request: Any, leg: str, url: str) -> Any:
        """``client.send(request, stream=True)`` within headers_within_s: httpx's
        timeout runs between reads, so an instance sending its headers a byte at a
        time would hold the request (and its slot there) for good. _LegFailed (504)
        past it; httpx's own errors as they come."""
        try:
            with anyio.fail_after(self.headers_within_s):
                return await self.client.send(request, stream=True)
        except TimeoutError:
            logger.warning(
                "%s instance %s sent no complete headers within %s s", leg, url, self.headers_within_s
            )
            raise _LegFailed(
                _error(
                    504,
                    f"the {leg} instance {url} did not send its answer's headers within {self.headers_within_s} s",
                    "upstream_timeout",
                    leg,
                )
            ) from None

    async def whole(self, response: Any, leg: str, url: str) -> Any:
        """A streamed httpx response read whole, as a response holding its body:
        at most max_answer_bytes (as sent: never decoded), within timeout_s in all, so that an
        instance can neither fill the proxy's memory nor trickle its answer for
        good. Closes ``response``; _LegFailed (502, 504) past either bound."""
        limit = self.config.max_answer_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.config.timeout_s):
                async for chunk in _raw_bytes(response, leg, url):
                    size += len(chunk)
                    if size > limit:
                        raise _LegFailed(
                            _error(
                                502,
                                f"the {leg} instance {url} answered more than {limit} bytes; if that is "
                                "expected, raise max_answer_bytes (--max-answer-size)",
                                "bad_upstream_response",
                                leg,
                            )
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise _LegFailed(
                _error(
                    504,
                    f"the {leg} instance {url} did not finish its answer within {self.config.timeout_s} s",
                    "upstream_timeout",
                    leg,
                )
            ) from None
        finally:
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await response.aclose()
        # The body is whole: its framing headers no longer apply (and it had no encoding).
        headers = [
            (key, value)
            for key, value in response.headers.multi_items()
            if key.lower() not in ("content-encoding", "content-length", "transfer-encoding")
        ]
        return self.httpx.Response(
            response.status_code, headers=headers, content=b"".join(chunks), request=response.request
        )

    def acquire(
        self, leg: str, prompt: list[int] | None, exclude: list[Instance] | None = None
    ) -> tuple[Instance | None, Choice | None]:
        """An instance of ``leg``, acquired: the least loaded one, or for prefill with KV events
        the best scored (see ``_kv_routing``), and why (None only without an instance). Both
        modes pick here. The reason is taken now: it is counted after the request was sent,
        and other requests acquire meanwhile."""
        kv = self.kv if leg == "prefill" else None
        choices: list[Choice] = []
        why: list[str] = []

        def choose(candidates: list[Instance]) -> tuple[Instance, int]:
            assert kv is not None
            choices.append(kv.choose(candidates, prompt))
            return choices[-1].instance, choices[-1].queued_tokens

        instance = self.pools[leg].acquire(
            exclude=exclude or [], choose=choose if kv is not None else None, why=why
        )
        if instance is None:
            return None, None
        if choices:
            return instance, choices[-1]
        return instance, Choice(instance, why[-1], 0, 0, 0, routed=False)

    def _count_choice(self, leg: str, instance: Instance, choice: Choice | None, request_id: str) -> None:
        if choice is None or not choice.routed:
            reason = "load" if choice is None else choice.reason
            logger.debug(
                "request %s: %s on %s (%s: %d in flight, KV cache %s in use)",
                request_id,
                leg,
                instance.url,
                reason,
                instance.in_flight,
                "unknown" if instance.kv_usage is None else f"{instance.kv_usage:.0%}",
            )
        elif choice.reason == "load":
            reason = choice.reason
            self.metrics.cached_tokens.observe(0)
            logger.info(
                "request %s: prefill on %s (load: no cached prefix known; %d in flight there)",
                request_id,
                instance.url,
                instance.in_flight,
            )
        else:
            reason = choice.reason
            self.metrics.cached_tokens.observe(choice.cached_tokens)
            logger.info(
                "request %s: prefill on %s (%s: %d prompt tokens cached there, %d at best; "
                "%d tokens queued there, this prompt's included)",
                request_id,
                instance.url,
                reason,
                choice.cached_tokens,
                choice.best_cached_tokens,
                instance.queued_tokens,
            )
        self.metrics.route.labels(leg, reason).inc()

    def _no_instance(self, leg: str) -> JSONResponse:
        source = f" and none registered at {self.config.metadata_target}" if self.discovery else ""
        return _error(503, f"no {leg} instance: none given (--{leg} URL){source}", "no_instance", leg)

    async def _call(
        self,
        leg: str,
        method: str,
        path: str,
        headers: dict[str, str],
        request_id: str,
        content: bytes | None = None,
        prompt: list[int] | None = None,
        first: tuple[Instance, Choice | None] | None = None,
    ) -> tuple[str, Any]:
        """One whole exchange; an HTTP error status from the instance becomes the client's answer."""
        instance, response, queued = await self.send(
            leg, method, path, headers, request_id, content, prompt=prompt, first=first
        )
        self.pools[leg].release(instance, queued)
        if response.status_code >= 400:
            logger.warning(
                "request %s: %s instance %s answered %s", request_id, leg, instance.url, response.status_code
            )
            raise _LegFailed(_passthrough(response, leg))
        return instance.url, response

    async def _prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        request_id: str,
        prompt: list[int] | None,
        first: tuple[Instance, Choice | None] | None = None,
    ) -> dict[str, Any]:
        try:
            content = await _dumps(prefill_body(body))
        except BaseException:
            if first is not None:  # acquired by the caller: ours to release
                self.pools["prefill"].release(first[0], first[1].queued_tokens if first[1] else 0)
            raise
        url, response = await self._call("prefill", "POST", path, headers, request_id, content, prompt, first)
        try:
            answer = await _parse_json(response.content)
        except ValueError:
            raise _LegFailed(
                _error(
                    502,
                    f"the prefill instance {url} answered with invalid JSON",
                    "bad_upstream_response",
                    "prefill",
                )
            ) from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise _LegFailed(
                _error(
                    502,
                    f"the prefill instance {url} returned no kv_transfer_params: start it with a KV "
                    "connector that produces the KV cache (--kv-transfer-config with kv_role kv_producer "
                    "or kv_both)",
                    "bad_upstream_response",
                    "prefill",
                )
            )
        logger.debug("request %s: prefilled on %s", request_id, url)
        if self.push is not None:
            self.push.learn(url, params)
        return params

    async def _decode_stream(
        self, path: str, content: bytes, headers: dict[str, str], request_id: str
    ) -> Response:
        instance, response, _ = await self.send(
            "decode", "POST", path, headers, request_id, content, stream=True
        )

        async def close() -> None:
            self.pools["decode"].release(instance)
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await response.aclose()

        try:
            if response.status_code >= 400:
                try:
                    response = await self.whole(response, "decode", instance.url)  # bounded, as others
                except self.httpx.RequestError as exc:
                    raise _LegFailed(self._transport_error(exc, "decode", instance.url)) from None
                logger.warning(
                    "request %s: decode instance %s answered %s",
                    request_id,
                    instance.url,
                    response.status_code,
                )
                raise _LegFailed(_passthrough(response, "decode"))
        except BaseException:
            await close()
            raise
        try:
            _check_identity(response, "decode", instance.url)  # before the status line goes out
        except BaseException:
            await close()
            raise
        headers_out = {"content-type": response.headers.get("content-type", "text/event-stream")}
        return _Stream(
            self._relay(response, instance.url, request_id),
            close,
            status_code=response.status_code,
            headers=headers_out,
        )

    async def _relay(self, response: Any, url: str, request_id: str) -> AsyncIterator[bytes]:
        at_boundary = True
        try:
            async for chunk in _raw_bytes(response, "decode", url):
                if chunk:
                    at_boundary = chunk.endswith((b"\n\n", b"\r\n\r\n"))
                    yield chunk
        except self.httpx.RequestError as exc:
            # The status line is gone already: the error travels as one last event,
            # after a blank line that ends any event cut in half.
            logger.warning("request %s: decode stream from %s broke: %r", request_id, url, exc)
            failure = self._transport_error(exc, "decode", url)
            yield (b"" if at_boundary else b"\n\n") + b"data: " + failure.body + b"\n\n"

    async def _prompt(
        self, path: str, body: dict[str, Any], headers: dict[str, str], request_id: str
    ) -> list[int] | None:
        """The prompt's token ids for KV-aware routing, from a prefill instance's
        ``/tokenize``; None (route by load) when nothing is cached anywhere yet,
        or the prompt cannot be tokenized in ``kv_tokenize_timeout_s``."""
        if self.kv is None or not self.kv.has_blocks():
            return None
        request = tokenize_request(path, body)
        if request is None or isinstance(request, list):
            return request
        # Any prefill instance serves the same model; the least loaded one is asked, not counted.
        instances = self.pools["prefill"].instances()
        if not instances:
            return None
        instance = min(instances, key=lambda i: i.in_flight)
        try:
            with anyio.fail_after(self.config.kv_tokenize_timeout_s):
                tokenize = self.client.build_request(
                    "POST", instance.url + "/tokenize", headers=headers, content=await _dumps(request)
                )
                response = await self.whole(
                    await self.client.send(tokenize, stream=True), "prefill", instance.url
                )
            if response.status_code == 200:
                tokens = prompt_tokens(await _parse_json(response.content))
                why = "" if tokens is not None else "no token ids in its answer"
            else:
                tokens, why = None, f"HTTP {response.status_code}"
        except TimeoutError:
            tokens, why = None, f"no answer within {self.config.kv_tokenize_timeout_s} s"
        except _LegFailed as exc:
            tokens, why = None, exc.message
        except (self.httpx.RequestError, ValueError) as exc:
            tokens, why = None, f"{type(exc).__name__}: {exc}"
        if tokens is None:
            self.metrics.tokenize_failures.inc()
            logger.warning(
                "request %s: %s/tokenize failed (%s); routing prefill by load", request_id, instance.url, why
            )
        return tokens

    # -- the routes -------------------------------------------------------

    async def _read_json(self, request: Request) -> dict[str, Any]:
        """The client's body as a JSON object; an error answer when it is too large, too
        slow, too deep or not one. A body refused before it was read whole closes the
        connection, so the rest of it is not read either."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _LegFailed(_too_large(limit))
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:  # a chunked body, or one longer than it said
                        raise _LegFailed(_too_large(limit))
                    chunks.append(chunk)
        except ClientDisconnect:  # nobody reads the answer; it only ends the request quietly
            raise _LegFailed(
                _error(400, "the client left before its body was read", "invalid_request_error")
            ) from None
        except TimeoutError:
            raise _LegFailed(
                _error(
                    408,
                    f"request body not received within {self.config.body_timeout_s} s; "
                    "send it faster, or raise body_timeout_s (--body-timeout-s)",
                    "invalid_request_error",
                    close=True,
                )
            ) from None
        try:
            return await anyio.to_thread.run_sync(parse_object, b"".join(chunks), self.config.max_json_depth)
        except ProtocolError as exc:
            raise _LegFailed(_error(400, str(exc), "invalid_request_error")) from None

    @staticmethod
    def _headers(request: Request, request_id: str) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: request_id}
        authorization = request.headers.get("authorization")
        if authorization:
            headers["Authorization"] = authorization
        return headers

    async def handle(self, request: Request, work: Callable[[str], Awaitable[Response]]) -> Response:
        """Runs ``work(request_id)``; every answer carries the request id."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            response = await work(request_id)
        except _LegFailed as exc:
            response = exc.response
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def complete(self, request: Request, path: str) -> Response:
        async def work(request_id: str) -> Response:
            body = await self._read_json(request)
            for leg, pool in self.pools.items():  # before a prefill whose KV cache nobody would pull
                if not len(pool):
                    raise _LegFailed(self._no_instance(leg))
            headers = {**self._headers(request, request_id), "Content-Type": "application/json"}
            # Push and pull pick the prefill instance the same way (see ``acquire``).
            prompt = await self._prompt(path, body, headers, request_id)
            first: tuple[Instance, Choice | None] | None = None
            if self.push is not None:
                instance, choice = self.acquire("prefill", prompt)
                if instance is None:
                    raise _LegFailed(self._no_instance("prefill"))
                if self.push.knows(instance.url):
                    return await self.push.complete(path, body, headers, request_id, instance, choice)
                first = (instance, choice)  # not known yet: pull there, which teaches the proxy
            params = await self._prefill(path, body, headers, request_id, prompt, first)
            content = await _dumps({**body, "kv_transfer_params": params})
            if body.get("stream") is True:
                return await self._decode_stream(path, content, headers, request_id)
            _, response = await self._call("decode", "POST", path, headers, request_id, content)
            return _passthrough(response)

        return await self.handle(request, work)

    async def models(self, request: Request) -> Response:
        async def work(request_id: str) -> Response:
            headers = self._headers(request, request_id)
            _, response = await self._call("decode", "GET", "/v1/models", headers, request_id)
            return _passthrough(response)

        return await self.handle(request, work)

    def health(self) -> JSONResponse:
        missing = [role for role, pool in self.pools.items() if not len(pool)]
        body: dict[str, Any] = {"status": "unavailable" if missing else "ok"}
        if missing:
            body["reason"] = " and ".join(f"no {role} instance" for role in missing)
        body.update({role: pool.to_json() for role, pool in self.pools.items()})
        body["metadata"] = self.discovery.to_json() if self.discovery else None
        body["kv_events"] = self.kv.to_json() if self.kv else None
        return JSONResponse(body, status_code=503 if missing else 200)


# The OpenAPI document's account of the completion routes, which read their body themselves.
_COMPLETION_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "An OpenAI request, passed on as it is but for kv_transfer_params "
                    "(and, on the prefill leg, max_tokens and stream)",
                }
            }
        },
    },
    "responses": {
        "200": {
            "description": "The decode instance's answer: JSON, or server-sent events with stream: true",
            "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
        },
    },
}
# Errors: the proxy's own as {"error": {"message", "type", "leg"}}, an instance's as it sent them.
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "The body is not a JSON object, or nests too deeply"},
    408: {"description": "The body did not come within body_timeout_s"},
    413: {"description": "The body is over max_body_bytes"},
    502: {"description": "An instance could not be reached or answered nonsense"},
    503: {"description": "No prefill or no decode instance"},
    504: {"description": "An instance did not answer within timeout_s"},
    "4XX": {"description": "An instance's own error, as it sent it"},
    "5XX": {"description": "An instance's own error, as it sent it"},
}


def build_app(config: ProxyConfig) -> FastAPI:
    """The proxy as an ASGI app; it needs its lifespan run (uvicorn does by default)."""
    router = _Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(
        title="kvx proxy",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible router: prefill on one vLLM instance, decode on another.",
    )
    app.state.router = router

    @app.post(
        "/v1/completions",
        tags=["openai"],
        summary="Completion: prefill, then decode",
        openapi_extra=_COMPLETION_OPENAPI,
        responses=_ERRORS,
    )
    async def completions(request: Request) -> Response:
        return await router.complete(request, "/v1/completions")

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        summary="Chat completion: prefill, then decode",
        openapi_extra=_COMPLETION_OPENAPI,
        responses=_ERRORS,
    )
    async def chat_completions(request: Request) -> Response:
        return await router.complete(request, "/v1/chat/completions")

    @app.get(
        "/v1/models",
        tags=["openai"],
        summary="The models of a decode instance",
        responses={k: v for k, v in _ERRORS.items() if k in (502, 503, 504, "4XX", "5XX")},
    )
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get(
        "/healthz",
        tags=["health"],
        summary="The instances and their requests in flight",
        responses={503: {"description": "No prefill or no decode instance"}},
    )
    async def healthz() -> JSONResponse:
        return router.health()

    app.add_api_route("/health", healthz, methods=["GET"], include_in_schema=False)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics: routing choices and KV events",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {}}}}},
    )
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
