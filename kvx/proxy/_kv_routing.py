"""Choosing the prefill instance by the prompt's cached prefix, balanced against load.

The rule: each prefill instance that is not cooling down scores

    score = cached_tokens - alpha * queued_tokens

``cached_tokens``: how many leading tokens of the prompt it holds in full
blocks (from its KV events, ``_kv_events``); ``queued_tokens``: the prompt
tokens it still has to compute for the prefill legs this proxy has in flight
there (each leg counts its prompt less what was cached). With alpha = 1 the
score is minus the tokens the instance would compute before this prompt is
done, up to the prompt's own length. The highest score wins; ties go to
fewer requests in flight, then round robin. Without a cached prefix
anywhere, or without a tokenized prompt, the choice is by load as before.

Decode goes by load (requests in flight); with ``decode_kv_usage`` ties go to
the instance whose engine reports the lowest ``vllm:kv_cache_usage_perc``
(``DecodeUsage``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from kvx.proxy._instances import Instance
from kvx.proxy._kv_events import KvEventSubscriber, PrefixIndex
from kvx.proxy._legs import content_encoding
from kvx.proxy._metrics import ProxyMetrics

logger = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1 << 21  # longer token lists from /tokenize are not used for routing


@dataclasses.dataclass(frozen=True)
class Choice:
    instance: Instance
    # "prefix", "load_over_prefix" or "load"; without KV events (``routed`` False):
    # "load", or "kv_usage" (InstancePool.acquire).
    reason: str
    cached_tokens: int
    best_cached_tokens: int  # the longest cached prefix on any candidate
    queued_tokens: int  # the prompt's tokens this instance has to compute
    routed: bool = True  # chosen by the prefix indexes (KV events), not by load alone


class KvRouting:
    """The prefill instances' prefix indexes and their subscribers."""

    def __init__(
        self,
        endpoints: dict[str, str],
        metrics: ProxyMetrics,
        alpha: float,
        max_blocks: int,
        max_message_bytes: int,
    ) -> None:
        self.metrics = metrics
        self.alpha = alpha
        self.indexes = {url: PrefixIndex(max_blocks) for url in endpoints}
        self.subscribers = {
            url: KvEventSubscriber(
                url,
                endpoint.split(",")[0],
                self.indexes[url],
                max_message_bytes,
                on_batch=self._counter(url),
                replay_endpoint=endpoint.split(",")[1] if "," in endpoint else None,
            )
            for url, endpoint in endpoints.items()
        }

    def _counter(self, url: str) -> Any:
        def count(outcome: str) -> None:
            self.metrics.kv_events.labels(url, outcome).inc()

        return count

    def start(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.start()

    def stop(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.stop(join=False)  # all at once: each then ends within a poll
        for subscriber in self.subscribers.values():
            subscriber.stop()

    def has_blocks(self) -> bool:
        return any(len(index) for index in self.indexes.values())

    def choose(self, candidates: list[Instance], prompt: list[int] | None) -> Choice:
        """The best of ``candidates`` (not empty) for ``prompt``, by the rule in the module's docstring."""
        assert candidates
        cached = {
            id(i): self.indexes[i.url].match(prompt) if prompt and i.url in self.indexes else 0
            for i in candidates
        }
        best_cached = max(cached.values())
        if best_cached == 0:
            instance = min(candidates, key=lambda i: i.in_flight)
            return Choice(instance, "load", 0, 0, len(prompt or ()))

        def score(i: Instance) -> tuple[float, int]:
            return (cached[id(i)] - self.alpha * i.queued_tokens, -i.in_flight)

        instance = max(candidates, key=score)  # max() keeps the first of equals: rotated by the caller
        reason = "prefix" if cached[id(instance)] == best_cached else "load_over_prefix"
        queued = len(prompt or ()) - cached[id(instance)]
        return Choice(instance, reason, cached[id(instance)], best_cached, queued)

    def to_json(self) -> dict[str, Any]:
        return {url: s.to_json() for url, s in self.subscribers.items()}


def prompt_tokens(answer: Any) -> list[int] | None:
    """The token ids in a vLLM ``/tokenize`` answer, or None when it is not one."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_PROMPT_TOKENS
        or not all(type(t) is int for t in tokens)
    ):
        return None
    return tokens


def tokenize_request(path: str, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """What to send vLLM's ``/tokenize`` for a completion's prompt, or the token ids themselves
    when the client sent them; None when there is no single prompt to route by."""
    model = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            return {**model, "prompt": prompt}
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt if len(prompt) <= MAX_PROMPT_TOKENS else None
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    request: dict[str, Any] = {**model, "messages": messages}
    # The fields that change how vLLM renders the chat into the prompt.
    for key in ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        if key in body:
            request[key] = body[key]
    return request


USAGE_METRIC = "vllm:kv_cache_usage_perc"
MAX_METRICS_BYTES = 4 * 1024 * 1024  # an engine's /metrics is tens of KiB


def kv_usage(text: str) -> float | None:
    """The highest ``vllm:kv_cache_usage_perc`` (0 to 1) of an engine's ``/metrics``
    (one line per engine core under data parallelism); None without one."""
    found: float | None = None
    for line in text.splitlines():
        if not line.startswith(USAGE_METRIC) or line[len(USAGE_METRIC) : len(USAGE_METRIC) + 1] not in (
            "{",
            " ",
        ):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if 0.0 <= value <= 1.0:
            found = value if found is None else max(found, value)
    return found


class DecodeUsage:
    """Reads each decode instance's KV-cache usage from its ``/metrics`` every ``refresh_s``,
    into ``Instance.kv_usage``: among decode instances with equally many requests in flight,
    the one with the most free KV cache goes first. An instance that does not answer in
    ``timeout_s`` keeps no usage (None, counted as empty)."""

    def __init__(
        self, pools: dict[str, Any], client: Any, httpx: Any, refresh_s: float, timeout_s: float
    ) -> None:
        self.pools = pools
        self.client = client
        self.httpx = httpx
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            for instance in self.pools["decode"].instances():
                instance.kv_usage = await self._read(instance.url)
            await asyncio.sleep(self.refresh_s)

    async def _read(self, url: str) -> float | None:
        chunks: list[bytes] = []
        size = 0
        try:
            # In all within timeout_s (httpx's runs between reads: an instance trickling its
            # answer would stall every instance's reading).
            async with asyncio.timeout(self.timeout_s):
                async with self.client.stream("GET", url + "/metrics", timeout=self.timeout_s) as response:
                    if response.status_code != 200 or content_encoding(response):
                        return None  # a compressed answer is not decoded: 4 MiB of it could be gigabytes
                    async for chunk in response.aiter_raw():
                        size += len(chunk)
                        if size > MAX_METRICS_BYTES:
                            return None
                        chunks.append(chunk)
        except (self.httpx.RequestError, TimeoutError):
            return None
        return kv_usage(b"".join(chunks).decode("utf-8", "replace"))
