"""The tcp backend: works everywhere, and is the reference for the others.

The bytes travel on the control connections themselves (``kvx.backends.control``):
a READ_REQ is answered with the data, a WRITE_REQ carries it, straight
between the socket and registered memory (``io.sendv``/``io.recvv``). GPU
memory goes through pinned host buffers (``kvx._datapath.staging``), on both
sides. The serving side is in ``serve.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvx.backends.base import Backend, Channel
from kvx.backends.control import wire as _wire
from kvx.backends.control.link import Link, Part
from kvx.backends.control.serve import Handler
from kvx.backends.control.wire import MsgType
from kvx.backends.tcp import serve
from kvx.transfer import READ, WRITE, Op, Transfer
from kvx.v1 import agent_pb2


class TcpBackend(Backend):
    name = "tcp"
    priority = 0  # the fallback: always reachable
    stages_gpu = True

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        pass  # the control endpoint, which the agent publishes, is all it needs

    def handlers(self) -> dict[int, Handler]:
        return {MsgType.READ_REQ: serve.on_read, MsgType.WRITE_REQ: serve.on_write}

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        return None, ""  # when chosen, the selector says why: configured, or others could not serve

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        return TcpChannel(link), ""


class TcpChannel(Channel):
    """READ and WRITE requests over the link; other backends use it for the
    memory they do not move themselves."""

    small_posts = True

    def __init__(self, link: Link) -> None:
        super().__init__(link)

    def post(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        local_device: int = -1,
        remote_device: int = -1,
        remote_ipc: bool = False,
    ) -> None:
        link = self._link
        parts = link.split(local_addrs, local_lens, total, remote, link.max_message_bytes)
        attach_notify = notify is not None and len(parts) == 1 and op is WRITE
        transfer.expect_parts(len(parts), None if attach_notify else link.notify_after(notify))
        for wire, addrs, lens, nbytes in parts:
            conn = link.conn()
            request_id = next(conn.ids)
            payload = wire.tobytes()
            if op is READ:
                prefix = _wire.pack(MsgType.READ_REQ, request_id, payload_len=len(payload)) + payload
                conn.submit(
                    Part(transfer, MsgType.READ_REQ, addrs, lens, nbytes, local_device), prefix, request_id
                )
            else:
                extra = notify if attach_notify and notify is not None else b""
                prefix = (
                    _wire.pack(
                        MsgType.WRITE_REQ,
                        request_id,
                        payload_len=len(payload) + len(extra),
                        aux=len(extra),
                        data_len=nbytes,
                    )
                    + payload
                    + extra
                )
                conn.submit(
                    Part(transfer, MsgType.WRITE_REQ, addrs, lens, nbytes, local_device), prefix, request_id
                )
