"""The synthetic engine: a cluster's whole KV path with no model and no GPU.

It serves what vLLM serves to ``kvx proxy`` (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``kv_transfer_params``)
and moves real KV blocks through kvx:

- A prompt becomes token ids, one per whitespace-separated word (CRC-32 of
  the word modulo ``VOCAB``), or is given as token ids.
- Prefill writes the prompt's KV into a registered pool: every byte is a
  function of (token id, layer, plane, position) (:func:`derive_kv`), and can
  spend simulated compute time first, on one simulated accelerator that serves
  one request at a time in arrival order (:class:`ComputeServer`). Asked for a remote decode, it holds the
  blocks under a lease and answers with ``kv_transfer_params`` that say
  where they are.
- Decode READs those blocks from the prefill daemon's agent (found by name
  in the metadata service), checks every byte against the same derivation,
  and answers with tokens derived from the KV it now holds: a wrong or
  missing block fails the request, and would change the answer. The READ
  carries a "done" notification that frees prefill's blocks; a lease that
  runs out frees them too.
- Without ``kv_transfer_params`` either role computes the KV itself: the
  answer is the same as the P/D answer, which is what tests compare.

``kv_transfer_params`` come from clients: decode checks their shape and
size, reads only into blocks it allocated for the request, and prefill's
agent checks every descriptor against its registered pool. A done note must
carry the lease's random token, so nobody frees another request's blocks.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvx.agent import Agent
from kvx.config import MiB, Timeouts, check_name, read_file
from kvx.daemon.metrics import DaemonMetrics
from kvx.daemon.settings import DaemonSettings
from kvx.daemon.shapes import ModelShape
from kvx.errors import KvxError, ProtocolError
from kvx.layout import KVLayout
from kvx.metadata.client import MetadataOptions
from kvx.proxy._body import parse_object
from kvx.transfer import Notification

logger = logging.getLogger(__name__)

VOCAB = 32000
PAD = 0xFFFFFFFF  # the token id of positions past the prompt in its last block
MAX_TOKENS = 4096  # tokens one answer may ask for
DEFAULT_MAX_TOKENS = 16
POOL_TARGET_BYTES = 256 * MiB
ALLOC_WAIT_S = 30.0  # a request waits this long for free blocks, then gets 503
COMPUTE_WAIT_S = 120.0  # the longest wait for the simulated accelerator; a longer queue gets 503
# A request body's limit: kv_transfer_params of the largest pool (1 << 24 block
# ids) would not fit, but they are refused anyway (more blocks than the prompt).
MAX_BODY_BYTES = 8 * MiB
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body
DONE = b"done"
_DONE_RE = re.compile(rb"done ([0-9a-f]{32}) ([0-9a-f]{32})")


class EngineError(KvxError):
    """A request that cannot be served; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- the model: tokens, KV and answers, all derived ------------------------------


