"""The initiator's side of the control connection: a ``Link`` to one peer.

A link holds ``streams`` authenticated connections to a peer (``dial``: the
handshake with HMAC authentication and epochs). Every backend builds on it:
the tcp backend sends its READ and WRITE requests through it, the same-host
backends their pins (``post_pinned``), and all of them notifications.
A transfer is cut into parts (by the target's per-message limits, and
across streams when it is large); each part is one request. Requests are
pipelined: each connection has a reader thread that takes responses as they
come, bytes going straight from the socket into registered memory
(``io.recvv``). Small requests are sent by the posting thread; large WRITE
payloads by a sender thread per connection, so that posting never blocks on
the network. A thread in ``Transfer.wait`` reads the answers itself while
every request in flight on the connection is its own (``Connection.lead``),
and the reader sleeps on.

Only the reader thread closes a connection's socket, after the sender is
done with it: a descriptor number is never reused under a thread still
moving bytes through it.
"""

from __future__ import annotations

import array
import builtins
import collections
import contextlib
import fcntl
import hmac
import itertools
import logging
import os
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf.message import DecodeError

from kvx._datapath import gpu
from kvx._datapath import io as _io
from kvx._datapath import staging as _staging
from kvx._net import parse_address
from kvx.backends.control import wire as _wire
from kvx.backends.control.sock import check_header, recv_exact, recv_header, tune
from kvx.backends.control.wire import ErrorCode, MsgType
from kvx.descs import DESC_DTYPE, Descs
from kvx.errors import (
    AccessError,
    AuthError,
    ClosedError,
    ConfigError,
    ConnectError,
    EpochError,
    IntegrityError,
    KvxError,
    LimitError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
    TransferError,
    VersionError,
)
from kvx.memory import SMALL_LIST
from kvx.transfer import Op, Transfer
from kvx.v1 import handshake_pb2

if TYPE_CHECKING:
    from kvx.backends.base import BackendContext

logger = logging.getLogger(__name__)

# WRITE payloads up to this size are sent by the posting thread itself.
INLINE_SEND_BYTES = 256 * 1024
# A transfer is spread over several streams only when each gets this much.
MIN_STREAM_BYTES = 1 << 20
# A thread in Connection.lead looks at least this often whether it should stop
# (the transfer failed while the socket stayed up for a copy, say).
_LEAD_SLICE_S = 0.1
# ... and gives a message up to the reader when no byte of it came for this long:
# it may never come whole (a window smaller than the message), and the reader,
# which reads as the bytes come, costs only one thread wake-up more.
_LEAD_BODY_S = 0.01
# How long a thread in Connection.lead polls the socket for the next answer,
# without sleeping, before it sleeps in poll(): microseconds, KVX_TCP_SPIN_US
# overrides (0 never polls). An answer that comes within it saves the kernel's
# wake-up of a sleeping thread, the largest single cost of a small READ on a
# loopback or a fast network; a core is busy only while the thread waits for
# an answer of its own transfer, at most this long per answer.
SPIN_US = 100
# What a waiting thread reads itself (Connection.lead): answers to these requests
# (no pins, whose copies and revokes stay on the reader), with at most these many
# data and payload bytes. The reader copies a large answer while the rest of it still
# arrives; a waiting thread, which takes a message only once all of it is buffered,
# loses that overlap, and above a few hundred KiB the copy costs more than the
# thread wake-up saved: READs of 2-3 MiB took 18-39% longer with whole messages of up
# to 4 MiB led than with none (benchmarks/RESULTS.md, 2026-11-28).
_LED_REQUESTS = frozenset({MsgType.READ_REQ, MsgType.WRITE_REQ, MsgType.NOTIFY, MsgType.VERIFY})
_LED_ANSWERS = frozenset(
    {MsgType.READ_RESP, MsgType.WRITE_RESP, MsgType.NOTIFY_ACK, MsgType.VERIFY_OK, MsgType.ERROR}
)
_LEAD_MAX_DATA = 256 << 10
# A lone request whose answer the waiting thread takes in one call (Connection._take_answer).
_ONE_CALL_ANSWERS = frozenset({MsgType.READ_REQ, MsgType.WRITE_REQ})
_LEAD_MAX_PAYLOAD = 64 << 10
# sendv/recvv arguments: no (address, length) pairs; one pair of a header's length.
_NO_PAIRS = array.array("Q")
_HEADER_LEN = array.array("Q", [_wire.HEADER_SIZE])
# A pinned transfer is cut into requests only to spread it over several
# streams; its bytes never pass through a message.
_NO_BYTE_LIMIT = 1 << 62

_ERRORS: dict[int, type[KvxError]] = {
    ErrorCode.ACCESS: AccessError,
    ErrorCode.LIMIT: LimitError,
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.VERSION: VersionError,
    ErrorCode.EPOCH: EpochError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.INTEGRITY: IntegrityError,
}


_RESPONSE = {
    MsgType.READ_REQ: MsgType.READ_RESP,
    MsgType.WRITE_REQ: MsgType.WRITE_RESP,
    MsgType.NOTIFY: MsgType.NOTIFY_ACK,
    MsgType.SHM_PIN: MsgType.SHM_PIN_OK,
    MsgType.VERIFY: MsgType.VERIFY_OK,
    MsgType.RDMA_CONNECT: MsgType.RDMA_CONNECT_OK,
}
# Answers that carry a payload for Link.ask (at most MAX_HANDSHAKE_BYTES).
_ASKED = frozenset({MsgType.RDMA_CONNECT_OK})


def _remote_error(code: int, text: str, peer: str) -> KvxError:
    return _ERRORS.get(code, TransferError)(f"peer {peer!r}: {text}")


