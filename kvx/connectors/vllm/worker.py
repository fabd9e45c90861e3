"""KvxConnector, worker side: one kvx agent per rank moves the blocks.

Decode reads a request's blocks from the prefill ranks that hold its heads,
in one transfer per prefill rank, with a "done" notification on each; a
failure (side channel, handshake, epoch, compatibility, transfer) makes the
request a failed receive and its blocks load errors, so vLLM's
``kv_load_failure_policy`` decides. Prefill holds a finished request's
blocks until every decode rank said "done" (or "release"), or the lease,
renewed by decode while it waits, runs out.

A model with several KV-cache groups (sliding-window and full-attention
layers under vLLM's hybrid allocator) is described per group: each group's
layers with its own block ids, in one read per prefill rank.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.agent import Agent, Peer
from kvx.config import NAME_RE, Timeouts, read_file
from kvx.connectors import side_channel
from kvx.connectors.kvcache import RankCache, layer_geometry, plan_read
from kvx.connectors.vllm.config import KvxConnectorConfig
from kvx.connectors.vllm.meta import (
    NULL_BLOCK_ID,
    KvxConnectorMetadata,
    KvxHandshakeMetadata,
    RecvRequest,
    cache_groups,
    check_compat,
    compat_fields,
    digest,
    note,
    parse_note,
)
from kvx.connectors.vllm.push import PushWorker, check_push_groups
from kvx.descs import Descs
from kvx.errors import ConfigError, EpochError, KvxError, PeerLostError, ProtocolError
from kvx.metadata.client import MAX_LOOKUPS_PER_CALL, MetadataOptions
from kvx.transfer import Transfer

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvx.connectors.vllm.stats import KvxConnectorStats

logger = logging.getLogger(__name__)

MAX_EARLY_NOTES = 65536
# How long a step that computes nothing waits in get_finished for a transfer to finish.
IDLE_WAIT_S = 0.01


@dataclasses.dataclass
class _Held:
    deadline: float
    done: int = 0  # "done" notes received
    expected: int = 1  # decode ranks that will send one (decode's tp size)
    released: bool = False


@dataclasses.dataclass
class _RemoteEngine:
    engine_id: str
    tp_size: int
    caches: list[RankCache]  # per KV-cache group
    peers: dict[int, Peer]


class KvxWorker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        cfg: KvxConnectorConfig,
        engine_id: str,
        layout: str | None,
    ) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from kvx.connectors.vllm.stats import KvxConnectorStats

        self.cfg = cfg
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        kv = vllm_config.kv_transfer_config
        self.role = (
            "prefill"
            if kv.is_kv_producer and not kv.is_kv_consumer
            else ("decode" if kv.is_kv_consumer and not kv.is_kv_producer else "both")
        )
        self.groups = cache_groups(kv_cache_config)
        if cfg.mode == "push":
            check_push_groups(self.groups)
        self.compat = compat_fields(vllm_config, layout, kv_cache_config)
        self.use_mla = bool(vllm_config.model_config.use_mla)
        self.total_heads = self.compat["num_kv_heads"]
        self.agent: Agent | None = None
        self.caches: list[RankCache] = []  # per KV-cache group, once registered
        self._lock = threading.Lock()
        # Notified when a request joins one of the finished sets: an idle step waits on it.
        self._progress = threading.Condition(self._lock)
        self._idle_step = False
        self._reported = False  # the last get_finished reported something
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._done_send: set[str] = set()
        # What moved since vLLM last asked; guarded by _lock and recorded before the request
        # is reported finished, so a request's numbers reach vLLM no later than its completion.
        self._stats = KvxConnectorStats()
        self._held: dict[str, _Held] = {}
        # Notes that came before the scheduler told us of the hold: request -> (notes so far, expiry).
        self._early: dict[str, tuple[_Held, float]] = {}
        self._metadata_client: Any = None
        self._metadata_reader: Any = None  # a read replica (metadata_read), else the same client
        self._engines: dict[tuple[str, tuple[str, ...]], _RemoteEngine] = {}
        # engine id -> [its connect lock, threads holding or waiting for it]: an entry lives
        # while a connect to that engine is under way (engine ids come from the network).
        self._engine_locks: dict[str, list[Any]] = {}
        self._engine_locks_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kvx-recv")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.push: PushWorker | None = None  # push mode, once the caches are registered

    # Registration.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        port = cfg.agent_port + self.tp_rank if cfg.agent_port else 0
        io_s = min(10.0, cfg.transfer_timeout_s)
        self.agent = Agent(
            f"vllm-{self.engine_id}-tp{self.tp_rank}",
            listen=f"{cfg.host}:{port}",
            auth_secret=cfg.auth_secret(),
            allow_insecure=cfg.allow_insecure,
            streams=cfg.streams,
            backend=cfg.backend,
            timeouts=Timeouts(connect_s=cfg.connect_timeout_s, io_s=io_s, transfer_s=cfg.transfer_timeout_s),
            on_notify=self._on_note,
            metadata=cfg.metadata,
            role=self.role,
            labels={"engine_id": self.engine_id, "tp_rank": str(self.tp_rank)},
            engine_info={
                "engine": "vllm",
                "engine_id": self.engine_id,
                "tp_size": str(self.tp_size),
                **({"api_url": cfg.api_url} if cfg.api_url else {}),
            },
            metadata_options=self._metadata_options() if cfg.metadata else None,
        )
        self.caches = self._describe(kv_caches)
        if cfg.mode == "push":
            assert self.kv_cache_config is not None  # _describe checked it
            names = [n for n in self.kv_cache_config.kv_cache_groups[0].layer_names if n in kv_caches]
            self.push = PushWorker(self, names, self.block_size)
        if cfg.metadata:
            import json

            self.agent.update_engine_info(
                {
                    "tp_rank": str(self.tp_rank),
                    "kvx_cache": json.dumps(self._cache_doc()),
                    "kvx_compat": json.dumps(self.compat),
                }
            )
        logger.info(
            "kvx agent %s: %s layers x %d blocks registered in %d KV-cache group(s) (%d heads, %d planes)",
            self.agent.name,
            "+".join(str(len(c.layers)) for c in self.caches),
            self.caches[0].num_blocks,
            len(self.caches),
            self.caches[0].num_heads,
            self.caches[0].planes,
        )

    def _metadata_options(self) -> MetadataOptions:
        token = None
        if self.cfg.metadata_token_file:
            token = read_file(self.cfg.metadata_token_file).decode().strip()
        return MetadataOptions(token=token, read_target=self.cfg.metadata_read)

    def _describe(self, kv_caches: dict[str, torch.Tensor]) -> list[RankCache]:
        """One RankCache per KV-cache group; under the hybrid allocator the groups' layers
        share tensors (one layer of each group per tensor) and one block id space."""
        assert self.agent is not None and self.kv_cache_config is not None  # cache_groups checked it
        num_blocks = self.kv_cache_config.num_blocks
        regions: dict[int, int] = {}  # storage address -> region id
        caches = []
        for group in self.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            heads = 1 if self.use_mla else int(spec.num_kv_heads)
            unit_elems = int(spec.block_size) * int(spec.head_size)
            layers = []
            for name in [n for n in group.layer_names if n in kv_caches]:
                t = kv_caches[name]
                storage = t.untyped_storage()
                base = storage.data_ptr()
                if base not in regions:
                    regions[base] = self.agent.register((base, storage.nbytes())).id
                layers.append(
                    layer_geometry(
                        t.shape,
                        t.stride(),
                        t.element_size(),
                        t.data_ptr() - base,
                        regions[base],
                        num_blocks,
                        heads,
                        unit_elems,
                    )
                )
            if not layers:
                raise ConfigError(f"no KV cache tensor registered for any layer of {group.layer_names[:3]}")
            planes = len(layers[0].unit_offsets) // heads
            caches.append(RankCache(tuple(layers), num_blocks, heads, planes))
        return caches

    def _cache_doc(self) -> dict[str, Any]:
        return {"groups": [c.to_json() for c in self.caches]}

    def handshake_metadata(self) -> KvxHandshakeMetadata | None:
        if self.agent is None or not self.caches:
            return None
        return KvxHandshakeMetadata(
            self.tp_rank, self.agent.name, self.agent.epoch, self.agent.metadata(), self._cache_doc()
        )

    # Each step.

    def start_step(self, meta: KvxConnectorMetadata) -> None:
        self._idle_step = meta.idle
        if self.push is not None and meta.push is not None:
            self.push.start_step(meta.push)
        now = time.monotonic()
        with self._lock:
            for req_id, lease_s in meta.hold.items():
                early = self._early.pop(req_id, None)
                held = early[0] if early is not None else _Held(0.0)
                held.deadline = now + lease_s
                self._held[req_id] = held
                self._check_done(req_id)
        for req in meta.recv:
            logger.debug(
                "request %s: %s %d blocks from engine %s",
                req.request_id,
                "release" if req.release_only else "read",
                sum(b != NULL_BLOCK_ID for g in req.local_block_ids for b in g),
                req.params.get("remote_engine_id"),
            )
            self._pool.submit(self._receive, req)
        if meta.renew:
            self._pool.submit(self._renew, meta.renew)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        if self.push is not None:
            self.push.expire()
        now = time.monotonic()
        with self._lock:
            for req_id, held in list(self._held.items()):
                if now >= held.deadline:
                    logger.warning(
                        "request %s: decode did not read its blocks within the lease; freeing them", req_id
                    )
                    del self._held[req_id]
                    self._report(self._done_send, req_id)
                    self._stats.record_kv_expired_req()
            for req_id, (_, expiry) in list(self._early.items()):
                if now >= expiry:
                    del self._early[req_id]
            idle, self._idle_step = self._idle_step, False  # at most once per step
            if idle and not self._reported and not (self._done_send or self._done_recv or self._failed_recv):
                # vLLM steps without pause while a request waits for its KV (or decode for
                # prefill's blocks), even with nothing to compute: a step that computes nothing
                # waits here for the next transfer to finish, up to IDLE_WAIT_S, instead of
                # spinning a core that a prefill on this host could use. Not right after a step
                # that reported something: with async scheduling the next step was scheduled
                # (empty) before vLLM saw that report, and the request runs one step later.
                self._progress.wait(IDLE_WAIT_S)
            sending, recving, failed = self._done_send, self._done_recv, self._failed_recv
            self._done_send, self._done_recv, self._failed_recv = set(), set(), set()
            self._reported = bool(sending or recving or failed)
        if sending or recving or failed:
            logger.debug(
                "finished sending %s, receiving %s, failed %s",
                sorted(sending),
                sorted(recving),
                sorted(failed),
            )
        return sending, recving | failed, failed

    def _report(self, finished: set[str], req_id: str) -> None:
        """Under the lock: ``req_id`` joins a finished set; an idle step waiting for it wakes."""
        finished.add(req_id)
        self._progress.notify_all()

    def take_stats(self) -> KvxConnectorStats | None:
        """The stats since the last call (None when nothing happened); they start over."""
        with self._lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # Prefill: notifications from decode ranks.

    def _on_note(self, notification: Any) -> None:
        if self.push is not None and self.push.on_note(notification):
            return
        try:
            op, req_id, n = parse_note(notification.data)
        except ConfigError as exc:
            logger.warning("ignoring a notification from %s: %s", notification.peer, exc)
            return
        logger.debug("note %s for request %s from %s", op, req_id, notification.peer)
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                early = self._early.get(req_id)
                if early is None:
                    if op == "renew" or len(self._early) >= MAX_EARLY_NOTES:
                        return
                    early = (_Held(0.0), time.monotonic() + 2 * self.cfg.lease_s)
                    self._early[req_id] = early
                held = early[0]
            if op == "renew":
                held.deadline = max(held.deadline, time.monotonic() + self.cfg.lease_s)
            elif op == "release":
                held.released = True
            else:
                held.done += 1
                held.expected = n
            if req_id in self._held:
                self._check_done(req_id)

    def _check_done(self, req_id: str) -> None:
        held = self._held[req_id]
        if held.released or held.done >= held.expected:
            del self._held[req_id]
            self._report(self._done_send, req_id)

    # Decode: reading a request's blocks.

    def _receive(self, req: RecvRequest) -> None:
        params = req.params
        try:
            engine = self._remote_engine(params)
            remote_id = str(params["remote_request_id"])
            if req.release_only:
                self._notify_all(engine, note("release", remote_id, self.tp_size))
                return
            lease_s = float(params["kvx"].get("lease_s", 0))
            if lease_s and lease_s < self.cfg.connect_timeout_s + self.cfg.transfer_timeout_s:
                logger.warning(
                    "prefill's lease (%ss) is shorter than this engine's connect_timeout_s + "
                    "transfer_timeout_s: a slow read could outlive it",
                    lease_s,
                )
            self._read(req, engine, remote_id)
        except Exception as exc:  # every failure becomes a failed receive, never a stuck request
            if not req.release_only:
                with self._lock:
                    self._stats.record_failed_transfer()  # failed before its read was posted
            self._fail(req, exc)

    def _read(self, req: RecvRequest, engine: _RemoteEngine, remote_id: str) -> None:
        assert self.caches
        pairs = _block_pairs(req.local_block_ids, req.params["remote_block_ids"], engine.caches[0].num_blocks)
        if not any(local for local, _ in pairs):
            self._notify_all(engine, note("done", remote_id, self.tp_size))
            self._succeed(req)
            return
        plans: dict[int, tuple[Descs, Descs]] = {}
        for g, (local_blocks, remote_blocks) in enumerate(pairs):
            if not local_blocks:
                continue
            group_plans = plan_read(
                self.caches[g],
                self.tp_rank,
                self.tp_size,
                engine.caches[g],
                engine.tp_size,
                self.total_heads,
                local_blocks,
                remote_blocks,
                replicated=self.use_mla,
            )
            for rank, (local, remote) in group_plans.items():
                if rank in plans:
                    local = Descs(np.concatenate([plans[rank][0].array, local.array]))
                    remote = Descs(np.concatenate([plans[rank][1].array, remote.array]))
                plans[rank] = (local, remote)
        done_note = note("done", remote_id, self.tp_size)
        renew_note = note("renew", remote_id, self.tp_size)
        transfers: list[Transfer] = []
        descriptors: dict[int, int] = {}  # id(transfer) -> its descriptor count, for the stats
        for rank, (local, remote) in plans.items():
            # Renew the lease just ahead of the read (on one stream, prefill handles it first), so
            # the blocks cannot be freed under the read unless the read outlives a whole lease.
            engine.peers[rank].notify(renew_note)
            transfers.append(engine.peers[rank].read(local, remote, notify=done_note))
            descriptors[id(transfers[-1])] = len(local)
        for rank, peer in engine.peers.items():
            if rank not in plans:
                peer.notify(done_note)
        pending = [len(transfers)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def finished(t: Transfer) -> None:
            with self._lock:
                if t.error is None:
                    self._stats.record_transfer(t.duration_s or 0.0, t.bytes, descriptors[id(t)])
                else:
                    self._stats.record_failed_transfer()
            with lock:
                if t.error is not None:
                    errors.append(t.error)
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                if errors:
                    self._fail(req, errors[0])
                else:
                    self._succeed(req)

        for t in transfers:
            t.add_done_callback(finished)

    def _succeed(self, req: RecvRequest) -> None:
        logger.debug("request %s: KV loaded", req.request_id)
        with self._lock:
            self._report(self._done_recv, req.request_id)

    def _fail(self, req: RecvRequest, exc: BaseException) -> None:
        logger.error(
            "request %s: KV load from engine %s failed: %s",
            req.request_id,
            req.params.get("remote_engine_id"),
            exc,
        )
        if req.release_only:
            return
        with self._lock:
            self._report(self._failed_recv, req.request_id)
            # Block ids are unique only within a group: with several groups vLLM cannot map
            # them back to requests and stops the engine on any; the request alone says it.
            if len(req.local_block_ids) == 1:
                self._load_errors.update(int(b) for b in req.local_block_ids[0] if b != NULL_BLOCK_ID)
        # Let prefill free the blocks now rather than at the lease's end (best effort), from the
        # pool: _fail runs in a transfer's done-callback, on the thread that reads that peer's
        # answers, and waiting there for the notify's answer would block it until a timeout.
        try:
            engine = self._engines_for(req.params)
            if engine is not None:
                release = note("release", str(req.params["remote_request_id"]), self.tp_size)
                self._pool.submit(self._notify_all, engine, release)
        except Exception:
            pass  # the pool is shut down: the engine is stopping

    def _renew(self, waiting: list[dict[str, Any]]) -> None:
        for params in waiting:
            try:
                engine = self._remote_engine(params)
                self._notify_all(engine, note("renew", str(params["remote_request_id"]), self.tp_size))
            except Exception as exc:
                logger.debug("lease renewal for %s failed: %s", params.get("remote_request_id"), exc)

    def _notify_all(self, engine: _RemoteEngine, data: bytes) -> None:
        for peer in engine.peers.values():
            peer.notify(data).wait()

    # Decode: finding and checking a prefill engine.

    def _engines_for(self, params: dict[str, Any]) -> _RemoteEngine | None:
        key = (str(params["remote_engine_id"]), tuple(params["kvx"]["epochs"]))
        return self._engines.get(key)

    def _remote_engine(self, params: dict[str, Any]) -> _RemoteEngine:
        engine_id = str(params["remote_engine_id"])
        kvx = params["kvx"]
        key = (engine_id, tuple(str(e) for e in kvx["epochs"]))
        engine = self._engines.get(key)
        if engine is not None and all(p.alive for p in engine.peers.values()):
            return engine
        with self._engine_locks_lock:
            entry = self._engine_locks.setdefault(engine_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                engine = self._engines.get(key)
                if engine is not None and all(p.alive for p in engine.peers.values()):
                    return engine
                engine = self._connect(params)
                with self._engine_locks_lock:  # connects to other engines change it too
                    # A restarted prefill engine has new epochs: forget the old one.
                    for old in [k for k in self._engines if k[0] == engine_id]:
                        del self._engines[old]
                    self._engines[key] = engine
                return engine
        finally:
            with self._engine_locks_lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._engine_locks[engine_id]

    def _engine_doc(self, params: dict[str, Any]) -> dict[str, Any]:
        """Prefill's ranks, from the metadata service when one is configured, else its side channel."""
        if not self.cfg.metadata:
            return side_channel.fetch(
                str(params["remote_host"]), int(params["remote_port"]), self.cfg.connect_timeout_s
            )
        import json

        from kvx.metadata.client import MetadataClient, read_many_through

        if self._metadata_client is None:
            client = MetadataClient(self.cfg.metadata, self._metadata_options())
            reader = (
                MetadataClient(self.cfg.metadata_read, self._metadata_options(), reader=True)
                if self.cfg.metadata_read
                else client
            )
            self._metadata_reader = reader  # before the client: a thread that sees the client sees it
            self._metadata_client = client
        ranks: list[Any] = []
        info: dict[str, Any] = {}
        epochs = [str(e) for e in params["kvx"].get("epochs", ())]
        names = params["kvx"]["agents"]
        if (
            not isinstance(names, list)
            or not 0 < len(names) <= MAX_LOOKUPS_PER_CALL
            or not all(isinstance(name, str) and NAME_RE.fullmatch(name) for name in names)
        ):
            if not isinstance(names, list):
                got = f"a {type(names).__name__}"
            elif not 0 < len(names) <= MAX_LOOKUPS_PER_CALL:
                got = f"{len(names)} entries"
            else:
                got = "an entry that is not an agent name"
            raise ProtocolError(
                f"kv_transfer_params' kvx.agents must list 1 to {MAX_LOOKUPS_PER_CALL} valid agent "
                f"names (one per prefill rank); it has {got}"
            )
        # One GetAgents call for every rank.
        records = read_many_through(self._metadata_reader, self._metadata_client, names)
        if self._metadata_reader is not self._metadata_client:
            # Another epoch than the request names: a read replica may not have copied a
            # restart of a moment ago; the service itself has the last word.
            stale = [
                i
                for i, record in enumerate(records)
                if record is not None and i < len(epochs) and f"{record.epoch:#x}" != epochs[i]
            ]
            if stale:
                fresh = self._metadata_client.get_many([names[i] for i in stale])
                for i, record in zip(stale, fresh, strict=True):
                    records[i] = record
        for name, record in zip(names, records, strict=True):
            if record is None:
                raise PeerLostError(
                    f"prefill agent {name!r} is not registered in the metadata service "
                    f"{self.cfg.metadata} (it stopped or its lease ran out)"
                )
            info = dict(record.engine_info)
            ranks.append(
                {
                    "tp_rank": int(info.get("tp_rank", len(ranks))),
                    "agent_epoch": record.epoch,
                    "agent_metadata": base64.b64encode(record.metadata.SerializeToString()).decode(),
                    "cache": json.loads(info.get("kvx_cache", "null")),
                }
            )
        return {
            "engine_id": info.get("engine_id"),
            "tp_size": int(info.get("tp_size", len(ranks))),
            "compat": json.loads(info.get("kvx_compat", "null")),
            "ranks": ranks,
        }

    def _connect(self, params: dict[str, Any]) -> _RemoteEngine:
        assert self.agent is not None
        kvx = params["kvx"]
        engine_id = str(params["remote_engine_id"])
        doc = self._engine_doc(params)
        if doc.get("engine_id") != engine_id:
            raise EpochError(
                f"prefill engine {engine_id} is gone: its address now serves engine {doc.get('engine_id')!r}"
            )
        check_compat(self.compat, doc.get("compat") or {}, f"prefill engine {engine_id}")
        if kvx.get("digest") != digest(self.compat):
            raise ConfigError(
                f"kv_transfer_params digest {kvx.get('digest')!r} does not match this engine's "
                f"{digest(self.compat)!r}"
            )
        if not isinstance(doc.get("ranks"), list):
            raise ProtocolError(f"prefill engine {engine_id} sent no rank list")
        ranks = sorted(doc["ranks"], key=lambda r: int(r["tp_rank"]))
        epochs = [f"{int(r['agent_epoch']):#x}" for r in ranks]
        if epochs != [str(e) for e in kvx["epochs"]]:
            raise EpochError(
                f"prefill engine {engine_id} restarted (agent epochs {kvx['epochs']} -> {epochs}); "
                "the request's blocks are gone"
            )
        tp_size = int(doc["tp_size"])
        if [int(r["tp_rank"]) for r in ranks] != list(range(tp_size)):
            raise ConfigError(
                f"prefill engine {engine_id} announces tp_size {tp_size} but ranks "
                f"{[r['tp_rank'] for r in ranks]}"
            )
        caches = _group_caches(ranks[0].get("cache"), len(self.groups), engine_id)
        peers = {int(r["tp_rank"]): self.agent.add_peer(base64.b64decode(r["agent_metadata"])) for r in ranks}
        with self._lock:
            for peer in peers.values():
                self._stats.record_backend(peer.backend)
        return _RemoteEngine(engine_id, tp_size, caches, peers)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.agent is not None:
            try:
                self.agent.close()
            except KvxError as exc:
                logger.warning("closing kvx agent: %s", exc)