def tokenize(prompt: Any) -> np.ndarray:
    """Token ids of a prompt: a string (one id per word) or a list of ids."""
    if isinstance(prompt, str):
        words = prompt.split()
        ids = np.fromiter((zlib.crc32(w.encode()) % VOCAB for w in words), np.uint32, len(words))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= VOCAB):
            raise EngineError(400, f"token ids must be 0..{VOCAB - 1}")
        ids = ids.astype(np.uint32)
    else:
        raise EngineError(400, "prompt must be a string or a list of token ids")
    if ids.size == 0:
        raise EngineError(400, "the prompt has no tokens")
    return ids


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def derive_kv(tokens: np.ndarray, shape: ModelShape, block_tokens: int) -> np.ndarray:
    """The prompt's KV: uint8 of shape (layers, planes, blocks, block bytes),
    where a block's bytes are its tokens' bytes in position order."""
    nblocks = -(-tokens.size // block_tokens)
    ids = np.full(nblocks * block_tokens, PAD, np.uint64)
    ids[: tokens.size] = tokens
    pos = np.arange(ids.size, dtype=np.uint64)
    layer = np.arange(shape.layers, dtype=np.uint64)[:, None, None]
    plane = np.arange(shape.planes, dtype=np.uint64)[None, :, None]
    with np.errstate(over="ignore"):
        seed = (
            ids * np.uint64(0x9E3779B97F4A7C15)
            ^ pos * np.uint64(0xD6E8FEB86659FD93)
            ^ layer * np.uint64(0xC2B2AE3D27D4EB4F)
            ^ plane * np.uint64(0x165667B19E3779F9)
        )
        seed = _mix(seed)  # (layers, planes, positions)
        words = shape.token_plane_bytes // 8
        ramp = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        kv = seed[..., None] ^ ramp  # (layers, planes, positions, words)
    return kv.view(np.uint8).reshape(
        shape.layers, shape.planes, nblocks, block_tokens * shape.token_plane_bytes
    )


def kv_digest(kv: np.ndarray) -> int:
    """A 64-bit digest of KV blocks that changes with any block's bytes or place."""
    rows = np.ascontiguousarray(kv).reshape(-1, kv.shape[-1]).view(np.uint64)
    folded = np.bitwise_xor.reduce(rows, axis=1)
    with np.errstate(over="ignore"):
        weights = np.arange(folded.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        return int(_mix(np.asarray([np.sum(folded * weights, dtype=np.uint64)]))[0])


def answer_tokens(digest: int, n: int) -> list[int]:
    """The answer's tokens, from the digest of the prompt's KV."""
    with np.errstate(over="ignore"):
        x = _mix(np.uint64(digest) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return (x % np.uint64(VOCAB)).astype(np.int64).tolist()


def render(tokens: list[int]) -> str:
    return "".join(f" t{t}" for t in tokens)


def expected_answer(prompt: Any, shape: ModelShape, block_tokens: int, max_tokens: int) -> list[int]:
    """What a correct engine answers: for tests and benchmarks that check answers."""
    return answer_tokens(kv_digest(derive_kv(tokenize(prompt), shape, block_tokens)), max_tokens)


# -- the KV pool -----------------------------------------------------------------


class BlockPool:
    """Free block ids of the pool; a request waits (bounded) for enough of them."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cond = threading.Condition()

    def alloc(self, n: int, timeout_s: float) -> list[int]:
        if n > self.num_blocks:
            raise EngineError(
                400, f"the prompt needs {n} KV blocks; the pool has {self.num_blocks} (--num-blocks)"
            )
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout_s):
                raise EngineError(503, f"no {n} free KV blocks within {timeout_s:.0f} s: the pool is full")
            return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        with self._cond:
            self._free.extend(blocks)
            self._cond.notify_all()

    @property
    def free_blocks(self) -> int:
        with self._cond:
            return len(self._free)


class ComputeServer:
    """The simulated accelerator: one server that spends ``tokens / tokens_per_s``
    seconds per request, one request at a time, first come first served.

    A real engine's accelerator computes one prefill batch at a time, so requests
    that arrive while it is busy queue; sleeping in each request's own thread
    instead would be infinitely many accelerators, and load would never queue.

    Each request takes its turn on arrival, under a lock (the order of arrival
    is the order of the lock): it finishes at ``max(now, the previous request's
    finish) + its service time`` and sleeps until then. This is a FIFO ticket
    queue whose turns are known when the ticket is taken, so a late wake-up of
    one thread (the machine is busy) delays that request only, never the ones
    behind it: the server stays exactly one server at ``tokens_per_s``. A
    request whose finish is more than ``wait_s`` away is refused at once (503)
    and takes no turn; ``close`` ends every wait.

    The queue is bounded by its wait in seconds, not by its length (the
    daemon's in-flight limit bounds the threads waiting). One request's
    own compute is bounded too: a prompt whose compute alone is over
    ``wait_s`` is refused (400), whatever the queue, since it could never
    be served and would hold the server for longer than any wait allowed.
    """

    def __init__(self, tokens_per_s: float, wait_s: float) -> None:
        assert tokens_per_s > 0 and wait_s > 0
        self.tokens_per_s = tokens_per_s
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._busy_until = 0.0  # time.monotonic() when the last request taken finishes
        self._closed = threading.Event()

    def run(self, tokens: int) -> float:
        """Spend the compute of ``tokens`` in turn; the seconds from arrival to done."""
        service_s = tokens / self.tokens_per_s
        if service_s > self.wait_s:
            raise EngineError(
                400,
                f"a prompt of {tokens} tokens takes {service_s:.0f} s of prefill compute at "
                f"{self.tokens_per_s:g} tokens/s, over the {self.wait_s:.0f} s bound: send a shorter "
                "prompt or raise --prefill-tokens-per-s",
            )
        with self._lock:
            arrived = time.monotonic()
            finish = max(arrived, self._busy_until) + service_s
            if finish - arrived > self.wait_s:
                raise EngineError(
                    503,
                    f"the prefill compute queue is {finish - arrived - service_s:.0f} s long "
                    f"(over {self.wait_s:.0f} s): send fewer requests or raise --prefill-tokens-per-s",
                )
            self._busy_until = finish
        if self._closed.wait(max(0.0, finish - time.monotonic())):
            raise EngineError(503, "the engine is stopping")
        return time.monotonic() - arrived

    def close(self) -> None:
        self._closed.set()


class _Lease:
    __slots__ = ("blocks", "deadline", "token")

    def __init__(self, blocks: list[int], deadline: float, token: str) -> None:
        self.blocks, self.deadline, self.token = blocks, deadline, token


# -- the engine ------------------------------------------------------------------


class SyntheticEngine:
    """One daemon's engine: its agent, pool, leases and the three ways to serve."""

    def __init__(
        self, settings: DaemonSettings, metrics: DaemonMetrics, api_url: str, admin_url: str
    ) -> None:
        self.s = settings
        self.metrics = metrics
        self.shape = settings.shape()
        assert settings.name is not None
        self.name: str = settings.name
        self.model = f"kvx-synthetic-{self.shape.name}"
        self.block_tokens = settings.block_size
        self.block_bytes = settings.block_size * self.shape.token_plane_bytes  # one layer, one plane
        per_block = self.block_bytes * self.shape.layers * self.shape.planes
        self.num_blocks = settings.num_blocks or max(16, min(4096, POOL_TARGET_BYTES // per_block))
        self.pool_bytes = per_block * self.num_blocks
        self.blocks = BlockPool(self.num_blocks)
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.compute = (
            ComputeServer(settings.prefill_tokens_per_s, COMPUTE_WAIT_S)
            if settings.prefill_tokens_per_s
            else None
        )
        self.in_flight = 0
        secret = read_file(settings.secret_file).strip()
        token = (
            read_file(settings.metadata_token_file).strip().decode() if settings.metadata_token_file else None
        )
        self.pool = np.empty(self.pool_bytes, np.uint8)
        self.pool.fill(0)  # fault every page in now, as an engine's KV cache is
        self.kv = self.pool.reshape(self.shape.layers, self.shape.planes, self.num_blocks, self.block_bytes)
        self.agent = Agent(
            self.name,
            listen=f"{settings.host}:{settings.agent_port}",
            advertise_host=settings.advertise_host,
            auth_secret=secret,
            backend=settings.backend,
            timeouts=Timeouts(
                io_s=min(10.0, settings.transfer_timeout_s), transfer_s=settings.transfer_timeout_s
            ),
            on_notify=self._on_note,
            metadata=settings.metadata,
            role=settings.role,
            labels={"kvx_daemon": "1"},
            engine_info={
                "engine": "synthetic",
                "api_url": api_url,
                "admin_url": admin_url,
                "draining": "0",
                "model_shape": self.shape.name,
                "model": self.model,
            },
            metadata_options=MetadataOptions(token=token, read_target=settings.metadata_read),
        )
        try:
            self.region = self.agent.register(self.pool)
            self.layout = KVLayout.packed(
                self.region, self.shape.layers, self.num_blocks, self.block_bytes, kv_planes=self.shape.planes
            )
            metrics.registered_bytes.labels("host").set(self.pool_bytes)
            self._sweeper = threading.Thread(target=self._sweep, name="kvx-leases", daemon=True)
            self._sweeper.start()
        except BaseException:
            self.agent.close()
            raise

    # Serving.

    def complete(
        self, prompt: Any, max_tokens: int, params: dict[str, Any] | None
    ) -> tuple[list[int], dict | None]:
        """The answer's tokens and the kv_transfer_params to return (prefill for a remote decode)."""
        tokens = tokenize(prompt)
        with self._lock:
            self.in_flight += 1
        self.metrics.requests_in_flight.inc()
        ok = False
        try:
            if params and params.get("do_remote_prefill"):
                answer, out = self._decode(tokens, max_tokens, params), None
            else:
                answer, out = self._prefill(
                    tokens, max_tokens, hold=bool(params and params.get("do_remote_decode"))
                )
            ok = True
            return answer, out
        finally:
            with self._lock:
                self.in_flight -= 1
            self.metrics.requests_in_flight.dec()
            self.metrics.request(ok)

    def _prefill(self, tokens: np.ndarray, max_tokens: int, hold: bool) -> tuple[list[int], dict | None]:
        nblocks = -(-tokens.size // self.block_tokens)
        if nblocks > self.num_blocks:  # refused before it queues (alloc says why)
            self.blocks.alloc(nblocks, 0)
        if self.compute is not None:
            # The accelerator's time; the derivation below is this process's own CPU
            # work, outside the server, so the service time is exactly tokens / rate
            # and the derivation is part of each request's fixed overhead.
            self.compute.run(tokens.size)
        blocks = self.blocks.alloc(nblocks, ALLOC_WAIT_S)
        kept = False
        try:
            kv = derive_kv(tokens, self.shape, self.block_tokens)
            self.kv[:, :, blocks, :] = kv
            answer = answer_tokens(kv_digest(kv), 1 if hold else max_tokens)
            if not hold:
                return answer, None
            request_id, token = uuid.uuid4().hex, secrets.token_hex(16)
            with self._lock:
                self._leases[request_id] = _Lease(blocks, time.monotonic() + self.s.lease_s, token)
                self.metrics.leases_held.set(len(self._leases))
            kept = True
            return answer, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.name,
                "remote_request_id": request_id,
                "remote_block_ids": blocks,
                "remote_num_tokens": int(tokens.size),
                "remote_host": None,
                "remote_port": None,
                "kvx_region": self.region.id,
                "kvx_lease": token,
                "lease_s": self.s.lease_s,
            }
        finally:
            if not kept:
                self.blocks.free(blocks)

    def _decode(self, tokens: np.ndarray, max_tokens: int, params: dict[str, Any]) -> list[int]:
        nblocks = -(-tokens.size // self.block_tokens)
        source, request_id, lease, region, remote_blocks = _check_params(
            params, tokens.size, nblocks, self.num_blocks
        )
        blocks = self.blocks.alloc(nblocks, ALLOC_WAIT_S)
        try:
            try:
                peer = self.agent.connect(source)
            except KvxError as exc:
                raise EngineError(502, f"cannot reach prefill {source}: {exc}") from None
            local = self.layout.descs(blocks)
            if region not in {r.id for r in peer.regions}:
                raise EngineError(400, f"kv_transfer_params: prefill {source} has no region {region}")
            remote = KVLayout.packed(
                peer.region(region),
                self.shape.layers,
                self.num_blocks,
                self.block_bytes,
                kv_planes=self.shape.planes,
            )
            if peer.region(region).size_bytes != self.pool_bytes:
                raise EngineError(
                    400,
                    f"prefill {source}'s KV pool is laid out differently (another --model-shape or --num-blocks)",
                )
            note = b"%s %s %s" % (DONE, request_id.encode(), lease.encode())
            self.metrics.transfers_in_flight.inc()
            start = time.perf_counter()
            ok = False
            try:
                transfer = peer.read(local, remote.descs(remote_blocks), notify=note)
                transfer.wait(self.s.transfer_timeout_s)
                ok = True
            except KvxError as exc:
                raise EngineError(
                    502, f"reading the KV from {source} failed: {type(exc).__name__}: {exc}"
                ) from None
            finally:
                self.metrics.transfers_in_flight.dec()
                self.metrics.transfer(
                    "read",
                    peer.backend,
                    source,
                    "prefill",
                    local.total_bytes,
                    time.perf_counter() - start,
                    ok,
                )
            got = self.kv[:, :, blocks, :]
            expected = derive_kv(tokens, self.shape, self.block_tokens)
            if not np.array_equal(got, expected):
                self.metrics.verify_failures.inc()
                bad = np.flatnonzero((got != expected).reshape(-1, self.block_bytes).any(axis=1))
                raise EngineError(
                    502, f"the KV read from {source} differs from what its prompt gives ({bad.size} blocks)"
                )
            self.metrics.verified(nblocks * self.shape.layers * self.shape.planes)
            return answer_tokens(kv_digest(got), max_tokens)
        finally:
            self.blocks.free(blocks)

    # Leases.

    def _on_note(self, note: Notification) -> None:
        m = _DONE_RE.fullmatch(note.data)
        if m is None:
            logger.warning("ignoring a notification from %s that is not a done note", note.peer)
            return
        request_id, token = m.group(1).decode(), m.group(2).decode()
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not hmac.compare_digest(lease.token, token):
                return  # expired already, or not the holder's token
            del self._leases[request_id]
            self.metrics.leases_held.set(len(self._leases))
        self.blocks.free(lease.blocks)

    def _sweep(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
                expired = [self._leases.pop(rid) for rid in gone]
                self.metrics.leases_held.set(len(self._leases))
            for lease in expired:
                self.metrics.leases_expired.inc()
                self.blocks.free(lease.blocks)
            if expired:
                logger.warning("%d lease(s) ran out before decode read the KV", len(expired))

    @property
    def leases_held(self) -> int:
        with self._lock:
            return len(self._leases)

    # Lifecycle.

    def set_draining(self) -> None:
        self.agent.update_engine_info({"draining": "1"})

    def close(self) -> None:
        self._stop.set()
        if self.compute is not None:
            self.compute.close()
        self.agent.close()

    def status(self) -> dict[str, Any]:
        return {
            "agent": {"name": self.agent.name, "endpoint": self.agent.endpoint, "epoch": self.agent.epoch},
            "peers": [
                {"name": p.name, "backend": p.backend, "backend_reason": p.backend_reason, "alive": p.alive}
                for p in self.agent.peers
            ],
            "regions": [
                {
                    "id": r.id,
                    "bytes": r.size_bytes,
                    "memory": "cuda" if r.memory_kind.name == "CUDA" else "host",
                    "remote_access": r.remote_read,
                }
                for r in self.agent.regions
            ],
            "pool": {
                "blocks": self.num_blocks,
                "free_blocks": self.blocks.free_blocks,
                "block_tokens": self.block_tokens,
            },
        }


def _check_params(
    params: dict[str, Any], num_tokens: int, nblocks: int, pool_blocks: int
) -> tuple[str, str, str, int, list[int]]:
    """kv_transfer_params of a remote prefill, checked (they come from the client);
    block ids are checked against this pool's size, which the prefill's must equal."""
    try:
        source = check_name(params["remote_engine_id"])
        request_id, lease = params["remote_request_id"], params["kvx_lease"]
        region, blocks, tokens = params["kvx_region"], params["remote_block_ids"], params["remote_num_tokens"]
    except KeyError as exc:
        raise EngineError(
            400, f"kv_transfer_params lack {exc.args[0]!r}: send what the prefill answered"
        ) from None
    except KvxError as exc:
        raise EngineError(400, f"kv_transfer_params remote_engine_id: {exc}") from None
    for key, value in (("remote_request_id", request_id), ("kvx_lease", lease)):
        if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{32}", value):
            raise EngineError(400, f"kv_transfer_params {key} is not what a prefill returns")
    if not isinstance(region, int) or isinstance(region, bool) or not 0 <= region < 1 << 32:
        raise EngineError(400, "kv_transfer_params kvx_region must be a region id")
    if tokens != num_tokens:
        raise EngineError(
            400, f"kv_transfer_params are for {tokens!r} prompt tokens; this prompt has {num_tokens}"
        )
    if (
        not isinstance(blocks, list)
        or len(blocks) != nblocks
        or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < pool_blocks for b in blocks)
    ):
        raise EngineError(
            400, f"kv_transfer_params remote_block_ids must be {nblocks} block ids below {pool_blocks}"
        )
    return source, request_id, lease, region, blocks


# -- the OpenAI API --------------------------------------------------------------


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if value is None:
        value = DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOKENS:
        raise EngineError(400, f"max_tokens must be 1..{MAX_TOKENS}")
    return value


def _chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineError(400, "messages must be a non-empty list")
    parts = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str):
            raise EngineError(400, "each message needs a string content")
        parts.append(content)
    return "\n".join(parts)


def build_api(engine: SyntheticEngine, draining: threading.Event) -> FastAPI:
    """The engine's OpenAI-compatible FastAPI app."""
    app = FastAPI(title="kvx synthetic engine", docs_url=None, redoc_url=None)
    limiter = anyio.CapacityLimiter(engine.s.max_inflight)

    def error(status: int, message: str, close: bool = False) -> JSONResponse:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        # Connection: close ends a refused body's connection, so the rest of it is not read.
        headers = {"Connection": "close"} if close else None
        return JSONResponse(
            {"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers
        )

    async def read_body(request: Request) -> bytes | None:
        """The body, or None once it passes MAX_BODY_BYTES (announced or sent)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:  # chunked, or longer than it said
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def serve(request: Request, chat: bool) -> Any:
        raw = await read_body(request)
        if raw is None:
            return error(413, f"request body over {MAX_BODY_BYTES} bytes; send less", close=True)
        try:
            # Off the event loop, and refusing a body nested deep enough to recurse the parser out.
            body = await anyio.to_thread.run_sync(parse_object, raw, MAX_JSON_DEPTH)
            prompt = _chat_prompt(body) if chat else body.get("prompt")
            max_tokens = _max_tokens(body)
            params = body.get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                raise EngineError(400, "kv_transfer_params must be an object")
            answer, out = await anyio.to_thread.run_sync(
                engine.complete, prompt, max_tokens, params, limiter=limiter
            )
        except ProtocolError as exc:  # not JSON, not an object, or nested too deep
            return error(400, str(exc))
        except EngineError as exc:
            return error(exc.status, str(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = {"prompt_tokens": None, "completion_tokens": len(answer)}
        if body.get("stream") is True:
            return StreamingResponse(
                _stream(ident, created, engine.model, answer, chat), media_type="text/event-stream"
            )
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": render(answer)},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": render(answer), "finish_reason": "length", "logprobs": None}
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": engine.model,
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": out,
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model, "object": "model", "owned_by": "kvx"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "draining" if draining.is_set() else "ok"}

    return app


def _stream(ident: str, created: int, model: str, answer: list[int], chat: bool) -> Iterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    for i, token in enumerate(answer):
        last = i == len(answer) - 1
        piece = f" t{token}"
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": "length" if last else None}
            if chat
            else {"index": 0, "text": piece, "finish_reason": "length" if last else None}
        )
        chunk = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