class Links:
    """The initiator connections of one agent, so that closing it ends them all."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.spin_us = _io.spin_us("KVX_TCP_SPIN_US", SPIN_US)
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()  # until their reader ends
        self._closed = False

    def open(self, target_name: str, target_epoch: int, address: str, streams: int) -> Link:
        """Dial ``streams`` connections and run the handshake on each. The
        link's readers start with ``link.start()``; until then the caller may
        send control requests on it (``link.request``)."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"agent {self.ctx.agent_name!r} is closed")
        conns: list[Connection] = []
        try:
            for index in range(streams):
                sock, limits = dial(self.ctx, target_name, target_epoch, address)
                try:
                    conn = Connection(self, sock, target_name, index)
                except BaseException:
                    sock.close()
                    raise
                conns.append(conn)
        except BaseException:
            for conn in conns:
                conn.abandon()
            raise
        with self._lock:
            self._conns.update(conns)
        return Link(self.ctx, target_name, conns, *limits)

    def _connection_closed(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> list[threading.Thread]:
        """Fail everything in flight; returns the threads to join."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for conn in conns:
            conn.shutdown(ClosedError(f"agent {self.ctx.agent_name!r} was closed"))
        return [t for conn in conns for t in (conn.reader, conn.sender) if t is not None]


def dial(
    ctx: BackendContext, target_name: str, target_epoch: int, address: str
) -> tuple[socket.socket, tuple[int, int]]:
    """Connect and run the handshake; returns the socket and the target's limits."""
    host, port = parse_address(address)
    timeout_s = ctx.timeouts.connect_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ConnectError(f"cannot connect to peer {target_name!r} at {address}: {exc}") from exc
    try:
        tune(sock, timeout_s)
        nonce = os.urandom(_wire.NONCE_BYTES)
        hello = handshake_pb2.Hello(
            name=ctx.agent_name,
            epoch=ctx.epoch,
            target_name=target_name,
            target_epoch=target_epoch,
            nonce=nonce,
        ).SerializeToString()
        deadline = time.monotonic() + timeout_s
        sock.sendall(_wire.pack(MsgType.HELLO, payload_len=len(hello)) + hello)
        reply = handshake_pb2.HelloReply.FromString(
            handshake_reply(sock, MsgType.HELLO_REPLY, target_name, deadline)
        )
        if len(reply.nonce) != _wire.NONCE_BYTES or reply.name != target_name or reply.epoch != target_epoch:
            raise ProtocolError(f"peer {target_name!r} answered the handshake with another identity or nonce")
        ids = (ctx.agent_name, target_name, ctx.epoch, target_epoch)
        secret = ctx.secret
        if reply.auth_required and secret is None:
            raise AuthError(
                f"peer {target_name!r} requires authentication; configure the cluster's auth_secret"
            )
        if secret is not None:
            if not reply.auth_required:
                raise AuthError(
                    f"peer {target_name!r} has no auth_secret while this agent has one; "
                    "configure the same secret on both"
                )
            expected = _wire.target_proof(secret, nonce, reply.nonce, *ids)
            if not hmac.compare_digest(reply.proof, expected):
                raise AuthError(f"peer {target_name!r} failed the HMAC challenge: another auth_secret")
        proof = _wire.initiator_proof(secret, nonce, reply.nonce, *ids) if secret else b""
        auth = handshake_pb2.Auth(proof=proof).SerializeToString()
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(_wire.pack(MsgType.AUTH, payload_len=len(auth)) + auth)
        handshake_reply(sock, MsgType.AUTH_OK, target_name, deadline)
        if reply.max_message_bytes <= 0 or reply.max_descs_per_message <= 0:
            raise ProtocolError(f"peer {target_name!r} announced invalid limits")
        sock.settimeout(ctx.timeouts.io_s)
        return sock, (reply.max_message_bytes, reply.max_descs_per_message)
    except KvxError:
        sock.close()
        raise
    except (OSError, ValueError, DecodeError) as exc:  # DecodeError is no ValueError
        sock.close()
        raise ConnectError(f"handshake with peer {target_name!r} at {address} failed: {exc}") from exc


def handshake_reply(sock: socket.socket, expect: int, peer: str, deadline: float) -> bytes:
    """The answer to a request sent before the connection's reader started."""
    try:
        msg_type, _, payload_len, aux, data_len = check_header(recv_exact(sock, _wire.HEADER_SIZE, deadline))
    except PeerLostError as exc:
        raise ConnectError(f"peer {peer!r} closed the connection during the handshake") from exc
    except TimeoutError as exc:
        raise ConnectError(f"peer {peer!r} did not answer the handshake in time") from exc
    if payload_len > _wire.MAX_HANDSHAKE_BYTES or data_len:
        raise ProtocolError(f"peer {peer!r} sent an oversized handshake message")
    payload = bytes(recv_exact(sock, payload_len, deadline))
    if msg_type == MsgType.ERROR:
        raise _remote_error(aux, payload.decode(errors="replace"), peer)
    if msg_type != expect:
        raise ProtocolError(f"peer {peer!r} answered the handshake with message type {msg_type}")
    return payload


class Part:
    """One request of a transfer.

    ``holds`` counts what must end before the part may finish: its response
    (always) and, when it carries data, the send of that data. The part
    finishes when the last hold is released, so a transfer never finishes
    while a thread still moves bytes of its memory, whichever order the
    response, the send and a connection failure come in.
    """

    __slots__ = (
        "transfer",
        "op",
        "addrs",
        "lens",
        "nbytes",
        "holds",
        "error",
        "copy",
        "device",
        "keep",
        "answer",
    )

    def __init__(
        self, transfer: Transfer, op: MsgType, addrs: Any, lens: Any, nbytes: int, device: int = -1
    ) -> None:
        self.transfer = transfer
        self.op = op
        self.addrs = addrs  # READ: where the response lands; WRITE: what is sent
        self.lens = lens
        self.nbytes = nbytes
        self.holds = 2 if self.sends_data else 1
        self.error: KvxError | None = None
        self.answer = b""  # Link.ask: the answer's payload
        # SHM_PIN: fn((base, size) per pinned region) moves the bytes.
        self.copy: Callable[[np.ndarray], None] | None = None
        # The CUDA device of addrs, or -1 (host memory): device bytes go through pinned buffers (_staging).
        self.device = device
        # SHM_PIN with PIN_KEEP: (region ids, for writing, words per region the pin's kind adds)
        # that the answer leases to this connection.
        self.keep: tuple[np.ndarray, bool, int] | None = None

    @property
    def sends_data(self) -> bool:
        return self.op == MsgType.WRITE_REQ


def _translate(exc: BaseException, peer: str, io_s: float) -> KvxError:
    """An error from a socket or the byte path, as the kvx error it means."""
    if isinstance(exc, TimeoutError):
        return TimeoutError(f"peer {peer!r} answered nothing for {io_s}s (Timeouts.io_s)")
    if isinstance(exc, KvxError):
        return exc
    if isinstance(exc, builtins.TimeoutError):
        return TimeoutError(f"peer {peer!r} moved no data for {io_s}s (Timeouts.io_s): {exc}")
    if isinstance(exc, OSError):
        return PeerLostError(f"connection to peer {peer!r} lost: {exc}")
    if not isinstance(exc, Exception):
        return TransferError(f"reading from peer {peer!r} was interrupted ({type(exc).__name__})")
    return TransferError(f"internal error: {exc!r}")


def _buffered(fd: int) -> int:
    """Bytes waiting in a socket's receive buffer."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def _set_lowat(sock: socket.socket, old: int, new: int) -> int:
    """Wake poll() only once ``new`` bytes are buffered (SO_RCVLOWAT; Linux
    grows the receive buffer to hold them, up to half of its largest size,
    and caps the mark there). Returns the mark in force."""
    if new == old:
        return old
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, new)
    if new == 1:
        return 1
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
    except OSError:
        return new  # the caller's finally sets it back


# SO_LINGER on, 0 s: close() resets the connection instead of finishing it.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class Connection:
    """One initiator connection: pipelined requests, one reader thread, and a
    sender thread for large payloads and for sends that would have to wait.

    The reader thread never blocks on the send lock: what cannot be sent at
    once goes to the sender thread.
    """

    def __init__(self, links: Links, sock: socket.socket, peer: str, index: int) -> None:
        self.links = links
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.io_ms = links.ctx.io_ms
        self.io_s = links.ctx.timeouts.io_s
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.pending: dict[int, Part] = {}
        self.receiving: Part | None = None  # the part the reader is moving bytes into
        # Copies of pinned (or leased) ranges running, on the reader or on posting
        # threads: while any runs, the socket stays up, so the target keeps the pins.
        self.copies = 0
        self.copies_done = threading.Condition(self.lock)
        self.copy_waiters = 0
        # Leases held on this connection: (region id, for writing) -> (base, size,
        # then what the pin's kind adds: an rdma key), and per region the copies
        # using it (see wire.py, PIN_KEEP).
        self.leases: dict[tuple[int, bool], tuple[int, ...]] = {}
        self.lease_uses: dict[int, int] = {}  # a dict, not a Counter: its += and del run Python code
        self.ids = itertools.count(1)
        self.error: KvxError | None = None
        self.closed = False
        self.last_progress = time.monotonic()
        self.queue: collections.deque[tuple[Part | None, bytes]] = collections.deque()
        self.queue_cv = threading.Condition(self.lock)
        self.sender: threading.Thread | None = None
        self.on_break: Callable[[KvxError], None] | None = None  # set by the link
        self.on_closed: Callable[[Connection], None] | None = None  # set by the link: after the reader ended
        # Set by a backend (Link.hook_peer_reset): RDMA_RESET's rail pair, from the reader; must not block.
        self.on_peer_reset: Callable[[int], None] | None = None
        # Set by a backend (Link.hook_revoked): the leases a revoke ended and those left, with
        # the lock held, once no copy uses the ended ones.
        self.on_revoked: Callable[[list[tuple[int, ...]], list[tuple[int, ...]]], None] | None = None
        # The thread reading the socket now (the reader, or a waiting thread in lead()), or None.
        self.reading: threading.Thread | None = None
        self.turn_cv = threading.Condition(self.lock)  # the reader waits here for lead() to end
        self.lead_turns = 0  # lead() turns ended so far
        self.lead_deadline = 0.0  # when the turn's wait ends (time.monotonic())
        self.answers_led = 0  # answers read by waiting threads (lead)
        self.spin_us = links.spin_us
        # Waits in lead() that ended readable without sleeping: the answer (or the end) came
        # while the thread polled, or was there already. A test and diagnostic counter.
        self.spins_caught = 0
        self.sock_closed = threading.Event()
        # The reader sleeps here (an epoll set holding the socket), lead() takes the socket out.
        self._parked = select.epoll()
        try:
            self._parked.register(self.fd, select.EPOLLIN)
        except BaseException:
            self._parked.close()
            raise
        self._lead_poll = select.poll()  # only the thread in lead() uses it
        self._lead_poll.register(self.fd, select.POLLIN)
        # Where a header that was peeked goes when it is taken off the socket (the thread
        # with the reading turn writes it; nothing reads it).
        self._header_taken = np.zeros(_wire.HEADER_SIZE, dtype=np.uint8)
        self._header_at = array.array("Q", [self._header_taken.ctypes.data])
        self.reader = threading.Thread(target=self._read_loop, name=f"kvx-read-{peer}-{index}", daemon=True)

    def start(self) -> None:
        self.reader.start()

    def abandon(self) -> None:
        """Close a connection whose reader never started."""
        assert not self.reader.is_alive()
        self.error = self.error or ClosedError("connect failed")
        self.closed = True
        self._parked.close()
        self.sock.close()
        self.sock_closed.set()
        self.links._connection_closed(self)
        if self.on_closed is not None:
            self.on_closed(self)

    def _release(self, part: Part, error: KvxError | None = None) -> None:
        with self.lock:
            if error is not None and part.error is None:
                part.error = error
            part.holds -= 1
            last = part.holds == 0
        if last:
            part.transfer.part_finished(part.error)

    def submit(self, part: Part, prefix: bytes, request_id: int) -> None:
        """Send one request now if the socket is free, else queue it."""
        with self.lock:
            if self.error is not None:
                error = self.error
            else:
                error = None
                self.pending[request_id] = part
                self.last_progress = time.monotonic()
                part.transfer.offer_lead(self)
                inline = (
                    not self.queue
                    and not (part.sends_data and (part.nbytes > INLINE_SEND_BYTES or part.device >= 0))
                    and self.send_lock.acquire(blocking=False)
                )
                if not inline:
                    self._enqueue(part, prefix)
                    return
        if error is not None:
            part.holds = 0
            part.transfer.part_finished(_again(error))
            return
        self._send_locked(part, prefix)

    def _send_locked(self, part: Part | None, prefix: bytes) -> None:
        """Send with send_lock held (released here); then release the send hold."""
        # The part whose data follows the prefix; None for a message without data.
        data_part = part if part is not None and part.sends_data else None
        error = None
        try:
            try:
                if self.closed or self.error is not None:
                    raise self.error or PeerLostError(f"connection to peer {self.peer!r} is closed")
                if data_part is not None and data_part.device >= 0:
                    _staging.send(
                        gpu.engine(data_part.device),
                        _io.sendv,
                        self.fd,
                        prefix,
                        data_part.addrs,
                        data_part.lens,
                        self.io_ms,
                    )
                elif data_part is not None:
                    _io.sendv(self.fd, prefix, data_part.addrs, data_part.lens, self.io_ms)
                else:  # sendmsg at once (the socket's own sendall would poll() first)
                    _io.sendv(self.fd, prefix, _NO_PAIRS, _NO_PAIRS, self.io_ms)
            finally:
                self.send_lock.release()
        except BaseException as exc:
            error = _translate(exc, self.peer, self.io_s)
            self.shutdown(error)
        if data_part is not None:
            self._release(data_part, _again(error) if error is not None else None)

    def _send_loop(self) -> None:
        while True:
            with self.lock:
                while not self.queue and self.error is None:
                    self.queue_cv.wait()
                if self.error is not None:
                    return  # shutdown() failed what was queued
                part, prefix = self.queue.popleft()
            self.send_lock.acquire()
            self._send_locked(part, prefix)

    def shutdown(self, error: KvxError) -> None:
        """Fail everything in flight with ``error``; the reader then closes the socket.

        Bytes being moved right now (the reader's current receive, a send in
        progress) are left to the thread moving them, which releases its hold
        when its system call returns; shutting the socket down makes that soon.
        """
        with self.lock:
            if self.error is None:
                self.error = error
            error = self.error
            failed = [p for p in self.pending.values() if p is not self.receiving]
            self.pending = {i: p for i, p in self.pending.items() if p is self.receiving}
            queued, self.queue = list(self.queue), collections.deque()
            self.queue_cv.notify_all()
            # While a pinned shm range is being copied the socket stays up: its
            # end would let the target unpin (and free) memory still being copied.
            # The last copy to end shuts it down.
            copying = self.copies > 0
        if failed:
            # Requests whose outcome we no longer wait for: the close resets the
            # connection, and a target that has not served them yet (it was
            # stopped, say) sees the reset and drops them (InboundConnection.abandoned).
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        if not copying:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        for part in failed:
            self._release(part, _again(error))
        for queued_part, _ in queued:
            if queued_part is not None and queued_part.sends_data:
                self._release(queued_part, _again(error))  # its data was never sent
        if self.on_break is not None:
            self.on_break(error)

    def _read_loop(self) -> None:
        me = self.reader
        try:
            while True:
                self._await_message()
                try:
                    self._read_one()
                finally:
                    with self.lock:
                        self.reading = None
        except BaseException as exc:
            self._reading_failed(exc)
        finally:
            with self.lock:
                self._turn_back()  # a thread in lead() sees the error and stops
                self.reading = me  # for good: the socket is about to close
            self._close_socket()

    def _await_message(self) -> None:
        """The reader's wait: until a message arrives that no waiting thread
        takes (``lead``). Returns with the reading turn (``self.reading``).

        The reader sleeps in an epoll set, not on the socket itself, so that
        ``lead`` can take the socket out of the set: an answer read by the
        waiting thread then wakes no one else."""
        parked, me = self._parked, self.reader
        while True:
            with self.lock:
                idle_s = self.io_s - (time.monotonic() - self.last_progress) if self.pending else self.io_s
                turns = self.lead_turns
            ready = parked.poll(max(idle_s, 0.0) + 0.001)
            with self.lock:
                self._turn_back()  # a waiting thread reads; it hands the socket back
                self.reading = me
                if ready and self.lead_turns == turns:
                    return  # no waiting thread read since the poll: what woke us is there
                error = self.error
                stalled = bool(self.pending) and time.monotonic() - self.last_progress >= self.io_s
            with contextlib.suppress(OSError):  # a lead() cut short may have left its mark
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            if parked.poll(0):
                return
            with self.lock:
                self.reading = None
            if error is not None:
                raise _again(error)  # the socket should have woken us; end anyway
            if stalled:
                raise TimeoutError("no message from the peer within the timeout")

    def _turn_back(self) -> None:
        """With self.lock held: wait until no thread in ``lead`` has the turn.

        A thread interrupted (Ctrl-C) at the wrong moment of its hand-back
        could keep it forever; the turn is taken back from a thread that has
        ended, or that holds it ``io_s`` past the end of its wait, and the
        socket is put back in the epoll set."""
        while self.reading is not None:
            holder = self.reading
            if self.turn_cv.wait(self.io_s) or self.reading is not holder:
                continue
            if holder.is_alive() and time.monotonic() < self.lead_deadline + self.io_s:
                continue
            logger.warning("peer %s: took the connection back from thread %s", self.peer, holder.name)
            self.reading = None
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            with contextlib.suppress(OSError):
                self._parked.register(self.fd, select.EPOLLIN)

    def lead(self, transfer: Transfer, deadline: float) -> None:
        """Wait for ``transfer`` by reading its answers on the calling thread
        (``Transfer.wait`` calls this): one thread wake-up per request instead
        of two (the reader's, then the waiter's), with the reader left asleep.

        Only while every request in flight on the connection is the
        transfer's own (host memory, no pins), and no other thread reads. The
        waiting thread takes a message only once all of it is in the socket's
        buffer, so a peer that sends slowly cannot hold it past ``deadline``;
        anything else (another type, a larger message, a message that stops
        coming) is left to the reader. Returns when the transfer has
        finished, when the waiting thread stops reading, or at ``deadline``.
        A stall or a broken connection is handled as the reader would: the
        connection ends, and this returns once the reader has closed it (or
        at ``deadline``, or after ``Timeouts.close_s``)."""
        me = threading.current_thread()
        ended = False
        try:
            with self.lock:
                if self.reading is not None or not self._may_lead(transfer):
                    return
                self.reading = me
                self.lead_deadline = deadline
            self._parked.unregister(self.fd)
            ended = self._lead_loop(transfer, deadline)
        finally:
            if self.reading is me:
                try:
                    self._parked.register(self.fd, select.EPOLLIN)
                except FileExistsError:
                    pass
                except OSError as exc:  # the reader could not wake for this socket any more
                    self.shutdown(PeerLostError(f"connection to peer {self.peer!r} lost: {exc}"))
                finally:
                    with self.lock:
                        self.reading = None
                        self.lead_turns += 1  # the reader checks what woke it again
                        self.turn_cv.notify()
        if ended:
            # The reader closes the socket now (reset, when requests were still in flight):
            # wait for that, so that the failure is reported after it, within the wait's time.
            self.sock_closed.wait(min(self.links.ctx.timeouts.close_s, max(0.0, deadline - time.monotonic())))

    def _lead_loop(self, transfer: Transfer, deadline: float) -> bool:
        """``lead``'s reading, with the turn held; True when it ended the connection."""
        fd, lowat = self.fd, 1
        try:
            while True:
                with self.lock:
                    if not self._may_lead(transfer):
                        return False
                    stalled = bool(self.pending) and time.monotonic() - self.last_progress >= self.io_s
                    # One READ or WRITE in flight: its answer is known to the byte but for its data.
                    sole = next(iter(self.pending.items())) if len(self.pending) == 1 else None
                    if sole is not None and sole[1].op not in _ONE_CALL_ANSWERS:
                        sole = None
                if stalled:
                    if _buffered(fd):
                        return False  # bytes came, slowly: the reader judges them by io_s
                    self._reading_failed(TimeoutError("no message from the peer within the timeout"))
                    return True
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return False
                if lowat == 1:
                    # Waiting for the next header: both waits return at once when the socket
                    # is readable already, so no count of its bytes comes first.
                    spin_us = min(self.spin_us, int(left_s * 1e6))  # a short wait polls no longer
                    if spin_us > 0 and _io.wait_readable(fd, spin_us):
                        self.spins_caught += 1  # readable within the poll: the thread did not sleep
                    elif not self._lead_poll.poll(max(1, int(min(left_s, _LEAD_SLICE_S) * 1000))):
                        continue
                    if sole is not None:
                        try:
                            took = self._take_answer(*sole)
                        except BaseException as exc:
                            self._reading_failed(exc)
                            if not isinstance(exc, Exception):
                                raise
                            return True
                        if took:
                            self.answers_led += 1
                            continue
                        if self.error is not None:
                            return False  # shut down meanwhile
                    have = _buffered(fd)
                else:
                    had = have = _buffered(fd)
                    if had < lowat:
                        woke = bool(self._lead_poll.poll(max(1, int(min(left_s, _LEAD_BODY_S) * 1000))))
                        have = _buffered(fd)
                        if have == had:
                            # Nothing came for a while (the message stopped coming), or the poll
                            # woke for the end of the connection: the reader takes it from here.
                            return False
                        if not woke:
                            continue
                if have == 0:  # readable with nothing to read: the peer closed or reset
                    self._read_one()  # raises what the reader would
                    return False
                if have < _wire.HEADER_SIZE:
                    lowat = _set_lowat(self.sock, lowat, _wire.HEADER_SIZE)
                    if lowat < _wire.HEADER_SIZE:
                        return False
                    continue
                header = _io.peek(fd, _wire.HEADER_SIZE)
                if len(header) < _wire.HEADER_SIZE:
                    return False  # less than counted (urgent data stops a peek): the reader's
                msg_type, request_id, payload_len, _, data_len = check_header(header)
                if (
                    msg_type not in _LED_ANSWERS
                    or data_len > _LEAD_MAX_DATA
                    or payload_len > _LEAD_MAX_PAYLOAD
                ):
                    return False
                total = _wire.HEADER_SIZE + payload_len + data_len
                with self.lock:
                    part = self.pending.get(request_id)
                if part is None or part.transfer is not transfer:
                    return False  # not its own (or a protocol error): the reader's
                if have < total:
                    # Sleep until all of it is here only if the receive buffer holds it as it
                    # is. Raising SO_RCVLOWAT grows the buffer, but the window the peer was
                    # told opens only once something is read: a message larger than the
                    # window stops coming (a new connection's 128 KiB buffer took 124 KiB of
                    # a 256 KiB answer, then nothing). The window is at most about half the
                    # buffer until the kernel has measured the real overhead per byte.
                    if total > self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2:
                        return False
                    lowat = _set_lowat(self.sock, lowat, total)
                    if lowat < total:
                        return False  # the kernel caps the mark below the message: the reader's
                    continue
                lowat = _set_lowat(self.sock, lowat, 1)
                try:
                    self._read_one(header)  # all of it is buffered: nothing here waits on the peer
                except BaseException as exc:
                    self._reading_failed(exc)
                    if not isinstance(exc, Exception):
                        raise  # KeyboardInterrupt and the like, after the connection ended
                    return True
                self.answers_led += 1
        except (KvxError, OSError) as exc:  # a bad header; the socket failed
            self._reading_failed(exc)
            return True
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def _may_lead(self, transfer: Transfer) -> bool:
        """With self.lock held: the transfer is unfinished, has no done
        callbacks or verify check to run (they would run while this thread
        holds the socket, perhaps under a lock of the caller's), and every
        request in flight is its own, of a kind ``lead`` reads (a READ's
        answer at most ``_LEAD_MAX_DATA`` long: for a longer one the waiting
        thread would only wake for its header and hand the socket back)."""
        return (
            not transfer.done()
            and not transfer.runs_user_work()
            and self.error is None
            and bool(self.pending)
            and all(
                part.transfer is transfer
                and part.op in _LED_REQUESTS
                and part.device < 0
                and (part.op != MsgType.READ_REQ or part.nbytes <= _LEAD_MAX_DATA)
                for part in self.pending.values()
            )
        )

    def _reading_failed(self, exc: BaseException) -> None:
        """Reading the socket failed with ``exc``: end the connection."""
        with self.lock:
            error = self.error
        if error is None and isinstance(exc, Exception) and not isinstance(exc, (KvxError, OSError)):
            logger.error("reading from peer %s failed", self.peer, exc_info=exc)
        self.shutdown(error or _translate(exc, self.peer, self.io_s))

    def _read_one(self, peeked: bytes | None = None) -> None:
        """Read one message and act on it; the caller has the reading turn.
        ``peeked``: its header, seen with ``peek`` (and checked) by a caller
        that knows the whole message is buffered."""
        if peeked is None:
            header: bytes | bytearray | None = recv_header(self.sock, self._idle)
            if header is None:
                raise PeerLostError(f"peer {self.peer!r} closed the connection")
        else:
            header = peeked
            # The same bytes, taken off the socket: one recvmsg (recv_header would poll first).
            _io.recvv(self.fd, self._header_at, _HEADER_LEN, self.io_ms)
        msg_type, request_id, payload_len, aux, data_len = check_header(header)
        if msg_type == MsgType.SHM_REVOKE:
            self._revoke(request_id, payload_len, aux, data_len)
            return
        if msg_type == MsgType.RDMA_RESET:
            self._peer_reset(request_id, payload_len, aux, data_len)
            return
        with self.lock:
            if self.error is not None:
                raise _again(self.error)
            part = self.pending.get(request_id)
            if part is None:
                raise ProtocolError(f"peer {self.peer!r} answered unknown request {request_id}")
            self.receiving = part
        try:
            result = self._read_response(part, request_id, msg_type, payload_len, aux, data_len)
        except BaseException as exc:
            failure = _translate(exc, self.peer, self.io_s)
            try:
                with self.lock:
                    self.pending.pop(request_id, None)
                    self.receiving = None
            finally:
                self._release(part, _again(failure))
            if not isinstance(exc, Exception):
                raise  # an interrupt of the waiting thread in lead(): the caller ends the connection
            raise failure from exc
        try:
            with self.lock:
                self.pending.pop(request_id, None)
                self.receiving = None
                self.last_progress = time.monotonic()
        finally:
            self._release(part, result)
        if msg_type == MsgType.SHM_PIN_OK and part.keep is None:
            # Unpinned only now: finishing the transfer first takes the send off its critical path.
            self.send_oneway(_wire.pack(MsgType.SHM_UNPIN, request_id))

    def _take_answer(self, request_id: int, part: Part) -> bool:
        """The answer to READ or WRITE ``part`` in one call (``recv_answer``), when the
        socket holds exactly the expected header and all of the data: True
        once its bytes landed and the part is released; False, with nothing
        read, when something else is there (an error, another message, not
        all of it yet), for ``_read_one`` to take. The caller has the reading
        turn; an exception means the connection failed, the part with it."""
        if part.op == MsgType.READ_REQ:
            expect, addrs, lens = (
                _wire.pack(MsgType.READ_RESP, request_id, data_len=part.nbytes),
                part.addrs,
                part.lens,
            )
        else:  # a WRITE's answer is its header alone (part.addrs is what it sent)
            expect, addrs, lens = _wire.pack(MsgType.WRITE_RESP, request_id), _NO_PAIRS, _NO_PAIRS
        marked = took = False
        failure: KvxError | None = None
        try:
            with self.lock:
                if self.error is not None or self.pending.get(request_id) is not part:
                    return False
                marked = True
                self.receiving = part  # shutdown() leaves it to this thread meanwhile
            took = _io.recv_answer(self.fd, expect, addrs, lens, self.io_ms)
        except BaseException as exc:
            failure = _translate(exc, self.peer, self.io_s)
            if not isinstance(exc, Exception):
                raise  # an interrupt of the waiting thread: the caller ends the connection
            raise failure from exc
        finally:
            # Whatever happened, an interrupt included, the part leaves this thread settled.
            if marked:
                error = failure or self.error
                settled = took or error is not None  # done, failed, or shut down meanwhile
                try:
                    with self.lock:
                        self.receiving = None
                        if settled:
                            self.pending.pop(request_id, None)
                        if took:
                            self.last_progress = time.monotonic()
                finally:
                    if settled:
                        self._release(part, None if took or error is None else _again(error))
        return took

    def _idle(self) -> bool:
        """While waiting for a response: True if the wait is not (yet) a stall.

        The socket's own timeout runs in whole io_s steps from the last
        response, so a request posted during one step would be declared
        stalled only at the end of the next (up to 2 * io_s); what is left of
        io_s since the last progress is waited out here instead."""
        with self.lock:
            if not self.pending:
                return True
            left_s = self.io_s - (time.monotonic() - self.last_progress)
        if left_s <= 0:
            return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if poller.poll(max(1, int(left_s * 1000) + 1)):
            return True  # something arrived (or the socket closed): recv_into takes it
        with self.lock:
            return not self.pending or time.monotonic() - self.last_progress < self.io_s

    def _read_response(
        self, part: Part, request_id: int, msg_type: int, payload_len: int, aux: int, data_len: int
    ) -> KvxError | None:
        if msg_type == MsgType.ERROR:
            if payload_len > _wire.MAX_ERROR_TEXT_BYTES or data_len:
                raise ProtocolError(f"peer {self.peer!r} sent a malformed ERROR")
            text = bytes(recv_exact(self.sock, payload_len)).decode(errors="replace")
            return _remote_error(aux, text, self.peer)
        if msg_type != _RESPONSE[part.op] or (
            payload_len and msg_type != MsgType.SHM_PIN_OK and msg_type not in _ASKED
        ):
            raise ProtocolError(f"peer {self.peer!r} answered {part.op.name} with message type {msg_type}")
        if msg_type in _ASKED:
            if payload_len > _wire.MAX_HANDSHAKE_BYTES or data_len:
                raise ProtocolError(f"peer {self.peer!r} sent an oversized {MsgType(msg_type).name}")
            part.answer = bytes(recv_exact(self.sock, payload_len))
            return None
        if msg_type == MsgType.SHM_PIN_OK:
            return self._copy_pinned(part, request_id, payload_len, data_len)
        if msg_type == MsgType.READ_RESP:
            if data_len != part.nbytes:
                raise ProtocolError(f"peer {self.peer!r} sent {data_len} bytes for a read of {part.nbytes}")
            if part.device >= 0:
                _staging.recv(gpu.engine(part.device), _io.recvv, self.fd, part.addrs, part.lens, self.io_ms)
            else:
                _io.recvv(self.fd, part.addrs, part.lens, self.io_ms)
        elif data_len:
            raise ProtocolError(f"peer {self.peer!r} sent data with {MsgType(msg_type).name}")
        return None

    def _copy_pinned(self, part: Part, request_id: int, payload_len: int, data_len: int) -> KvxError | None:
        """SHM_PIN_OK: move the bytes of a pinned range, then unpin it."""
        if data_len or payload_len % 8 or payload_len > _wire.MAX_PIN_REPLY_BYTES or part.copy is None:
            raise ProtocolError(f"peer {self.peer!r} sent a malformed SHM_PIN_OK")
        remote_addrs = np.frombuffer(recv_exact(self.sock, payload_len), dtype=np.uint64)
        if part.keep is not None:
            n = len(part.keep[0])
            # Per region: base and size, then as many extra words as the pin's kind adds (after all pairs).
            extra = part.keep[2]
            if len(remote_addrs) != (2 + extra) * n:
                raise ProtocolError(f"peer {self.peer!r} answered a lease of {n} regions badly")
            words = remote_addrs.tolist()
        with self.lock:
            if self.error is not None:
                raise _again(self.error)
            if part.keep is not None:
                regions, writing, _ = part.keep
                granted = {}
                for i, rid in enumerate(regions.tolist()):
                    more = words[2 * n + extra * i : 2 * n + extra * (i + 1)]
                    granted[(rid, writing)] = (words[2 * i], words[2 * i + 1], *more)
                    held = self.leases.get((rid, writing))
                    if held is not None and held != granted[(rid, writing)]:
                        # Two pins of one region asked at once are both answered with
                        # a lease, the same one: a region's place never changes.
                        raise ProtocolError(f"peer {self.peer!r} leased region {rid} twice, differently")
                self.leases.update(granted)
            self.copies += 1
        try:
            part.copy(remote_addrs)
            result = None
        except ProtocolError:
            # The target answered with memory its region cannot be (outside its allocation,
            # say): nothing of it is trusted further; the connection ends, with its leases.
            raise
        except KvxError as exc:
            result = exc
        finally:
            self._copy_ended()
        return result

    def lease(self, regions: list[int], writing: bool) -> tuple[int, ...] | None:
        """What this connection leases for ``regions``, laid out as the pin's
        answer was (the (base, size) pairs, then the extras per region), with
        a copy begun on them (``unlease`` ends it); None when one is not leased."""
        with self.lock:
            if self.error is not None:
                return None
            leases = self.leases
            pairs: tuple[int, ...] | None
            if len(regions) == 1:
                pairs = leases.get((regions[0], writing))
                if pairs is None:
                    return None
            else:
                found = [leases.get((rid, writing)) for rid in regions]
                if None in found:
                    return None
                pairs = tuple(v for got in found if got is not None for v in got[:2]) + tuple(
                    v for got in found if got is not None for v in got[2:]
                )
            uses = self.lease_uses
            for rid in regions:
                uses[rid] = uses.get(rid, 0) + 1
            self.copies += 1
        return pairs

    def unlease(self, regions: list[int]) -> None:
        with self.lock:
            uses = self.lease_uses
            for rid in regions:
                left = uses[rid] - 1
                if left:
                    uses[rid] = left
                else:
                    del uses[rid]
            self.copies -= 1
            if self.copy_waiters:
                self.copies_done.notify_all()
            broken = self.error is not None and not self.copies
        if broken:
            self._copies_ended_broken()

    # lease and unlease have a twin in C, for the shm backend's latency path
    # (conn_leased_post in csrc/kvx_cma.c): the same fields, under the same
    # lock. Keep the three in step.

    def _copy_ended(self) -> None:
        with self.lock:
            self.copies -= 1
            if self.copy_waiters:
                self.copies_done.notify_all()
            broken = self.error is not None and not self.copies
        if broken:
            self._copies_ended_broken()

    def _copies_ended_broken(self) -> None:
        """The last copy ended after ``shutdown()``, which left the socket up
        while it ran: shut it down now."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _revoke(self, region_id: int, payload_len: int, aux: int, data_len: int) -> None:
        """SHM_REVOKE: forget the lease, let the copies using it end, release it."""
        if payload_len or aux or data_len:
            raise ProtocolError(f"peer {self.peer!r} sent a malformed SHM_REVOKE")
        with self.lock:
            gone = [self.leases.pop((region_id, w), None) for w in (False, True)]
            self.copy_waiters += 1
            while self.lease_uses.get(region_id):
                self.copies_done.wait()
            self.copy_waiters -= 1
            if self.on_revoked is not None:
                try:
                    self.on_revoked([g for g in gone if g is not None], list(self.leases.values()))
                except Exception:  # the release must still go out
                    logger.exception("letting go of region %d of peer %s failed", region_id, self.peer)
        self.send_oneway(_wire.pack(MsgType.SHM_RELEASE, region_id))

    def _peer_reset(self, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
        """RDMA_RESET: the target's rdma endpoint on rail pair ``aux`` was reset;
        the link's hook (the rdma channel) marks that pair for a reconnect."""
        hook = self.on_peer_reset
        if request_id or payload_len or data_len or hook is None:
            raise ProtocolError(f"peer {self.peer!r} sent a malformed or unexpected RDMA_RESET")
        hook(aux)

    def send_oneway(self, prefix: bytes) -> None:
        """Send a message that gets no answer: now if the socket is free, else queued."""
        with self.lock:
            if self.error is not None:
                return
            if self.queue or not self.send_lock.acquire(blocking=False):
                self._enqueue(None, prefix)
                return
        self._send_locked(None, prefix)

    def _enqueue(self, part: Part | None, prefix: bytes) -> None:
        """Queue for the sender thread (started on first use); self.lock held."""
        self.queue.append((part, prefix))
        if self.sender is None:
            self.sender = threading.Thread(target=self._send_loop, daemon=True, name=f"kvx-send-{self.peer}")
            self.sender.start()
        self.queue_cv.notify()

    def _close_socket(self) -> None:
        sender = self.sender
        if sender is not None and sender is not threading.current_thread():
            sender.join(self.links.ctx.timeouts.close_s)
        with self.lock:
            self.copy_waiters += 1
            while self.copies:  # copies of leased ranges on posting threads: they end soon
                self.copies_done.wait()
            self.copy_waiters -= 1
        with self.send_lock:
            self.closed = True
            self._parked.close()
            self.sock.close()
        self.sock_closed.set()
        self.links._connection_closed(self)
        if self.on_closed is not None:
            self.on_closed(self)


def _again(error: KvxError) -> KvxError:
    """A fresh exception of the same class for each transfer it fails."""
    fresh = type(error)(str(error))
    fresh.__cause__ = error.__cause__
    return fresh


class Link:
    """The authenticated control connections to one peer, which every
    backend's channel builds on; cuts transfers into parts and spreads them."""

    def __init__(
        self, ctx: BackendContext, peer: str, conns: list[Connection], max_message_bytes: int, max_descs: int
    ) -> None:
        self.ctx = ctx
        self.peer = peer
        self.conns = conns
        self.max_message_bytes = max_message_bytes  # the target's limits
        self.max_descs = max_descs
        self._next_conn = itertools.count()
        self._error: KvxError | None = None
        self._readers_left = len(conns)
        self._started = False
        self._hooks_lock = threading.Lock()
        self._close_hooks: list[Callable[[], None]] = []
        for conn in conns:
            conn.on_break = self._on_break
            conn.on_closed = self._reader_ended

    @property
    def alive(self) -> bool:
        return self._error is None

    @property
    def error(self) -> KvxError | None:
        return self._error

    def start(self) -> None:
        """Start the readers: from now on responses are taken as they come."""
        self._started = True
        for conn in self.conns:
            conn.start()

    def abandon(self) -> None:
        """Close a link whose readers never started (no peer was made of it);
        what channels hooked on its end (``when_closed``) runs."""
        self._error = self._error or ClosedError(f"link to peer {self.peer!r} was not used")
        for conn in self.conns:
            conn.abandon()

    def when_closed(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the last reader has ended: no copy can run any more
        (copies of pinned ranges run on the readers; copies through leases on
        posting threads, and the socket closes only after they end)."""
        with self._hooks_lock:
            self._close_hooks.append(fn)

    def _reader_ended(self, conn: Connection) -> None:
        with self._hooks_lock:
            self._readers_left -= 1
            if self._readers_left:
                return
            hooks, self._close_hooks = self._close_hooks, []
        for fn in hooks:
            try:
                fn()
            except Exception:  # a reader thread must end cleanly
                logger.exception("cleaning up after peer %s failed", self.peer)

    def _on_break(self, error: KvxError) -> None:
        if self._error is not None:
            return
        self._error = error
        for conn in self.conns:
            conn.shutdown(error)

    def close(self) -> None:
        self._on_break(ClosedError(f"channel to peer {self.peer!r} was closed"))

    def hook_peer_reset(self, fn: Callable[[int], None]) -> None:
        """Hand the target's RDMA_RESET notices (the rail pair in aux) to ``fn``,
        run on a reader thread: it must only take note (raise ProtocolError on a
        bad pair, which ends the connection), never block."""
        for conn in self.conns:
            conn.on_peer_reset = fn

    def hook_revoked(self, fn: Callable[[list[tuple[int, ...]], list[tuple[int, ...]]], None]) -> None:
        """Call ``fn(ended, left)`` when the target revokes a lease: the
        leases (as ``Connection.leases`` holds them) it ended and those the
        connection still holds, on the reader thread, with the connection's
        lock held, once no copy uses the ended ones and before the release
        goes out. It must not block on the connection."""
        for conn in self.conns:
            conn.on_revoked = fn

    def asking_would_block(self) -> bool:
        """The calling thread is the one that ``ask`` needs to read its answer:
        the reader, or a waiting thread reading in its place (``lead``)."""
        me, conn = threading.current_thread(), self.conns[0]
        return me is conn.reader or me is conn.reading

    def fail(self, error: KvxError) -> None:
        """End the link because of ``error`` (a backend found the peer dead
        or hung); everything in flight fails with it."""
        self._on_break(error)

    def conn(self) -> Connection:
        """The connection for the next request (round robin)."""
        if len(self.conns) == 1:
            return self.conns[0]
        return self.conns[next(self._next_conn) % len(self.conns)]

    def ask(self, msg_type: MsgType, payload: bytes) -> bytes:
        """A backend's control request once the link runs (``request`` is for
        before ``start()``): sent on the first connection, its answer read by
        that connection's reader. Returns the answer's payload; an ERROR
        answer raises its kvx error, no answer within ``Timeouts.connect_s``
        raises TimeoutError. Only types that ``_RESPONSE`` pairs with an
        answer in ``_ASKED``."""
        assert msg_type in _RESPONSE and _RESPONSE[msg_type] in _ASKED
        if len(payload) > _wire.MAX_HANDSHAKE_BYTES:
            raise LimitError(f"a control request carries at most {_wire.MAX_HANDSHAKE_BYTES} bytes")
        timeout_s = self.ctx.timeouts.connect_s
        transfer = Transfer(Op.READ, self.peer, 0, 1, timeout_s)
        part = Part(transfer, msg_type, None, None, 0)
        conn = self.conns[0]
        request_id = next(conn.ids)
        conn.submit(part, _wire.pack(msg_type, request_id, payload_len=len(payload)) + payload, request_id)
        transfer.wait(timeout_s)
        return part.answer

    def request(self, msg_type: int, expect: int, payload: bytes = b"") -> bytes:
        """A control request answered before ``start()`` (the reader would
        take the answer otherwise): a backend's set-up exchange (a segment
        token; a backend's own types from ``wire.BACKEND_TYPES``). Returns the
        answer's payload; both are at most ``wire.MAX_HANDSHAKE_BYTES``.

        An ERROR answer raises its kvx error and leaves the link as it was;
        anything else that goes wrong (no answer in time, a broken framing)
        breaks the link, since a late answer would confuse its reader."""
        if self._started:
            raise ConfigError("Link.request is for setting up a link, before start()")
        if len(payload) > _wire.MAX_HANDSHAKE_BYTES:
            raise LimitError(f"a control request carries at most {_wire.MAX_HANDSHAKE_BYTES} bytes")
        sock = self.conns[0].sock
        io_timeout = sock.gettimeout()  # the reader's stall detection relies on it: restore it after
        deadline = time.monotonic() + self.ctx.timeouts.connect_s
        try:
            sock.sendall(_wire.pack(msg_type, payload_len=len(payload)) + payload)
            answer, _, payload_len, aux, data_len = check_header(
                recv_exact(sock, _wire.HEADER_SIZE, deadline)
            )
            if payload_len > _wire.MAX_HANDSHAKE_BYTES or data_len:
                raise ProtocolError(
                    f"peer {self.peer!r} answered control request {msg_type} with "
                    f"{payload_len} bytes and {data_len} of data"
                )
            body = bytes(recv_exact(sock, payload_len, deadline))
            if answer not in (expect, MsgType.ERROR):
                raise ProtocolError(
                    f"peer {self.peer!r} answered control request {msg_type} with type {answer}"
                )
        except (KvxError, OSError) as exc:
            error = (
                exc
                if isinstance(exc, KvxError)
                else PeerLostError(f"peer {self.peer!r}: control request {msg_type} failed: {exc}")
            )
            self._on_break(error)
            raise error from None
        finally:
            sock.settimeout(io_timeout)
        if answer == MsgType.ERROR:
            raise _remote_error(aux, body.decode(errors="replace"), self.peer)
        return body

    def notify(self, transfer: Transfer, data: bytes) -> None:
        """A notification with no data, as one part of ``transfer``."""
        conn = self.conns[0]
        request_id = next(conn.ids)
        prefix = _wire.pack(MsgType.NOTIFY, request_id, payload_len=len(data)) + data
        conn.submit(Part(transfer, MsgType.NOTIFY, None, None, 0), prefix, request_id)

    def verify(self, transfer: Transfer, remote: np.ndarray, sums: np.ndarray, notify: bytes | None) -> None:
        """VERIFY, as one part of ``transfer``: the target checks ``sums``
        (CRC-32C per descriptor of ``remote``) against its memory, then
        delivers ``notify``."""
        conn = self.conns[0]
        request_id = next(conn.ids)
        extra = notify or b""
        payload = remote.tobytes() + sums.astype("<u4").tobytes() + extra
        prefix = _wire.pack(MsgType.VERIFY, request_id, payload_len=len(payload), aux=len(extra)) + payload
        conn.submit(Part(transfer, MsgType.VERIFY, None, None, 0), prefix, request_id)

    def notify_after(self, notify: bytes | None) -> Callable[[Transfer], None] | None:
        """For ``transfer.expect_parts``: the notification as a trailing part,
        sent once every byte has landed."""
        if notify is None:
            return None
        return lambda t: self.notify(t, notify)

    def post_pinned(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        flags: int,
        make_copy: Callable[[Any, Any, np.ndarray, np.ndarray], Callable[[Any], None]],
        keep: bool = False,
        rails: int = 1,
    ) -> None:
        """A transfer whose bytes the initiator moves itself: per part, the
        target checks and pins the regions (SHM_PIN), then the reader calls
        ``make_copy(addrs, lens, remote descs, region ids)(pinned)`` with
        the (base, size, ...) the target answered, and unpins. With ``keep``
        the pins become leases of the first connection (``Connection.lease``),
        which later transfers copy through at once (``copy_leased``); their
        answer must carry exactly the words per region that ``flags`` adds
        (``rails``: the target's rdma rails, a key each)."""
        parts = self.split(local_addrs, local_lens, total, remote, _NO_BYTE_LIMIT)
        transfer.expect_parts(len(parts), self.notify_after(notify))
        aux = (_wire.PIN_WRITE if op is Op.WRITE else _wire.PIN_READ) | flags
        if keep:
            aux |= _wire.PIN_KEEP
        for wire, addrs, lens, nbytes in parts:
            conn = self.conns[0] if keep else self.conn()
            request_id = next(conn.ids)
            regions = region_ids(wire)
            payload = regions.tobytes()
            part = Part(transfer, MsgType.SHM_PIN, addrs, lens, nbytes)
            part.copy = make_copy(addrs, lens, wire, regions)
            if keep:
                part.keep = (regions, op is Op.WRITE, _wire.pin_extra_words(aux, rails))
            prefix = _wire.pack(MsgType.SHM_PIN, request_id, payload_len=len(payload), aux=aux) + payload
            conn.submit(part, prefix, request_id)

    def copy_leased(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        remote: np.ndarray,
        notify: bytes | None,
        make_copy: Callable[[Any, Any, np.ndarray, np.ndarray], Callable[[Any], None]],
    ) -> bool:
        """Copy a transfer now, on this thread, through the leases of the
        first connection; False (nothing done) when its regions are not all
        leased: post it with ``post_pinned(keep=True)`` then."""
        if len(remote) <= SMALL_LIST:
            rids = sorted(set(remote["region"].tolist()))
            regions = np.array(rids, "<u4")
        else:
            regions = region_ids(remote)
            rids = regions.tolist()
        conn = self.conns[0]
        pinned = conn.lease(rids, op is Op.WRITE)
        if pinned is None:
            return False
        error: KvxError | None = None
        try:
            transfer.expect_parts(1, self.notify_after(notify))
            make_copy(local_addrs, local_lens, remote, regions)(pinned)
        except KvxError as exc:
            error = exc
        except Exception as exc:  # a bug: the transfer must still finish
            logger.exception("copy to peer %s failed", self.peer)
            error = TransferError(f"internal error: {exc!r}")
        finally:
            conn.unlease(rids)
        transfer.part_finished(error)
        return True

    def split(
        self, local_addrs: Any, local_lens: Any, total: int, remote: np.ndarray, max_bytes: int
    ) -> list[tuple[np.ndarray, Any, Any, int]]:
        """The requests of a transfer: (remote descriptors, local addresses,
        local lengths, bytes) each, within the target's limits and spread over
        the streams when it is large."""
        streams = len(self.conns) if total >= len(self.conns) * MIN_STREAM_BYTES else 1
        if streams == 1 and total <= max_bytes and len(remote) <= self.max_descs:
            # The common case, and the one latency depends on.
            return [(remote, local_addrs, local_lens, total)]
        cuts = plan_cuts(remote, total, max_bytes, self.max_descs, streams)
        remote_cut, remote_idx = Descs(remote).split_at(cuts)
        local = np.zeros(len(local_addrs), dtype=DESC_DTYPE)
        local["offset"] = local_addrs
        local["length"] = local_lens
        local_cut, local_idx = Descs(local).split_at(cuts)
        parts = []
        for k in range(len(cuts) - 1):
            mine = local_cut.array[local_idx[k] : local_idx[k + 1]]
            parts.append(
                (
                    remote_cut.array[remote_idx[k] : remote_idx[k + 1]],
                    np.ascontiguousarray(mine["offset"]),
                    np.ascontiguousarray(mine["length"]),
                    int(cuts[k + 1] - cuts[k]),
                )
            )
        return parts


def region_ids(remote: np.ndarray) -> np.ndarray:
    """The sorted, distinct region ids of descriptors, as the wire has them."""
    ids = remote["region"]
    return (ids[:1] if (ids == ids[0]).all() else np.unique(ids)).astype("<u4")


def plan_cuts(remote: np.ndarray, total: int, max_bytes: int, max_descs: int, streams: int) -> np.ndarray:
    """Byte positions that cut a transfer into requests within the target's limits.

    Cuts fall on remote descriptor ends where they can, so blocks stay whole;
    a descriptor larger than a message is cut inside.
    """
    ends = np.cumsum(remote["length"], dtype=np.uint64)
    nparts = max(streams, -(-total // max_bytes), -(-len(remote) // max_descs), 1)
    for _ in range(24):
        ideal = (np.arange(1, nparts, dtype=np.float64) * (total / nparts)).astype(np.uint64)
        below = np.searchsorted(ends, ideal, side="right") - 1
        snapped = np.where(below >= 0, ends[np.maximum(below, 0)], 0).astype(np.uint64)
        for inner in (snapped, ideal):
            cuts = np.unique(np.concatenate(([0], inner, [total])).astype(np.uint64))
            if _within(cuts, ends, max_bytes, max_descs):
                return cuts
        nparts *= 2
    # Always valid: every part inside one descriptor and at most max_bytes long.
    ideal = (np.arange(1, -(-total // max_bytes)) * max_bytes).astype(np.uint64)
    return np.unique(np.concatenate(([0], ends, ideal)).astype(np.uint64))


def _within(cuts: np.ndarray, ends: np.ndarray, max_bytes: int, max_descs: int) -> bool:
    if np.diff(cuts).max(initial=0) > max_bytes:
        return False
    first = np.searchsorted(ends, cuts[:-1], side="right")
    last = np.searchsorted(ends, cuts[1:], side="left")
    return int((last - first + 1).max(initial=0)) <= max_descs