def _group_caches(doc: Any, num_groups: int, engine_id: str) -> list[RankCache]:
    """A prefill rank's per-group cache description (a peer's words), checked."""
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list) or len(groups) != num_groups:
        got = len(groups) if isinstance(groups, list) else "no"
        raise ConfigError(
            f"prefill engine {engine_id} describes {got} KV-cache groups, this engine has {num_groups}"
        )
    caches = [RankCache.from_json(g) for g in groups]
    if len({c.num_blocks for c in caches}) != 1:
        raise ConfigError(f"prefill engine {engine_id}'s KV-cache groups differ in their block counts")
    return caches


def _block_pairs(
    local: list[list[int]], remote: Any, remote_num_blocks: int
) -> list[tuple[list[int], list[int]]]:
    """Per group, the (local, remote) block ids to read: positions where decode has a block to
    fill. ``remote`` passed KvxScheduler's checks (check_remote_block_ids); what only the
    prefill engine's cache description tells (its block count) is checked here."""
    if len(local) != len(remote):
        raise ConfigError(f"{len(local)} KV-cache groups here, prefill sent block ids for {len(remote)}")
    pairs = []
    for g, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        if len(mine) > len(theirs):
            raise ConfigError(
                f"KV-cache group {g}: decode allocated {len(mine)} blocks but prefill holds {len(theirs)}"
            )
        lb: list[int] = []
        rb: list[int] = []
        for pos, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a == NULL_BLOCK_ID:
                continue  # a local prefix hit, or outside this group's sliding window
            if b == NULL_BLOCK_ID:
                raise ConfigError(
                    f"KV-cache group {g}: prefill no longer holds block {pos}, which decode's "
                    "sliding window needs (prefill went on past the prompt?)"
                )
            if not 0 < b < remote_num_blocks:
                raise ProtocolError(
                    f"KV-cache group {g}: prefill block id {b} is outside its cache of {remote_num_blocks} blocks"
                )
            lb.append(a)
            rb.append(b)
        pairs.append((lb, rb))
    return pairs
