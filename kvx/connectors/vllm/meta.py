"""What crosses between KvxConnector's halves and between engines.

Scheduler -> worker: ``KvxConnectorMetadata`` (one per engine step).
Worker -> scheduler: ``KvxHandshakeMetadata`` (once, after the KV caches are
registered). Prefill -> decode: ``kv_transfer_params`` (JSON, through the
proxy) and the side channel document. Decode -> prefill: notifications.

Wire history (``WIRE_VERSION``):
  1  first version: pull mode, JSON notifications {"op", "req", "n"}.
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
from kvx.errors import ConfigError

WIRE_VERSION = 1


@dataclasses.dataclass
class RecvRequest:
    """Decode: load these local blocks from a prefill engine (or only release them there)."""

    request_id: str
    local_block_ids: list[int]
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


def compat_fields(vllm_config: Any, layout: str | None) -> dict[str, Any]:
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
