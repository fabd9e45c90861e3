"""What crosses between KvxConnector's halves and between engines.

Scheduler -> worker: ``KvxConnectorMetadata`` (one per engine step).
Worker -> scheduler: ``KvxHandshakeMetadata`` (once, after the KV caches are
registered). Prefill -> decode: ``kv_transfer_params`` (JSON, through the
proxy) and the side channel document. Decode -> prefill: notifications.

Wire history (``WIRE_VERSION``):
  1  first version: pull mode, JSON notifications {"op", "req", "n"}.
  2  KV-cache groups (vLLM's hybrid allocator): ``remote_block_ids`` holds one
     list per group, aligned by block position, 0 where a sliding-window
     group holds no block; the rank cache description is per group
     (``{"groups": [...]}``); the compatibility fields name the groups.
  3  A rank cache's units are listed plane-major by the head axis read off
     the cache tensor (version 2 listed them in memory order, which pairs
     the wrong heads across tensor parallelism for vLLM's CPU cache, where
     each head keeps its K and V together); a layer says ``heads_known``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvx.backends.control.wire import PROTOCOL_VERSION
from kvx.errors import ConfigError, ProtocolError

WIRE_VERSION = 3
# vLLM's null block: a sliding-window group's entry for a block outside the window.
NULL_BLOCK_ID = 0
# Blocks in one engine's KV cache, at most: ids and list lengths from a peer are bounded by it.
MAX_BLOCK_ID = 1 << 31


@dataclasses.dataclass
class RecvRequest:
    """Decode: load these local blocks from a prefill engine (or only release them there)."""

    request_id: str
    # Per KV-cache group, by block position: the local block to fill there,
    # or NULL_BLOCK_ID where nothing is read (a local prefix hit, a block
    # outside a sliding window).
    local_block_ids: list[list[int]]
    params: dict[str, Any]
    release_only: bool = False  # full prefix hit or abort: nothing to read, free prefill's blocks


@dataclasses.dataclass
class KvxConnectorMetadata(KVConnectorMetadata):
    recv: list[RecvRequest] = dataclasses.field(default_factory=list)
    # Prefill: requests whose blocks are now held for decode (request id -> lease seconds).
    hold: dict[str, float] = dataclasses.field(default_factory=dict)
    # Decode: requests still waiting to be read: renew prefill's lease on them.
    renew: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    push: Any = None  # push mode: kvx.connectors.vllm.push.PushMeta
    # The step computes no token (every request waits for KV): the worker may wait for a transfer.
    idle: bool = False


@dataclasses.dataclass
class KvxHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One rank's agent: its name, epoch, kvx metadata and cache description."""

    tp_rank: int
    agent_name: str
    agent_epoch: int
    agent_metadata: bytes
    cache: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        import base64

        return {
            "tp_rank": self.tp_rank,
            "agent_name": self.agent_name,
            "agent_epoch": self.agent_epoch,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
            "cache": self.cache,
        }


def compat_fields(vllm_config: Any, layout: str | None, kv_cache_config: Any) -> dict[str, Any]:
    """What two engines must agree on before one reads the other's KV cache."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf = model.hf_text_config
    return {
        "model": str(getattr(model, "served_model_name", None) or model.model),
        "dtype": str(cache.cache_dtype if cache.cache_dtype != "auto" else model.dtype),
        "num_layers": int(model.get_num_layers(vllm_config.parallel_config)),
        "num_kv_heads": int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads),
        "head_size": int(model.get_head_size()),
        "block_size": int(cache.block_size),
        "use_mla": bool(model.use_mla),
        "layout": layout or "default",
        "kv_cache_groups": cache_groups(kv_cache_config),
        "kvx_protocol": PROTOCOL_VERSION,
        "kvx_wire": WIRE_VERSION,
    }


def digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def check_compat(mine: dict[str, Any], theirs: dict[str, Any], who: str) -> None:
    """Raise a ConfigError that names every field that differs."""
    diff = [
        f"{k}: here {mine.get(k)!r}, {who} {theirs.get(k)!r}"
        for k in sorted(set(mine) | set(theirs))
        if mine.get(k) != theirs.get(k)
    ]
    if diff:
        raise ConfigError(f"KV caches are not compatible with {who}: " + "; ".join(diff))


# KV-cache groups.


def cache_groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    """Each KV-cache group as both engines must see it: kind, window, block size, layers.

    With vLLM's hybrid allocator a model with sliding-window and full-attention
    layers has one group of each; without it (``--disable-hybrid-kv-cache-manager``)
    vLLM treats every layer as full attention, in one group.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ConfigError(
            "KvxConnector got no KV-cache groups from vLLM; it needs vLLM 0.32 or newer, "
            "which passes its KVCacheConfig to connectors"
        )
    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        entry: dict[str, Any]
        if isinstance(spec, SlidingWindowSpec):
            entry = {
                "kind": "sliding_window",
                "window": int(spec.sliding_window),
                # Blocks vLLM keeps below the window (speculative decoding); 0.32 has none.
                "retained": int(getattr(spec, "extra_retained_tokens", 0)),
            }
        elif isinstance(spec, FullAttentionSpec):
            entry = {"kind": "full"}
        else:
            raise ConfigError(
                f"KvxConnector moves full-attention and sliding-window KV caches; KV-cache group {i} "
                f"({len(group.layer_names)} layers, e.g. {group.layer_names[:1]}) is a "
                f"{type(spec).__name__}: use another connector for this model"
            )
        entry.update(block_size=int(spec.block_size), num_layers=len(group.layer_names))
        groups.append(entry)
    return groups


