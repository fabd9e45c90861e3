"""KvxConnector push mode: prefill WRITEs each layer into decode's blocks as it is computed.

Both legs of a request go out at once, tied by a push id (``kvx proxy --mode
push`` makes one per request): decode's ``kv_transfer_params`` name prefill's
engine (as in pull mode) and ``kvx.push``; prefill's carry ``kvx_push``.

1. Decode allocates the prompt's blocks and its worker sends each prefill rank
   a ``push_reg`` notification: the push id, decode's block ids, and where
   decode's agents and cache description are (decode's side channel).
2. Prefill's worker checks the registration (the sender is the decode agent
   it names, same compatibility digest and tensor-parallel size, block ids
   within decode's cache, no more blocks than the prompt has) and connects to
   decode's agents. From then on each ``save_kv_layer`` posts a WRITE of that
   layer's blocks touched by the step's chunk; layers computed before the
   registration came are written as soon as it does.
3. When every chunk's every layer has landed, prefill sends ``pushed``; decode
   reports the request received only then, so it never reads a block that was
   not completely written.

Failures: a WRITE that fails or a prefill request that ends without being
computed (abort) sends ``push_abort``, and decode's blocks become load errors
(``kv_load_failure_policy`` decides); so does a prefill agent that is lost or a
push that does not finish within the lease. Decode aborting sends
``push_release``: prefill stops posting, waits for the WRITEs in flight and
answers ``push_released``; only then does decode let vLLM free the blocks.
Prefill holds its blocks until its push is over, or its lease passes.

Only the kvx descriptors decode's agent checks reach decode's memory: region
ids and bounds are checked on decode's side, and prefill builds them from the
cache description decode's side channel serves, never from addresses in a
notification. Push needs equal tensor parallelism on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvx.connectors.kvcache import RankCache, plan_read
from kvx.errors import ConfigError, KvxError, ProtocolError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvx.connectors.vllm.scheduler import KvxScheduler
    from kvx.connectors.vllm.worker import KvxWorker, _RemoteEngine

logger = logging.getLogger(__name__)

PUSH_WIRE_VERSION = 1
PUSH_OPS = ("push_reg", "pushed", "push_abort", "push_release", "push_released")
MAX_PUSH_BLOCKS = 1 << 16  # blocks one registration may name (a 1M-token prompt at block size 16)
MAX_PUSHES = 4096  # pushes one worker tracks at once, registrations waiting for their request included
MAX_FINISHED_IDS = 16384  # recently finished push ids remembered, to refuse late registrations
_PUSH_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def push_id_of(params: dict[str, Any] | None, *, decode: bool) -> str | None:
    """The push id of a request, or None for a pull request (or a malformed id)."""
    if not params:
        return None
    if decode:
        kvx = params.get("kvx")
        value = kvx.get("push") if isinstance(kvx, dict) else None
    else:
        value = params.get("kvx_push")
    if value is None:
        return None
    if not isinstance(value, str) or not _PUSH_ID.fullmatch(value):
        # From a client: refused without raising, which would stop the engine.
        logger.warning("ignoring kv_transfer_params push id %r: 1-128 characters of [A-Za-z0-9_.:-]", value)
        return None
    return value


def push_note(op: str, push_id: str, **fields: Any) -> bytes:
    return json.dumps({"v": PUSH_WIRE_VERSION, "op": op, "push": push_id, **fields}).encode()


def parse_push_note(data: bytes) -> dict[str, Any] | None:
    """A push notification as a dict, None when ``data`` is another kind, ProtocolError when malformed."""
    try:
        d = json.loads(data)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("op") not in PUSH_OPS:
        return None
    if d.get("v") != PUSH_WIRE_VERSION:
        raise ProtocolError(
            f"push notification version {d.get('v')!r}, this engine speaks {PUSH_WIRE_VERSION}"
        )
    if not isinstance(d.get("push"), str) or not _PUSH_ID.fullmatch(d["push"]):
        raise ProtocolError("push notification without a valid push id")
    return d


def warn_if_push(params: dict[str, Any] | None, request_id: str) -> None:
    """An engine in pull mode got a push request: say what to change (the load then fails)."""
    if params and ((isinstance(params.get("kvx"), dict) and "push" in params["kvx"]) or "kvx_push" in params):
        logger.error(
            'request %s is a push request, but this engine runs KvxConnector in "mode": "pull"; '
            'set "mode": "push" in kv_connector_extra_config on both engines, or run kvx proxy '
            "without --mode push",
            request_id,
        )


def check_push_groups(groups: list[dict[str, Any]]) -> None:
    """Push mode moves one full-attention KV-cache group; refuse anything else at startup."""
    if len(groups) != 1 or groups[0]["kind"] != "full":
        kinds = ", ".join(f"{g['kind']} ({g['num_layers']} layers)" for g in groups)
        raise ConfigError(
            f"KvxConnector push mode supports models with one full-attention KV-cache group; this "
            f'model has {len(groups)}: {kinds}. Use "mode": "pull" for it, or start vLLM with '
            "--disable-hybrid-kv-cache-manager (one group; sliding-window layers then keep every block)"
        )


def _wait_s(prefill_lease_s: Any, own_lease_s: float) -> float:
    """How long decode waits for a push: prefill's lease (it gives up then), at most decode's own.
    The value comes from a client's kv_transfer_params: anything but a positive number is ignored."""
    try:
        value = float(prefill_lease_s)
    except (TypeError, ValueError):
        return own_lease_s
    return min(value, own_lease_s) if math.isfinite(value) and value > 0 else own_lease_s


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# Scheduler -> worker.


