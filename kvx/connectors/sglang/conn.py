"""kvx as an SGLang disaggregation transfer backend (``--disaggregation-transfer-backend kvx``).

SGLang's built-in backends share their control plane: the bootstrap server
(prefill ranks ``PUT /route``, decode ``GET /route``), the ZMQ messages in
which decode sends its destination KV indices and prefill reports status,
heartbeats, aborts, chunked sends and the ``KVPoll`` state machine
(``sglang/srt/disaggregation/common/conn.py``). The mooncake backend adds a
transfer scheduler on top that turns each chunk into batches of
(local address, peer address, length) written through an engine object.

kvx keeps all of that SGLang behaviour (so SGLang's router, rank mapping
for mismatched TP and failure handling work unchanged) and swaps the engine
for ``KvxTransferEngine``: the bytes move as kvx WRITEs between kvx agents,
checked against registered memory on both sides. The classes below are that
swap; nothing of SGLang is patched.

Settings come from the environment of the SGLang processes:
``KVX_HOST`` (address the agent and its side channel bind and advertise;
default 127.0.0.1), ``KVX_AUTH_SECRET`` or ``KVX_AUTH_SECRET_FILE`` (the
cluster secret, needed for a non-loopback ``KVX_HOST``), ``KVX_BACKEND``
(``auto``, the default, or ``tcp``, ``shm``, ``cuda_ipc``: the agent's
backend setting; prefill pushes, so prefill's setting picks the transport,
and a decode set to ``tcp`` serves no same-host copies, so prefill uses tcp
towards it).

A transfer that fails (any error, a bug included) returns -1 to SGLang's
transfer thread, which marks the request failed and tells decode, as for
Mooncake; ``KvxKVManager`` adds kvx's reason to SGLang's failure record.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)

from kvx.config import check_backend, read_file
from kvx.connectors.sglang.engine import KvxTransferEngine
from kvx.errors import ConfigError

logger = logging.getLogger(__name__)

_engine: KvxTransferEngine | None = None
_engine_lock = threading.Lock()


def _secret() -> bytes | None:
    path = os.environ.get("KVX_AUTH_SECRET_FILE")
    if path:
        return read_file(path).strip()
    env = os.environ.get("KVX_AUTH_SECRET")
    return env.encode() if env else None


def shared_engine(name: str) -> KvxTransferEngine:
    """The process's engine: one agent serves every manager in the process, as Mooncake's engine does."""
    global _engine
    with _engine_lock:
        if _engine is None:
            secret = _secret()
            if secret is not None and len(secret) < 16:
                raise ConfigError("the kvx auth secret must be at least 16 bytes")
            backend = os.environ.get("KVX_BACKEND", "auto")
            try:
                check_backend(backend)
            except ConfigError as exc:
                raise ConfigError(f"KVX_BACKEND: {exc}") from None
            _engine = KvxTransferEngine(
                name, os.environ.get("KVX_HOST", "127.0.0.1"), auth_secret=secret, backend=backend
            )
        return _engine


class KvxKVManager(MooncakeKVManager):
    sender_trace_module = "kvx"

    def init_engine(self) -> None:
        mode = getattr(self.disaggregation_mode, "value", self.disaggregation_mode)
        # The pid alone repeats across identical containers, and two live agents must not
        # share a name (a target ends one's connections when the other connects): a random part.
        self.engine = shared_engine(
            f"sglang-{mode}-{os.getpid()}-{secrets.token_hex(4)}-r{self.kv_args.engine_rank}"
        )

    def check_status(self, bootstrap_room: int) -> KVPoll:
        """SGLang's check, safe against the room being cleared meanwhile. Its callers test
        ``room in request_status`` and then read the status; the scheduler thread can pop the
        room between the two (SGLang 0.5.23). The KeyError then ended the prefill's transfer
        thread, which serves every later request: they all timed out on decode. A room that
        is gone reads as failed, as those callers treat a room that is absent."""
        try:
            return self.request_status[bootstrap_room]
        except KeyError:
            return KVPoll.Failed

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str, targets=None):
        """SGLang's failure path, with kvx's reason: the engine only returns -1 to SGLang's
        transfer thread, which reports "Failed to send kv chunk ..." and no cause."""
        infos = getattr(self, "transfer_infos", {}).get(bootstrap_room) or {}
        reasons = [why for why in map(self.engine.failure, list(infos)) if why]
        if reasons:
            failure_reason = f"{failure_reason}: kvx: {'; '.join(reasons)}"
        return super().conclude_failure(
            bootstrap_room=bootstrap_room, failure_reason=failure_reason, targets=targets
        )


class KvxKVSender(MooncakeKVSender):
    # Mooncake's sender takes host-side index tensors, a path that pins memory and records a
    # CUDA event; kvx's engine needs neither, and the path fails on CPU-only engines.
    supports_host_tensor_indices = False


class KvxKVReceiver(MooncakeKVReceiver):
    pass


class KvxKVBootstrapServer(MooncakeKVBootstrapServer):
    pass
