"""The tcp backend's serving side: READ_REQ and WRITE_REQ on an inbound
control connection, checked against the region table before a byte moves.

A request that is wrong but well framed (a descriptor out of bounds, an
unknown region) gets an ERROR response and the connection stays up (the
data of a refused WRITE is drained); one that breaks the framing ends it.
"""

from __future__ import annotations

import numpy as np

from kvx._datapath import gpu
from kvx._datapath import io as _io
from kvx._datapath import staging as _staging
from kvx.backends.control import wire as _wire
from kvx.backends.control.serve import DESC_SIZE, Fatal, InboundConnection
from kvx.backends.control.sock import drain, recv_exact
from kvx.backends.control.wire import MsgType
from kvx.descs import DESC_DTYPE, total_bytes
from kvx.errors import AccessError, ConfigError, LimitError, PeerLostError, ProtocolError
from kvx.memory import REMOTE_READ, REMOTE_WRITE, VALID

# A READ or WRITE of at most this many descriptors is served in one native call.
SMALL_REQUEST_DESCS = 64


def _small(payload_len: int, max_descs: int) -> bool:
    """A descriptor payload the one-call path takes: whole descriptors, at
    least one, at most SMALL_REQUEST_DESCS and the agent's own limit."""
    return 0 < payload_len <= min(SMALL_REQUEST_DESCS, max_descs) * DESC_SIZE and not payload_len % DESC_SIZE


def on_read(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    if aux or data_len:
        raise Fatal(ProtocolError("READ_REQ carries no data"), request_id)
    limits = conn.ctx.limits
    if _small(payload_len, limits.max_descs_per_message):
        # The common small READ of host memory: received, checked and answered
        # in one call, which pins the table once the descriptors are in. A
        # refused one comes back untouched, for the checks below to name what
        # is wrong.
        payload = _io.serve_read(
            conn.sock.fileno(),
            _wire.pack(MsgType.READ_RESP, request_id),
            payload_len,
            conn.ctx.regions,
            REMOTE_READ | VALID,
            limits.max_message_bytes,
            conn.ctx.io_ms,
        )
        if payload is None:
            return
        descs = np.frombuffer(payload, dtype=DESC_DTYPE)
    else:
        descs = conn.recv_descs(request_id, payload_len)
    _answer_read(conn, request_id, descs)


def _answer_read(conn: InboundConnection, request_id: int, descs: np.ndarray) -> None:
    table = conn.ctx.regions
    try:
        addrs, lens, total, token = table.resolve(descs, REMOTE_READ, "remote read")
    except AccessError as exc:
        conn.send_error(request_id, exc)
        return
    try:
        limit = conn.ctx.limits.max_message_bytes
        if total > limit:
            conn.send_error(
                request_id,
                LimitError(f"read of {total} bytes in one request; this agent takes at most {limit}"),
            )
            return
        header = _wire.pack(MsgType.READ_RESP, request_id, data_len=total)
        device = table.device_of(descs, "remote read")
        if device >= 0:  # CUDA memory: through pinned host buffers
            _staging.send(
                gpu.engine(device), _io.sendv, conn.sock.fileno(), header, addrs, lens, conn.ctx.io_ms
            )
        else:
            _io.sendv(conn.sock.fileno(), header, addrs, lens, conn.ctx.io_ms)
    except ConfigError as exc:  # mixes host and CUDA memory
        conn.send_error(request_id, AccessError(str(exc)))
    finally:
        table.release(token)


def on_write(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    limits = conn.ctx.limits
    notify_len = aux
    if notify_len > payload_len or notify_len > limits.max_notify_bytes:
        raise Fatal(
            LimitError(f"notification of {notify_len} bytes; at most {limits.max_notify_bytes}"), request_id
        )
    conn.check_size(request_id, data_len)
    if not notify_len and _small(payload_len, limits.max_descs_per_message):
        # The common small WRITE to host memory in one call, as a READ (on_read).
        payload = _io.serve_write(
            conn.sock.fileno(),
            _wire.pack(MsgType.WRITE_RESP, request_id),
            payload_len,
            data_len,
            conn.ctx.regions,
            REMOTE_WRITE | VALID,
            conn.ctx.io_ms,
        )
        if payload is None:
            return
        descs = np.frombuffer(payload, dtype=DESC_DTYPE)
    else:
        descs = conn.recv_descs(request_id, payload_len - notify_len)
    notify = bytes(recv_exact(conn.sock, notify_len)) if notify_len else None
    total = total_bytes(descs)
    if total != data_len:
        raise Fatal(
            ProtocolError(f"WRITE_REQ announces {data_len} bytes but its descriptors cover {total}"),
            request_id,
        )
    table = conn.ctx.regions
    try:
        addrs, lens, _, token = table.resolve(descs, REMOTE_WRITE, "remote write")
    except AccessError as exc:
        drain(conn.sock, data_len)  # the bytes go nowhere; the framing survives
        conn.send_error(request_id, exc)
        return
    try:
        device = table.device_of(descs, "remote write")
    except ConfigError as exc:  # mixes host and CUDA memory
        table.release(token)
        drain(conn.sock, data_len)
        conn.send_error(request_id, AccessError(str(exc)))
        return
    if conn.abandoned():  # the initiator gave up on this WRITE: it must not land late
        table.release(token)
        raise PeerLostError(f"peer {conn.peer_name!r} reset the connection; its buffered WRITE is dropped")
    try:
        if device >= 0:  # CUDA memory: through pinned host buffers
            _staging.recv(gpu.engine(device), _io.recvv, conn.sock.fileno(), addrs, lens, conn.ctx.io_ms)
        else:
            _io.recvv(conn.sock.fileno(), addrs, lens, conn.ctx.io_ms)
    except (ConnectionError, OSError) as exc:
        raise PeerLostError(f"connection lost during a write: {exc}") from exc
    finally:
        table.release(token)
    if notify is not None and not conn.deliver(request_id, notify):
        return
    conn.sock.sendall(_wire.pack(MsgType.WRITE_RESP, request_id))
