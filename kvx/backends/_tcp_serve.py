"""The serving side of the tcp backend: one thread per inbound connection.

The remote application does nothing for a one-sided READ or WRITE; this
code does it on its behalf, and it is the wall between a peer and local
memory. Every request is validated against the region table before a byte
moves. A request that is wrong but well framed (a descriptor out of bounds,
an unknown region) gets an ERROR response and the connection stays up; a
message that breaks the framing (garbage, a wrong version, a size over the
limits) gets an ERROR where possible and the connection is closed. Either
way the agent goes on serving every other peer.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from kvx import _io, _staging, _wire, gpu
from kvx._wire import ErrorCode, MsgType
from kvx.backends._sock import check_header, drain, recv_exact, recv_header
from kvx.descs import DESC_DTYPE, total_bytes
from kvx.config import check_name
from kvx.errors import (AccessError, ConfigError, AuthError, EpochError, KvxError, LimitError, PeerLostError,
                        ProtocolError, TimeoutError, VersionError)
from kvx.memory import REMOTE_READ, REMOTE_WRITE
from kvx.v1 import handshake_pb2

if TYPE_CHECKING:
    from kvx.backends.tcp import TcpBackend

logger = logging.getLogger(__name__)

DESC_SIZE = DESC_DTYPE.itemsize
# SHM_PIN ranges one connection may hold at once (the initiator holds one per
# request in flight, and Limits.max_inflight_per_peer bounds those).
MAX_PINS = 4096
# How long and how much a connection closed for a protocol error is drained.
_LINGER_S = 0.5
_LINGER_BYTES = 1 << 20

_ERROR_CODES: list[tuple[type[KvxError], ErrorCode]] = [
    (AccessError, ErrorCode.ACCESS),
    (LimitError, ErrorCode.LIMIT),
    (VersionError, ErrorCode.VERSION),
    (EpochError, ErrorCode.EPOCH),
    (AuthError, ErrorCode.AUTH),
    (ProtocolError, ErrorCode.PROTOCOL),
]


def error_code(exc: KvxError) -> ErrorCode:
    for cls, code in _ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return ErrorCode.INTERNAL


class _Fatal(Exception):
    """Ends a connection; carries the error to report to the peer first."""

    def __init__(self, error: KvxError, request_id: int = 0) -> None:
        super().__init__(str(error))
        self.error = error
        self.request_id = request_id


class InboundConnection:
    """Serves one initiator's requests until it leaves or breaks the protocol."""

    def __init__(self, backend: TcpBackend, sock: socket.socket, address: str) -> None:
        self.backend = backend
        self.agent = backend.agent
        self.sock = sock
        self.address = address
        self.peer_name = f"<unauthenticated {address}>"
        self.authenticated = False
        self._deadline: float | None = None  # of the handshake
        self.closing = False
        self._pins: dict[int, int] = {}  # SHM_PIN request id -> region table token
        self.thread = threading.Thread(target=self._run, name=f"kvx-serve-{address}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def shutdown(self) -> None:
        self.closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _run(self) -> None:
        try:
            self._handshake()
            self._serve()
        except _Fatal as fatal:
            if not self.closing:
                logger.warning("closing connection from %s: %s", self.peer_name, fatal.error)
                self._send_error(fatal.request_id, fatal.error)
                self._linger()
        except (PeerLostError, TimeoutError, OSError) as exc:
            if not self.closing:
                logger.info("connection from %s ended: %s", self.peer_name, exc)
        except Exception:  # never let one peer's bug take the agent down
            logger.exception("internal error serving %s", self.peer_name)
        finally:
            # The initiator cannot copy through a pin once its connection is gone
            # (it keeps the connection up while it copies).
            for token in self._pins.values():
                self.agent._regions.release(token)
            self._pins.clear()
            try:
                self.sock.close()
            finally:
                self.backend._inbound_done(self)

    # Handshake.

    def _recv_message(self, expect: MsgType) -> bytes:
        header = recv_exact(self.sock, _wire.HEADER_SIZE, self._deadline)
        try:
            msg_type, _, payload_len, _, data_len = check_header(header)
        except (ProtocolError, VersionError) as exc:
            raise _Fatal(exc) from None
        if msg_type != expect or data_len or payload_len > _wire.MAX_HANDSHAKE_BYTES:
            raise _Fatal(ProtocolError(f"expected {expect.name} during the handshake, got type {msg_type}"))
        return bytes(recv_exact(self.sock, payload_len, self._deadline))

    def _handshake(self) -> None:
        agent = self.agent
        # One deadline for the whole handshake: a trickling peer cannot hold a slot.
        self._deadline = time.monotonic() + agent.timeouts.connect_s
        try:
            hello = handshake_pb2.Hello.FromString(self._recv_message(MsgType.HELLO))
        except _Fatal:
            raise
        except Exception as exc:  # protobuf DecodeError and friends
            raise _Fatal(ProtocolError(f"malformed HELLO: {exc}")) from None
        if hello.target_name != agent.name or hello.target_epoch != agent.epoch:
            raise _Fatal(EpochError(
                f"this is agent {agent.name!r} epoch {agent.epoch:#x}; the initiator addressed "
                f"{hello.target_name!r} epoch {hello.target_epoch:#x} (the agent restarted, or "
                "the metadata is stale): fetch its metadata again"))
        if len(hello.nonce) != _wire.NONCE_BYTES:
            raise _Fatal(ProtocolError("HELLO nonce must be 32 bytes"))
        try:
            check_name(hello.name)
        except ConfigError as exc:
            raise _Fatal(ProtocolError(f"HELLO: {exc}")) from None
        secret = agent._secret
        nonce = os.urandom(_wire.NONCE_BYTES)
        ids = (hello.name, agent.name, hello.epoch, agent.epoch)
        reply = handshake_pb2.HelloReply(
            name=agent.name, epoch=agent.epoch, nonce=nonce, auth_required=secret is not None,
            proof=_wire.target_proof(secret, hello.nonce, nonce, *ids) if secret else b"",
            max_message_bytes=agent.limits.max_message_bytes,
            max_descs_per_message=agent.limits.max_descs_per_message,
        ).SerializeToString()
        self.sock.settimeout(max(0.001, self._deadline - time.monotonic()))
        self.sock.sendall(_wire.pack(MsgType.HELLO_REPLY, payload_len=len(reply)) + reply)
        try:
            auth = handshake_pb2.Auth.FromString(self._recv_message(MsgType.AUTH))
        except _Fatal:
            raise
        except Exception as exc:
            raise _Fatal(ProtocolError(f"malformed AUTH: {exc}")) from None
        if secret is not None:
            expected = _wire.initiator_proof(secret, hello.nonce, nonce, *ids)
            if not hmac.compare_digest(auth.proof, expected):
                raise _Fatal(AuthError(
                    f"peer {hello.name!r} failed the HMAC challenge: it has no, or another, "
                    "auth_secret"))
        self.sock.settimeout(max(0.001, self._deadline - time.monotonic()))
        self.sock.sendall(_wire.pack(MsgType.AUTH_OK))
        self.peer_name = hello.name
        self.authenticated = True
        self.sock.settimeout(agent.timeouts.io_s)
        logger.debug("peer %s (epoch %#x) connected from %s", hello.name, hello.epoch, self.address)

    # Requests.

    def _serve(self) -> None:
        handlers = {
            MsgType.READ_REQ: self._on_read,
            MsgType.WRITE_REQ: self._on_write,
            MsgType.NOTIFY: self._on_notify,
            MsgType.SHM_PIN: self._on_pin,
            MsgType.SHM_UNPIN: self._on_unpin,
            MsgType.SEG_TOKEN: self._on_seg_token,
        }
        while not self.closing:
            header = recv_header(self.sock, lambda: not self.closing)
            if header is None:
                return
            try:
                msg_type, request_id, payload_len, aux, data_len = check_header(header)
            except (ProtocolError, VersionError) as exc:
                raise _Fatal(exc) from None
            handler = handlers.get(msg_type)
            if handler is None:
                raise _Fatal(ProtocolError(f"unexpected message type {msg_type}"), request_id)
            handler(request_id, payload_len, aux, data_len)

    def _recv_descs(self, request_id: int, nbytes: int) -> np.ndarray:
        limits = self.agent.limits
        if nbytes % DESC_SIZE:
            raise _Fatal(ProtocolError(f"descriptor payload of {nbytes} bytes is not a whole number "
                                       "of descriptors"), request_id)
        if nbytes // DESC_SIZE > limits.max_descs_per_message:
            raise _Fatal(LimitError(f"{nbytes // DESC_SIZE} descriptors in one request; this agent "
                                    f"takes at most {limits.max_descs_per_message}"), request_id)
        if not nbytes:
            return np.zeros(0, dtype=DESC_DTYPE)
        return np.frombuffer(recv_exact(self.sock, nbytes), dtype=DESC_DTYPE)

    def _check_size(self, request_id: int, data_len: int) -> None:
        limit = self.agent.limits.max_message_bytes
        if data_len > limit:
            raise _Fatal(LimitError(f"request of {data_len} bytes; this agent takes at most {limit} "
                                    "per message"), request_id)

    def _on_read(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        if aux or data_len:
            raise _Fatal(ProtocolError("READ_REQ carries no data"), request_id)
        descs = self._recv_descs(request_id, payload_len)
        table = self.agent._regions
        try:
            addrs, lens, total, token = table.resolve(descs, REMOTE_READ, "remote read")
        except AccessError as exc:
            self._send_error(request_id, exc)
            return
        try:
            if total > self.agent.limits.max_message_bytes:
                self._send_error(request_id, LimitError(
                    f"read of {total} bytes in one request; this agent takes at most "
                    f"{self.agent.limits.max_message_bytes}"))
                return
            header = _wire.pack(MsgType.READ_RESP, request_id, data_len=total)
            device = table.device_of(descs, "remote read")
            if device >= 0:  # CUDA memory: through pinned host buffers
                _staging.send(gpu.engine(device), _io.sendv, self.sock.fileno(), header, addrs, lens,
                              self.backend.io_ms)
            else:
                _io.sendv(self.sock.fileno(), header, addrs, lens, self.backend.io_ms)
        except ConfigError as exc:  # mixes host and CUDA memory
            self._send_error(request_id, AccessError(str(exc)))
        finally:
            table.release(token)

    def _on_write(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        limits = self.agent.limits
        notify_len = aux
        if notify_len > payload_len or notify_len > limits.max_notify_bytes:
            raise _Fatal(LimitError(f"notification of {notify_len} bytes; at most "
                                    f"{limits.max_notify_bytes}"), request_id)
        self._check_size(request_id, data_len)
        descs = self._recv_descs(request_id, payload_len - notify_len)
        notify = bytes(recv_exact(self.sock, notify_len)) if notify_len else None
        total = total_bytes(descs)
        if total != data_len:
            raise _Fatal(ProtocolError(f"WRITE_REQ announces {data_len} bytes but its descriptors "
                                       f"cover {total}"), request_id)
        table = self.agent._regions
        try:
            addrs, lens, _, token = table.resolve(descs, REMOTE_WRITE, "remote write")
        except AccessError as exc:
            drain(self.sock, data_len)  # the bytes go nowhere; the framing survives
            self._send_error(request_id, exc)
            return
        try:
            device = table.device_of(descs, "remote write")
        except ConfigError as exc:  # mixes host and CUDA memory
            table.release(token)
            drain(self.sock, data_len)
            self._send_error(request_id, AccessError(str(exc)))
            return
        try:
            if device >= 0:  # CUDA memory: through pinned host buffers
                _staging.recv(gpu.engine(device), _io.recvv, self.sock.fileno(), addrs, lens, self.backend.io_ms)
            else:
                _io.recvv(self.sock.fileno(), addrs, lens, self.backend.io_ms)
        except (ConnectionError, OSError) as exc:
            raise PeerLostError(f"connection lost during a write: {exc}") from exc
        finally:
            table.release(token)
        if notify is not None and not self.agent._deliver(self.peer_name, notify):
            self._send_error(request_id, self._queue_full())
            return
        self.sock.sendall(_wire.pack(MsgType.WRITE_RESP, request_id))

    def _on_notify(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        if data_len or aux:
            raise _Fatal(ProtocolError("NOTIFY carries no data"), request_id)
        if payload_len > self.agent.limits.max_notify_bytes:
            raise _Fatal(LimitError(f"notification of {payload_len} bytes; at most "
                                    f"{self.agent.limits.max_notify_bytes}"), request_id)
        data = bytes(recv_exact(self.sock, payload_len))
        if not self.agent._deliver(self.peer_name, data):
            self._send_error(request_id, self._queue_full())
            return
        self.sock.sendall(_wire.pack(MsgType.NOTIFY_ACK, request_id))

    def _on_pin(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        ipc = bool(aux & _wire.PIN_IPC)
        aux &= ~_wire.PIN_IPC
        if data_len or aux not in (_wire.PIN_READ, _wire.PIN_WRITE) or payload_len % 4:
            raise _Fatal(ProtocolError("SHM_PIN carries region ids, no data, and says read or write"), request_id)
        if payload_len // 4 > self.agent.limits.max_descs_per_message:
            raise _Fatal(LimitError(f"{payload_len // 4} regions in one SHM_PIN"), request_id)
        if request_id in self._pins:
            raise _Fatal(ProtocolError(f"SHM_PIN reuses request id {request_id}"), request_id)
        if len(self._pins) >= MAX_PINS:
            raise _Fatal(LimitError(f"{MAX_PINS} shm pins held by one connection; unpin first"), request_id)
        ids = np.frombuffer(recv_exact(self.sock, payload_len), dtype="<u4").astype(np.intp)
        if not self.agent._shm_offered:
            self._send_error(request_id, AccessError(
                f"agent {self.agent.name!r} does not offer shm (backend={self.agent.backend_setting!r})"))
            return
        writing = aux == _wire.PIN_WRITE
        try:
            bases, sizes, token = self.agent._regions.pin_regions(
                ids, REMOTE_WRITE if writing else REMOTE_READ, "remote write" if writing else "remote read")
        except AccessError as exc:
            self._send_error(request_id, exc)
            return
        body = np.stack([bases, sizes], axis=1).astype("<u8").tobytes()
        if ipc:
            try:
                body += self.agent._regions.ipc_export(ids, "remote read" if not writing else "remote write")
            except AccessError as exc:
                self.agent._regions.release(token)
                self._send_error(request_id, exc)
                return
        self._pins[request_id] = token
        try:
            self.sock.sendall(_wire.pack(MsgType.SHM_PIN_OK, request_id, payload_len=len(body)) + body)
        except OSError:
            raise PeerLostError("connection lost while answering SHM_PIN") from None

    def _on_unpin(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        if payload_len or aux or data_len:
            raise _Fatal(ProtocolError("SHM_UNPIN carries nothing but the pin's request id"), request_id)
        token = self._pins.pop(request_id, None)
        if token is None:
            raise _Fatal(ProtocolError(f"SHM_UNPIN of request {request_id}, which holds no pin"), request_id)
        self.agent._regions.release(token)

    def _on_seg_token(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        if payload_len or aux or data_len:
            raise _Fatal(ProtocolError("SEG_TOKEN carries nothing"), request_id)
        server = self.agent._segment_server
        if server is None:
            self._send_error(request_id, AccessError(f"agent {self.agent.name!r} does not offer shared segments"))
            return
        try:
            token = server.issue(self.peer_name)
        except AccessError as exc:
            self._send_error(request_id, exc)
            return
        self.sock.sendall(_wire.pack(MsgType.SEG_TOKEN_OK, request_id, payload_len=len(token)) + token)

    def _queue_full(self) -> LimitError:
        return LimitError(f"agent {self.agent.name!r} has "
                          f"{self.agent.limits.max_pending_notifications} notifications its "
                          "application has not taken; the notification was refused")

    def _linger(self) -> None:
        """Close gently: closing with unread input sends a reset, which can
        destroy the ERROR before the peer reads it. Bounded in bytes and time."""
        deadline = time.monotonic() + _LINGER_S
        try:
            self.sock.shutdown(socket.SHUT_WR)
            left = _LINGER_BYTES
            while left > 0 and time.monotonic() < deadline:
                self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                got = len(self.sock.recv(min(left, 65536)))
                if not got:
                    break
                left -= got
        except OSError:
            pass

    def _send_error(self, request_id: int, error: KvxError) -> None:
        text = str(error).encode()[: _wire.MAX_ERROR_TEXT_BYTES]
        try:
            self.sock.sendall(_wire.pack(MsgType.ERROR, request_id, len(text), error_code(error)) + text)
        except OSError:
            pass