@dataclasses.dataclass
class PushRecv:
    """Decode: register these local blocks with prefill (empty: nothing to receive, let it free)."""

    request_id: str
    push_id: str
    local_block_ids: list[int]
    params: dict[str, Any]  # prefill's engine, as in pull mode
    me: dict[str, Any]  # this engine's side channel and agents, for prefill to connect back


@dataclasses.dataclass
class PushChunk:
    """Prefill: this step computes prompt tokens [start, end) of a pushed request."""

    request_id: str
    push_id: str
    block_ids: list[int]  # the request's blocks so far
    start: int
    end: int
    num_prompt_tokens: int


@dataclasses.dataclass
class PushMeta:
    recv: list[PushRecv] = dataclasses.field(default_factory=list)
    cancel: list[str] = dataclasses.field(default_factory=list)  # decode: requests that ended
    chunks: list[PushChunk] = dataclasses.field(default_factory=list)
    finished: dict[str, bool] = dataclasses.field(default_factory=dict)  # prefill: request -> aborted
    broken: list[str] = dataclasses.field(default_factory=list)  # prefill: preempted, push fails


class PushScheduler:
    """The scheduler side of push mode, for both roles."""

    def __init__(self, sched: KvxScheduler) -> None:
        if sched.pp_size != 1:
            raise ConfigError(
                f'KvxConnector "mode": "push" needs pipeline_parallel_size 1, not {sched.pp_size}; use "pull"'
            )
        self.sched = sched
        self._meta = PushMeta()
        self._sending: dict[
            str, tuple[str, int, list[int]]
        ] = {}  # prefill: request -> (push, prompt, blocks)
        self._receiving: set[str] = set()  # decode: requests registered, not yet ended
        self._broken: set[str] = set()  # prefill: preempted push requests (no more chunks)

    # Decode.

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """True when ``request`` is a push request (handled here)."""
        params = request.kv_transfer_params
        push_id = push_id_of(params, decode=True)
        if push_id is None or params is None:
            return False
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._meta.recv.append(PushRecv(request.request_id, push_id, list(local), params, self.me()))
        if local:
            self._receiving.add(request.request_id)
        params["do_remote_prefill"] = False
        return True

    def me(self) -> dict[str, Any]:
        from kvx.connectors.vllm.meta import digest

        s = self.sched
        ranks = [s._ranks[r] for r in sorted(s._ranks)]
        return {
            "remote_engine_id": s.engine_id,
            "remote_host": s.cfg.host,
            "remote_port": s._server.port if s._server else None,
            "kvx": {
                "agents": [r.agent_name for r in ranks],
                "epochs": [f"{r.agent_epoch:#x}" for r in ranks],
                "digest": digest(s.compat),
            },
        }

    # Prefill.

    def on_new_request(self, request: Request) -> bool:
        """True for a push request: decode's needs no lease renewal (prefill holds nothing yet)."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            return push_id_of(params, decode=True) is not None
        if not params or not params.get("do_remote_decode"):
            return False
        push_id = push_id_of(params, decode=False)
        if push_id is None:
            return False
        self._sending[request.request_id] = (push_id, int(request.num_prompt_tokens), [])
        return True

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None] | None:
        """Either role's answer for a push request, or None for a pull request.
        ``block_ids`` holds one list per KV-cache group; push mode has one group."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        if rid in self._sending:
            self._sending.pop(rid)
            self._broken.discard(rid)
            aborted = request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            # The worker may have WRITEs in flight from these blocks: it frees them when the push is over.
            if not any(block_ids):
                return False, None
            self._meta.finished[rid] = aborted
            return True, None
        push_id = push_id_of(params, decode=True) if params.get("kvx") else None
        if push_id is None:
            return None
        logger.debug(
            "request %s (push %s) ended: %s, waiting for blocks %s, receiving %s",
            rid,
            push_id,
            request.status,
            bool(params.get("do_remote_prefill")),
            rid in self._receiving,
        )
        if params.get("do_remote_prefill"):
            # Ended before its blocks were allocated: an empty registration lets prefill free its own.
            params["do_remote_prefill"] = False
            self._meta.recv.append(PushRecv(rid, push_id, [], params, self.me()))
        elif rid in self._receiving:
            # vLLM keeps the blocks of a request still waiting for KV until the worker reports it
            # received; the worker does so once prefill confirmed it writes no more.
            self._meta.cancel.append(rid)
        self._receiving.discard(rid)
        return False, None

    def take_meta(self, scheduler_output: SchedulerOutput | None) -> PushMeta:
        if scheduler_output is not None and self._sending:
            self._chunks(scheduler_output)
        meta, self._meta = self._meta, PushMeta()
        return meta

    def _chunks(self, out: SchedulerOutput) -> None:
        computed: dict[str, tuple[int, int]] = {}  # request -> (first token to send, computed before)
        for new in out.scheduled_new_reqs:
            if new.req_id in self._sending:
                self._sending[new.req_id][2][:] = list(new.block_ids[0])
                # From token 0: blocks that hit prefill's prefix cache are not computed, but decode
                # needs them too; they go with the first chunk.
                computed[new.req_id] = (0, new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._sending:
                continue
            if rid in cached.resumed_req_ids or rid in self._broken:
                # Preempted: its blocks were freed (and may be reused) under earlier WRITEs.
                if rid not in self._broken:
                    logger.warning("request %s was preempted; its push fails", rid)
                    self._broken.add(rid)
                    self._meta.broken.append(rid)
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                self._sending[rid][2].extend(new_ids[0])
            computed[rid] = (cached.num_computed_tokens[i], cached.num_computed_tokens[i])
        for rid, (start, done) in computed.items():
            push_id, num_prompt, blocks = self._sending[rid]
            end = min(done + out.num_scheduled_tokens.get(rid, 0), num_prompt)
            if start < end:
                self._meta.chunks.append(PushChunk(rid, push_id, list(blocks), start, end, num_prompt))


# Worker.


@dataclasses.dataclass
class _Send:
    """Prefill: one pushed request."""

    request_id: str
    push_id: str
    num_blocks: int  # the prompt's
    block_ids: list[int] = dataclasses.field(default_factory=list)
    engine: _RemoteEngine | None = None  # decode's, once registered
    decode_agent: str = ""
    decode_blocks: list[int] = dataclasses.field(default_factory=list)
    pending: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)  # (layer, blocks)
    inflight: int = 0
    last_layers: int = -1  # layers saved of the prompt's last chunk (-1: not reached)
    computed: bool = False
    finished: bool = False  # vLLM finished the request: its blocks are ours to free
    over: bool = False  # no more WRITEs will be posted (pushed, aborted or released)
    # "push_released" or "push_abort", sent once no WRITE is in flight: decode frees or reuses
    # its blocks when it gets it, so no WRITE may land after.
    note_when_idle: str = ""
    deadline: float = 0.0


