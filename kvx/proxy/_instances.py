"""The proxy's prefill and decode instances: choosing one, and discovering them.

Everything here except the metadata calls runs on the proxy's event loop, so
the pools need no locks; discovery makes its blocking gRPC calls on one
worker thread and applies the result on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from kvx.errors import ConfigError, ConnectError, MetadataError
from kvx.metadata.client import MetadataClient, MetadataOptions
from kvx.metadata.roles import RoleName
from kvx.proxy._config import normalize_url

logger = logging.getLogger(__name__)

# The roles of the two legs of a completion; agents of the third role, "other", serve neither.
ROLES: tuple[RoleName, ...] = ("prefill", "decode")
DRAINING_KEY = "draining"  # engine_info key: "1" while the instance drains (kvx prefill/decode)
API_URL_KEY = "api_url"  # engine_info key under which an engine publishes its OpenAI server
MAX_WARNED_RECORDS = 1000  # bad api_url values warned about once each, up to this many remembered


@dataclasses.dataclass(eq=False)
class Instance:
    url: str
    source: str  # "static" (given on the command line) or "metadata" (discovered)
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens of its prefill legs in flight, less what was cached
    kv_usage: float | None = None  # decode: the engine's KV cache in use, 0 to 1, when read
    cooldown_until_s: float = 0.0  # time.monotonic(); skipped until then while another one is ready
    requests: int = 0
    failures: int = 0

    def cooling_down(self, now_s: float) -> bool:
        return self.cooldown_until_s > now_s

    def to_json(self, now_s: float) -> dict:
        return {
            "url": self.url,
            "source": self.source,
            "in_flight": self.in_flight,
            "queued_tokens": self.queued_tokens,
            "kv_usage": self.kv_usage,
            "requests": self.requests,
            "failures": self.failures,
            "cooling_down": self.cooling_down(now_s),
        }


class InstancePool:
    """The instances of one role; ``acquire`` picks the least loaded one.

    Ties go round robin. An instance removed by discovery while requests
    are in flight on it keeps its counts on the detached object, so
    ``release`` stays correct.
    """

    def __init__(self, role: str, static_urls: Iterable[str], cooldown_s: float) -> None:
        assert role in ROLES
        self.role = role
        self.cooldown_s = cooldown_s
        self._static = {url: Instance(url, "static") for url in static_urls}
        self._discovered: dict[str, Instance] = {}
        self._next = 0

    def instances(self) -> list[Instance]:
        return [*self._static.values(), *self._discovered.values()]

    def __len__(self) -> int:
        return len(self._static) + len(self._discovered)

    def set_discovered(self, urls: Iterable[str]) -> bool:
        """Replace the discovered instances; True when the set changed."""
        wanted = [url for url in dict.fromkeys(urls) if url not in self._static]
        changed = set(wanted) != set(self._discovered)
        self._discovered = {url: self._discovered.get(url) or Instance(url, "metadata") for url in wanted}
        return changed

    def acquire(
        self,
        exclude: Iterable[Instance] = (),
        choose: Callable[[list[Instance]], tuple[Instance, int]] | None = None,
        why: list[str] | None = None,
    ) -> Instance | None:
        """The least loaded instance not in ``exclude`` (preferring those not
        cooling down), counted as one more request in flight; None when none is
        left. ``choose``, when given, picks of those instead, and says how many
        prompt tokens the instance will compute (``queued_tokens``, until released).
        Without ``choose``, ``why`` gets the reason appended: "load", or "kv_usage"
        when instances as loaded as the one picked had more of their KV cache in use."""
        skip = set(map(id, exclude))
        candidates = [i for i in self.instances() if id(i) not in skip]
        if not candidates:
            return None
        now_s = time.monotonic()
        ready = [i for i in candidates if not i.cooling_down(now_s)] or candidates
        start = self._next % len(ready)
        self._next += 1
        # min() keeps the first of equals: rotating the start makes ties round robin.
        rotated = ready[start:] + ready[:start]
        if choose is None:
            # Equally loaded: the most free KV cache, where the engines' usage is read (decode).
            instance, queued_tokens = min(rotated, key=lambda i: (i.in_flight, i.kv_usage or 0.0)), 0
            peers = [i for i in rotated if i.in_flight == instance.in_flight]
            usages = {i.kv_usage or 0.0 for i in peers}
            if why is not None:
                why.append("kv_usage" if len(usages) > 1 else "load")
        else:
            instance, queued_tokens = choose(rotated)
        instance.in_flight += 1
        instance.requests += 1
        instance.queued_tokens += queued_tokens
        return instance

    def release(self, instance: Instance, queued_tokens: int = 0) -> None:
        assert instance.in_flight > 0, instance.url
        assert instance.queued_tokens >= queued_tokens, instance.url
        instance.in_flight -= 1
        instance.queued_tokens -= queued_tokens

    def cool_down(self, instance: Instance) -> None:
        instance.failures += 1
        instance.cooldown_until_s = time.monotonic() + self.cooldown_s

    def to_json(self) -> list[dict]:
        now_s = time.monotonic()
        return [i.to_json(now_s) for i in self.instances()]


class Discovery:
    """Keeps the pools' discovered instances in step with the metadata service.

    Every ``refresh_s`` it lists the prefill and decode agents and takes
    ``engine_info["api_url"]`` of each (several agents, one per rank, can
    share one engine and so one URL). While the service cannot be reached
    the last answer stays in use.
    """

    def __init__(
        self, target: str, options: MetadataOptions | None, pools: dict[str, InstancePool], refresh_s: float
    ) -> None:
        self.target = target
        self.options = options or MetadataOptions()
        self.pools = pools
        self.refresh_s = refresh_s
        self.error: str | None = "not refreshed yet"
        self.refreshed_unix_ms = 0
        self._failing = False  # the last refresh failed: log transitions only, not every period
        self._client = MetadataClient(target, self.options)  # raises ConfigError on bad TLS settings now
        self._warned_records: set[tuple[str, str]] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Refresh once (an unreachable service is logged, not raised), then keep refreshing."""
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvx-proxy-discovery")
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="kvx-proxy-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._executor is not None:
            # A call in progress ends within its gRPC timeout; nobody waits for it.
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bug here must not end discovery for good
                logger.exception("instance discovery failed; trying again in %s s", self.refresh_s)

    async def refresh(self) -> bool:
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        # Two calls, each bounded by the client's timeout; the outer bound is a guard.
        guard_s = 2 * self.options.timeout_s + 1
        try:
            found = await asyncio.wait_for(loop.run_in_executor(self._executor, self._list), guard_s)
        except (TimeoutError, ConnectError, MetadataError) as exc:
            self.error = str(exc) or f"no answer within {guard_s} s"
            if not self._failing:
                logger.warning("instance discovery: %s; keeping the last known instances", self.error)
            self._failing = True
            return False
        if self._failing:
            logger.info("instance discovery: the metadata service at %s answers again", self.target)
        self._failing = False
        self.error = None
        self.refreshed_unix_ms = int(time.time() * 1000)
        for role, urls in found.items():
            pool = self.pools[role]
            if pool.set_discovered(urls):
                logger.info(
                    "%s instances now: %s", role, ", ".join(i.url for i in pool.instances()) or "none"
                )
        return True

    def _list(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for role in ROLES:
            urls: set[str] = set()
            draining: set[str] = set()
            for record in self._client.list(role=role):
                if record.engine_info.get("engine") == "sglang":
                    continue  # SGLang takes its own protocol: route it with SGLang's router
                url = self._api_url(record)
                if url is not None:
                    # A daemon that drains publishes draining=1: no new requests go there.
                    (draining if record.engine_info.get(DRAINING_KEY) == "1" else urls).add(url)
            found[role] = sorted(urls - draining)
        return found

    def _api_url(self, record) -> str | None:
        raw = record.engine_info.get(API_URL_KEY)
        if raw is None:
            return None  # an agent that serves no HTTP itself (a rank other than the engine's front)
        try:
            return normalize_url(raw, f"agent {record.name}: engine_info[{API_URL_KEY!r}]")
        except ConfigError as exc:
            if (record.name, raw) not in self._warned_records:
                if len(self._warned_records) >= MAX_WARNED_RECORDS:
                    self._warned_records.clear()
                self._warned_records.add((record.name, raw))
                logger.warning("instance discovery: skipping %s", exc)
            return None

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "ok": self.error is None,
            "error": self.error,
            "refreshed_unix_ms": self.refreshed_unix_ms,
        }