def window_start_block(group: dict[str, Any], num_tokens: int) -> int:
    """First block position of ``group`` that a token after ``num_tokens`` can attend to.

    The same count as vLLM's ``SlidingWindowManager.get_num_skipped_tokens``:
    blocks wholly before token ``num_tokens - window + 1 - retained`` are
    freed (their ids become the null block) on prefill and never allocated
    on decode, so both engines agree on where a group's window starts.
    """
    if group["kind"] != "sliding_window":
        return 0
    return max(0, num_tokens - group["window"] + 1 - group["retained"]) // group["block_size"]


def check_remote_block_ids(
    params: dict[str, Any], groups: list[dict[str, Any]], max_tokens: int
) -> list[list[int]]:
    """Prefill's ``remote_block_ids`` (a peer's words), checked against this engine's groups.

    One list per group; each exactly as long as ``remote_num_tokens`` needs
    (at most ``max_tokens``, this engine's longest sequence); ids are ints in
    [0, MAX_BLOCK_ID), no id twice in a group, and 0 (vLLM's null block) only
    in a sliding-window group, before its window. Raises ProtocolError.
    """
    ids = params.get("remote_block_ids")
    num_tokens = params.get("remote_num_tokens")
    if type(num_tokens) is not int or not 0 < num_tokens <= max_tokens:
        raise ProtocolError(
            f"kv_transfer_params remote_num_tokens must be an int in 1..{max_tokens} "
            f"(this engine's max_model_len), not {num_tokens!r}"
        )
    if not isinstance(ids, list) or len(ids) != len(groups):
        count = len(ids) if isinstance(ids, list) else type(ids).__name__
        raise ProtocolError(
            f"kv_transfer_params remote_block_ids must hold one list per KV-cache group: this engine "
            f"has {len(groups)} ({', '.join(g['kind'] for g in groups)}), prefill sent {count}; "
            "run both engines with the same model and the same hybrid KV-cache manager setting"
        )
    out: list[list[int]] = []
    for g, (group, blocks) in enumerate(zip(groups, ids, strict=True)):
        want = -(-num_tokens // group["block_size"])
        if not isinstance(blocks, list) or len(blocks) != want:
            got = len(blocks) if isinstance(blocks, list) else type(blocks).__name__
            raise ProtocolError(
                f"kv_transfer_params remote_block_ids[{g}] must list {want} blocks "
                f"({num_tokens} tokens in blocks of {group['block_size']}), not {got}"
            )
        if not all(type(b) is int and 0 <= b < MAX_BLOCK_ID for b in blocks):
            raise ProtocolError(
                f"kv_transfer_params remote_block_ids[{g}] must hold block ids in 0..{MAX_BLOCK_ID - 1}"
            )
        start = window_start_block(group, num_tokens)
        if NULL_BLOCK_ID in blocks[start:]:
            raise ProtocolError(
                f"kv_transfer_params remote_block_ids[{g}] ({group['kind']} attention) has the null "
                f"block at position {blocks.index(NULL_BLOCK_ID, start)}, where prefill must hold a block"
            )
        real = [b for b in blocks if b != NULL_BLOCK_ID]
        if len(set(real)) != len(real):
            raise ProtocolError(f"kv_transfer_params remote_block_ids[{g}] names a block twice")
        out.append(list(blocks))
    return out


# Notifications decode -> prefill.


def note(op: str, request_id: str, n: int = 1) -> bytes:
    return json.dumps({"v": WIRE_VERSION, "op": op, "req": request_id, "n": n}).encode()


def parse_note(data: bytes) -> tuple[str, str, int]:
    try:
        d = json.loads(data)
        op, req, n = d["op"], d["req"], int(d.get("n", 1))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"malformed notification: {exc}") from None
    if op not in ("done", "renew", "release") or not isinstance(req, str) or not 1 <= n <= 1024:
        raise ConfigError(f"malformed notification {d!r}")
    return op, req, n


REMOTE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "kvx",
)


def remote_params_ok(params: dict[str, Any] | None) -> bool:
    return params is not None and all(params.get(k) is not None for k in REMOTE_KEYS)