@dataclasses.dataclass
class _Recv:
    """Decode: one request waiting for prefill's WRITEs."""

    request_id: str
    push_id: str
    block_ids: list[int]
    deadline: float
    engine: _RemoteEngine | None = None
    cancelled: bool = False
    registered: bool = False  # the registration went out: a release may follow it
    failing: bool = False  # released because prefill was late: fails once prefill answered
    lease_s: float = 0.0


class PushWorker:
    """The worker side of push mode; ``KvxWorker`` hands it its hooks."""

    def __init__(self, worker: KvxWorker, layer_names: list[str], block_size: int) -> None:
        self.w = worker
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = block_size
        # The worker's lock: what the push decides lands in the worker's sets in the same breath.
        self._lock = worker._lock
        self._sends: dict[str, _Send] = {}  # push id -> state
        self._early: dict[str, tuple[dict[str, Any], str, float]] = {}  # push id -> (reg, peer, expiry)
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        self._recvs: dict[str, _Recv] = {}  # push id -> state
        self._step: list[tuple[_Send, list[int], bool]] = []  # (push, prompt block indices, last chunk)
        self._layer_caches: dict[int, list[RankCache]] = {}
        self._begun: PushMeta | None = None

    # Prefill: each step.

    def begin(self, meta: PushMeta) -> None:
        """The step's chunks, once per step: at its first ``save_kv_layer`` (vLLM starts the
        connector's step after the forward when it loads nothing synchronously)."""
        if meta is self._begun:
            return
        self._begun = meta
        now = time.monotonic()
        step: list[tuple[_Send, list[int], bool]] = []
        early: list[tuple[_Send, dict[str, Any], str]] = []
        with self._lock:
            for c in meta.chunks:
                s = self._sends.get(c.push_id)
                if s is None:
                    if len(self._sends) >= MAX_PUSHES or c.push_id in self._finished_ids:
                        logger.error("push %s: refused (too many pushes, or already finished)", c.push_id)
                        continue
                    s = _Send(c.request_id, c.push_id, prompt_blocks(c.num_prompt_tokens, self.block_size))
                    s.deadline = now + self.w.cfg.lease_s
                    self._sends[c.push_id] = s
                    got = self._early.pop(c.push_id, None)
                    if got is not None:
                        s.decode_agent = got[1]
                        early.append((s, got[0], got[1]))
                if s.request_id != c.request_id:
                    logger.error(
                        "push %s: refused for request %s, it is %s's", c.push_id, c.request_id, s.request_id
                    )
                    continue
                s.block_ids = list(c.block_ids)
                touched = list(range(c.start // self.block_size, prompt_blocks(c.end, self.block_size)))
                step.append((s, touched, c.end >= c.num_prompt_tokens))
            self._step = step
        for s, reg, peer in early:
            self.w._pool.submit(self._register, s, reg, peer)

    def start_step(self, meta: PushMeta) -> None:
        self.begin(meta)
        now = time.monotonic()
        with self._lock:
            for rid in meta.broken:
                s = self._by_request(rid)
                if s is not None and not s.over:
                    self._abort(s, "the prefill request was preempted")
                    self._check(s)
            for rid, aborted in meta.finished.items():
                s = self._by_request(rid)
                if s is None:
                    self.w._report(self.w._done_send, rid)  # nothing in flight (never computed here)
                    continue
                s.finished = True
                s.deadline = now + self.w.cfg.lease_s
                if aborted and not s.over:
                    self._abort(s, "the prefill request ended before its prompt was computed")
                self._check(s)
        self.start_recv(meta)

    def _by_request(self, request_id: str) -> _Send | None:
        return next((x for x in self._sends.values() if x.request_id == request_id), None)

    def save_layer(self, meta: PushMeta, layer_name: str, kv_layer: Any) -> None:
        self.begin(meta)
        layer = self.layer_index.get(layer_name)
        if layer is None or not self._step:
            return
        if getattr(kv_layer, "is_cuda", False):
            import torch

            # The layer's KV is written by kernels still queued: WRITEs must see it landed.
            torch.cuda.current_stream().synchronize()
        posts: list[tuple[_Send, list[int]]] = []
        with self._lock:
            for s, touched, last in self._step:
                if s.over:
                    continue
                if s.engine is None:
                    s.pending.append((layer, touched))
                else:
                    posts.append((s, touched))
                    s.inflight += 1
                if last:
                    s.last_layers = max(s.last_layers, 0) + 1
                    s.computed = s.last_layers >= len(self.layer_index)
        for s, touched in posts:
            self._write(s, layer, touched)

    def end_step(self) -> None:
        with self._lock:
            for s, _, _ in self._step:
                self._check(s)
            self._step = []

    def _write(self, s: _Send, layer: int, touched: list[int]) -> None:
        """Post one layer's WRITE; ``s.inflight`` already counts it."""
        try:
            assert s.engine is not None and len(self.w.caches) == 1  # check_push_groups
            skip = s.num_blocks - len(s.decode_blocks)
            pairs = [(s.block_ids[j], s.decode_blocks[j - skip]) for j in touched if j >= skip]
            if not pairs:
                self._written(s, None)
                return
            caches = self._per_layer(s.engine)
            cache = self.w.caches[0]
            mine = dataclasses.replace(cache, layers=(cache.layers[layer],))
            plans = plan_read(
                mine,
                self.w.tp_rank,
                self.w.tp_size,
                caches[layer],
                s.engine.tp_size,
                self.w.total_heads,
                [a for a, _ in pairs],
                [b for _, b in pairs],
                replicated=self.w.use_mla,
            )
            ((rank, (local, remote)),) = plans.items()  # equal tensor parallelism: one peer
            count = len(local)
            t = s.engine.peers[rank].write(local, remote)
            t.add_done_callback(lambda t: self._written(s, t.error, t, count))
        except Exception as exc:
            self._written(s, exc)

    def _written(self, s: _Send, error: BaseException | None, t: Any = None, count: int = 0) -> None:
        with self._lock:
            s.inflight -= 1
            if t is not None:
                if error is None:
                    self.w._stats.record_transfer(t.duration_s or 0.0, t.bytes, count)
                else:
                    self.w._stats.record_failed_transfer()
            if error is not None and not s.over:
                self._abort(s, f"a WRITE failed: {error}")
            self._check(s)

    def _per_layer(self, engine: _RemoteEngine) -> list[RankCache]:
        key = id(engine)
        caches = self._layer_caches.get(key)
        if caches is None:
            (cache,) = engine.caches  # one group, as _check_registration checked
            caches = [dataclasses.replace(cache, layers=(g,)) for g in cache.layers]
            self._layer_caches[key] = caches
        return caches

    def _check(self, s: _Send) -> None:
        """Under the lock: finish the push when its last WRITE landed; free once vLLM is done too."""
        if s.note_when_idle and s.inflight == 0:
            self._send_note(s, push_note(s.note_when_idle, s.push_id))
            s.note_when_idle = ""
        if not s.over and s.engine is not None and s.computed and not s.pending and s.inflight == 0:
            s.over = True
            if s.decode_blocks:  # an empty registration waits for nothing
                self._send_note(s, push_note("pushed", s.push_id))
        if s.over and s.inflight == 0 and s.finished and self._sends.get(s.push_id) is s:
            del self._sends[s.push_id]
            self._remember(s.push_id)
            self.w._report(self.w._done_send, s.request_id)

    def _abort(self, s: _Send, why: str) -> None:
        """Under the lock: no more WRITEs; decode hears of it once those in flight landed."""
        logger.error("push %s (request %s): %s; decode will not use it", s.push_id, s.request_id, why)
        s.over = True
        s.pending.clear()
        s.note_when_idle = "push_abort"

    def _send_note(self, s: _Send, data: bytes) -> None:
        if s.engine is None:
            return
        peer = s.engine.peers.get(self.w.tp_rank)
        if peer is None:
            return
        try:
            peer.notify(data)
        except KvxError as exc:
            logger.warning("push %s: cannot notify decode: %s", s.push_id, exc)

    def _notify_peer(self, name: str, data: bytes) -> None:
        assert self.w.agent is not None
        try:
            self.w.agent.peer(name).notify(data)
        except KvxError as exc:
            logger.warning("cannot notify %s: %s", name, exc)

    def _remember(self, push_id: str) -> None:
        self._finished_ids[push_id] = None
        while len(self._finished_ids) > MAX_FINISHED_IDS:
            self._finished_ids.popitem(last=False)

    def expire(self) -> None:
        """Called each step: leases and waits that ran out."""
        now = time.monotonic()
        with self._lock:
            for push_id, (_, _, expiry) in list(self._early.items()):
                if now >= expiry:
                    del self._early[push_id]
            for s in list(self._sends.values()):
                if now >= s.deadline and not s.over:
                    self._abort(s, "not pushed within the lease")
                    self.w._stats.record_kv_expired_req()
                self._check(s)
            for r in list(self._recvs.values()):
                lost = r.engine is not None and not r.engine.peers[self.w.tp_rank].alive
                if not lost and now < r.deadline:
                    continue
                if not lost and not r.cancelled and r.engine is not None:
                    # Prefill is alive but late: ask it to stop, and give up only once it said it
                    # writes no more (or after one more transfer timeout).
                    logger.warning("push %s: prefill did not push within the lease; releasing it", r.push_id)
                    r.cancelled, r.failing = True, True
                    r.deadline = now + self.w.cfg.transfer_timeout_s
                    self._notify(r.engine, push_note("push_release", r.push_id))
                    continue
                del self._recvs[r.push_id]
                self._ended(r, "prefill's agent is lost" if lost else "prefill did not answer a release")

    # Notifications, both roles.

    def on_note(self, notification: Any) -> bool:
        """True when the notification was a push one (handled or refused here)."""
        try:
            d = parse_push_note(notification.data)
        except ProtocolError as exc:
            logger.warning("refusing a notification from %s: %s", notification.peer, exc)
            return True
        if d is None:
            return False
        op, push_id, peer = d["op"], d["push"], str(notification.peer)
        if op == "push_reg":
            self._on_register(d, push_id, peer)
            return True
        with self._lock:
            if op == "push_release":
                s = self._sends.get(push_id)
                early = self._early.get(push_id)
                if s is None and early is not None and early[1] == peer:
                    # Its request has not started here: it never will be pushed.
                    del self._early[push_id]
                    self._remember(push_id)
                    self._notify_peer(peer, push_note("push_released", push_id))
                    logger.info("push %s: decode released it before it started", push_id)
                    return True
                if s is None or s.decode_agent != peer:
                    logger.warning("refusing push_release for unknown push %s from %s", push_id, peer)
                    return True
                if not s.over:
                    logger.info("push %s: decode released it; stopping", push_id)
                s.over = True
                s.pending.clear()
                s.note_when_idle = "push_released"
                self._check(s)
                return True
            r = self._recvs.get(push_id)
            if r is None or r.engine is None or r.engine.peers[self.w.tp_rank].name != peer:
                logger.warning("refusing %s for unknown or finished push %s from %s", op, push_id, peer)
                return True
            del self._recvs[push_id]
            if op == "pushed" and not r.failing:
                logger.debug("push %s: every layer landed", push_id)
                self.w._report(self.w._done_recv, r.request_id)
            else:
                self._ended(r, "prefill aborted the push" if op == "push_abort" else "released")
        return True

    def _ended(self, r: _Recv, why: str) -> None:
        """Under the lock: prefill writes no more into ``r``'s blocks (or cannot)."""
        if r.cancelled and not r.failing:
            self.w._report(self.w._done_recv, r.request_id)  # vLLM ended the request: its blocks may go
        else:
            self._fail(r, "prefill did not push within the lease" if r.failing else why)

    def _on_register(self, d: dict[str, Any], push_id: str, peer: str) -> None:
        with self._lock:
            if push_id in self._finished_ids:
                logger.warning(
                    "refusing a registration of %s blocks for finished push %s from %s",
                    len(d.get("blocks") or ()),
                    push_id,
                    peer,
                )
                self._notify_peer(peer, push_note("push_abort", push_id))  # decode fails at once
                return
            s = self._sends.get(push_id)
            if s is None:
                # Its prefill request has not been scheduled yet (both legs race): keep it a while.
                if len(self._early) >= MAX_PUSHES or push_id in self._early:
                    logger.warning("refusing a registration for push %s from %s", push_id, peer)
                    self._notify_peer(peer, push_note("push_abort", push_id))
                    return
                self._early[push_id] = (d, peer, time.monotonic() + self.w.cfg.lease_s)
                logger.debug("push %s: registration from %s waits for its request", push_id, peer)
                return
            if s.engine is not None or s.decode_agent:
                logger.warning("refusing a second registration for push %s from %s", push_id, peer)
                if s.decode_agent != peer:
                    self._notify_peer(peer, push_note("push_abort", push_id))
                return
            s.decode_agent = peer  # claimed; checked against decode's side channel below
        self.w._pool.submit(self._register, s, d, peer)

    def _register(self, s: _Send, d: dict[str, Any], peer: str) -> None:
        try:
            engine, blocks = self._check_registration(s, d, peer)
        except Exception as exc:
            logger.error("push %s: refusing the registration from %s: %s", s.push_id, peer, exc)
            with self._lock:
                s.decode_agent = peer
                self._abort(s, f"bad registration: {exc}")
                self._notify_peer(peer, push_note("push_abort", s.push_id))  # decode fails at once
                self._check(s)
            return
        with self._lock:
            s.decode_agent = peer
            if s.over:
                return
            s.engine, s.decode_blocks = engine, blocks
            pending, s.pending = s.pending, []
            s.inflight += len(pending)
        logger.debug("push %s: decode %s registered %d blocks", s.push_id, peer, len(blocks))
        for layer, touched in pending:
            self._write(s, layer, touched)
        with self._lock:
            self._check(s)

    def _check_registration(self, s: _Send, d: dict[str, Any], peer: str) -> tuple[_RemoteEngine, list[int]]:
        to, blocks = d.get("decode"), d.get("blocks")
        if not isinstance(to, dict) or not isinstance(to.get("kvx"), dict):
            raise ProtocolError("no decode engine in the registration")
        if not isinstance(blocks, list) or len(blocks) > min(MAX_PUSH_BLOCKS, s.num_blocks):
            raise ProtocolError(f"the registration names more blocks than the prompt's {s.num_blocks}")
        engine = self.w._remote_engine(to)
        if engine.tp_size != self.w.tp_size:
            raise ConfigError(
                f"push needs equal tensor parallelism: decode has {engine.tp_size} ranks, prefill "
                f"{self.w.tp_size}; use pull mode between them"
            )
        if engine.peers[self.w.tp_rank].name != peer:
            raise ProtocolError(f"sent by {peer}, not by decode rank {self.w.tp_rank}'s agent")
        if len(engine.caches) != 1:
            raise ConfigError(f"decode has {len(engine.caches)} KV-cache groups; push mode moves one")
        cache = engine.caches[0]
        if len(cache.layers) != len(self.layer_index):
            raise ConfigError(f"decode has {len(cache.layers)} layers, prefill {len(self.layer_index)}")
        out = []
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < cache.num_blocks:
                raise ProtocolError(f"block id {b!r} outside decode's {cache.num_blocks} blocks")
            out.append(b)
        if len(set(out)) != len(out):
            raise ProtocolError("the registration names a block twice")
        return engine, out

    # Decode.

    def start_recv(self, meta: PushMeta) -> None:
        with self._lock:
            for rid in meta.cancel:
                r = next((x for x in self._recvs.values() if x.request_id == rid), None)
                if r is not None and not r.cancelled:
                    r.cancelled = True
                    # Until prefill answers: its WRITEs may still come, so the blocks stay ours.
                    r.deadline = time.monotonic() + r.lease_s
                    if (
                        r.registered and r.engine is not None
                    ):  # else the registration's sender releases right after it
                        self.w._pool.submit(self._notify, r.engine, push_note("push_release", r.push_id))
        for recv in meta.recv:
            self.w._pool.submit(self._send_registration, recv)

    def _send_registration(self, recv: PushRecv) -> None:
        r = None
        try:
            engine = self.w._remote_engine(recv.params)
            if engine.tp_size != self.w.tp_size:
                raise ConfigError(
                    f"push needs equal tensor parallelism: prefill has {engine.tp_size} ranks, decode "
                    f"{self.w.tp_size}; use pull mode between them"
                )
            if recv.local_block_ids:
                with self._lock:
                    if len(self._recvs) >= MAX_PUSHES or recv.push_id in self._recvs:
                        raise ConfigError(
                            f"push {recv.push_id}: too many pushes, or a second one with its id"
                        )
                    lease_s = _wait_s(recv.params["kvx"].get("lease_s"), self.w.cfg.lease_s)
                    r = _Recv(recv.request_id, recv.push_id, list(recv.local_block_ids), 0.0, engine)
                    r.lease_s = lease_s + self.w.cfg.transfer_timeout_s
                    r.deadline = time.monotonic() + r.lease_s
                    self._recvs[recv.push_id] = r
            data = push_note("push_reg", recv.push_id, blocks=recv.local_block_ids, decode=recv.me)
            # Notes to one peer arrive in order: a release sent after this one follows it there.
            engine.peers[self.w.tp_rank].notify(data).wait(self.w.cfg.connect_timeout_s)
            if r is not None:
                with self._lock:
                    r.registered = True
                    release = r.cancelled
                if release:
                    self._notify(engine, push_note("push_release", r.push_id))
        except Exception as exc:
            if recv.local_block_ids:
                with self._lock:
                    if r is not None:
                        self._recvs.pop(recv.push_id, None)
                    self._fail_ids(recv.request_id, recv.local_block_ids, f"registration failed: {exc}")

    def _fail(self, r: _Recv, why: str) -> None:
        self._fail_ids(r.request_id, r.block_ids, why)

    def _fail_ids(self, request_id: str, block_ids: list[int], why: str) -> None:
        """Under the lock: the request's blocks become load errors, vLLM's policy decides.
        Counted as a failed transfer of decode's (in pull mode its READ would have failed)."""
        logger.error("request %s: push failed: %s", request_id, why)
        if request_id not in self.w._failed_recv:
            self.w._stats.record_failed_transfer()
        self.w._report(self.w._failed_recv, request_id)
        self.w._load_errors.update(block_ids)

    def _notify(self, engine: _RemoteEngine, data: bytes) -> None:
        try:
            engine.peers[self.w.tp_rank].notify(data)
        except KvxError as exc:
            logger.debug("push notification failed: %s", exc)
