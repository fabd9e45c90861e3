"""The serving side of the control connection: the listener, and one thread
per inbound connection.

The remote application does nothing for a one-sided READ or WRITE; this
code (with the handlers the backends add: ``Backend.handlers``) does it on
its behalf, and it is the wall between a peer and local memory. Every
request is validated against the region table before a byte moves. A request that is wrong but well framed (a descriptor out of bounds,
an unknown region) gets an ERROR response and the connection stays up; a
message that breaks the framing (garbage, a wrong version, a size over the
limits) gets an ERROR where possible and the connection is closed. Either
way the agent goes on serving every other peer.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvx._datapath import checksum as _checksum
from kvx._datapath import io as _io
from kvx._net import format_address
from kvx.backends.control import wire as _wire
from kvx.backends.control.sock import check_header, recv_exact, recv_header, tune
from kvx.backends.control.wire import ErrorCode, MsgType
from kvx.config import check_name
from kvx.descs import DESC_DTYPE
from kvx.errors import (
    AccessError,
    AuthError,
    ConfigError,
    ConnectError,
    EpochError,
    IntegrityError,
    KvxError,
    LimitError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
    VersionError,
)
from kvx.memory import REMOTE_READ, REMOTE_WRITE
from kvx.v1 import handshake_pb2

if TYPE_CHECKING:
    from kvx.backends.base import BackendContext

logger = logging.getLogger(__name__)

DESC_SIZE = DESC_DTYPE.itemsize
# SHM_PIN ranges one connection may hold at once (the initiator holds one per
# request in flight, and Limits.max_inflight_per_peer bounds those).
MAX_PINS = 4096
# Inbound connections still in their handshake (not yet authenticated) at
# once, in all and from one address (an IPv6 /64 counts as one). Past either
# bound the oldest such connection (from the address with the most) is
# dropped to make room: a client that opens connections and never
# authenticates can then hold a slot only until newer connections come,
# never lock honest peers out, and one address holds at most a quarter of
# the slots. The per-address bound leaves room for a node whose GPUs' agents
# all connect at once, each over several connections (behind one address
# when the node translates addresses).
MAX_HANDSHAKES = 256
MAX_HANDSHAKES_PER_ADDRESS = 64
_WARN_EVERY_S = 10.0
# How much of a refused handshake's reason is logged.
_REASON_CHARS = 400
# How long and how much a connection closed for a protocol error is drained.
_LINGER_S = 0.5
_LINGER_BYTES = 1 << 20
# How long a serving thread polls its connection for the next request, without
# sleeping, before it sleeps: microseconds, KVX_SERVE_SPIN_US overrides. Off by
# default: the thread would poll after every request whether another comes or
# not, a core's time that a busy engine may need; a target that serves small
# requests back to back gains the kernel's wake-up of a sleeping thread per
# request (benchmarks/RESULTS.md, "Round ten").
SERVE_SPIN_US = 0

_ERROR_CODES: list[tuple[type[KvxError], ErrorCode]] = [
    (AccessError, ErrorCode.ACCESS),
    (IntegrityError, ErrorCode.INTEGRITY),
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


class Fatal(Exception):
    """Ends a connection; carries the error to report to the peer first."""

    def __init__(self, error: KvxError, request_id: int = 0) -> None:
        super().__init__(str(error))
        self.error = error
        self.request_id = request_id


# fn(connection, request id, payload length, aux, data length): serves one
# request whose header was read; raises Fatal to end the connection.
Handler = Callable[["InboundConnection", int, int, int, int], None]


# Served by every agent: they guard memory, so no backend may replace them.
_CORE_HANDLERS: dict[int, Handler] = {}  # filled below, once the handlers are defined
# kvx's own types that its built-in backends serve; other backends use wire.BACKEND_TYPES.
_BUILTIN_BACKEND_TYPES = {MsgType.READ_REQ, MsgType.WRITE_REQ, MsgType.SEG_TOKEN, MsgType.RDMA_CONNECT}


def merge_handlers(by_backend: dict[str, dict[int, Handler]]) -> dict[int, Handler]:
    """The listener's dispatch table: the core handlers plus each backend's,
    refused (ConfigError) where a backend claims a core type, a type outside
    its range, or one that another backend claimed."""
    table = dict(_CORE_HANDLERS)
    owner: dict[int, str] = {}
    for name, handlers in by_backend.items():
        for msg_type, handler in handlers.items():
            if msg_type in _CORE_HANDLERS:
                raise ConfigError(f"backend {name!r} may not serve message type {msg_type}: kvx serves it")
            if msg_type not in _wire.BACKEND_TYPES and msg_type not in _BUILTIN_BACKEND_TYPES:
                raise ConfigError(
                    f"backend {name!r} serves message type {msg_type}; a backend's own types "
                    f"are {_wire.BACKEND_TYPES.start}-{_wire.BACKEND_TYPES.stop - 1}"
                )
            if msg_type in owner:
                raise ConfigError(
                    f"backends {owner[msg_type]!r} and {name!r} both serve message type {msg_type}"
                )
            owner[msg_type] = name
            table[msg_type] = handler
    return table


class Listener:
    """Accepts peers' control connections and serves them."""

    def __init__(
        self,
        ctx: BackendContext,
        host: str,
        port: int,
        advertise_host: str | None,
        handlers: dict[str, dict[int, Handler]],
    ) -> None:
        self.ctx = ctx
        self.handlers = merge_handlers(handlers)
        self.spin_us = _io.spin_us("KVX_SERVE_SPIN_US", SERVE_SPIN_US)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ConnectError(f"cannot listen on {format_address(host, port)}: {exc}") from exc
        self._listener.listen(128)
        bound_port = self._listener.getsockname()[1]
        self.endpoint = format_address(advertise_host or host, bound_port)
        self._lock = threading.Lock()
        self._inbound: set[InboundConnection] = set()
        # Those in their handshake, oldest first (a dict keeps the order).
        self._handshakes: dict[InboundConnection, None] = {}
        self._evicted = 0
        self._warned_at = -_WARN_EVERY_S
        self._refused, self._refused_warned_at = 0, -_WARN_EVERY_S
        self._closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kvx-accept-{ctx.agent_name}", daemon=True
        )
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                with self._lock:
                    if self._closed:
                        return
                # EMFILE, ECONNABORTED, EPROTO...: transient; the listener stays up.
                logger.warning("accept failed on %s: %s", self.endpoint, exc)
                time.sleep(0.05)
                continue
            address = format_address(*addr[:2])
            conn: InboundConnection | None = None
            try:
                with self._lock:
                    if self._closed:
                        sock.close()
                        return
                    authenticated = len(self._inbound) - len(self._handshakes)
                    if authenticated >= self.ctx.limits.max_connections:
                        logger.warning(
                            "refusing connection from %s: %d peers connected (Limits.max_connections)",
                            address,
                            authenticated,
                        )
                        sock.close()
                        continue
                    host = _address_key(addr[0])
                    evicted = self._make_room(host)
                    tune(sock, self.ctx.timeouts.connect_s)
                    conn = InboundConnection(self, sock, address)
                    conn.host = host
                    self._inbound.add(conn)
                    self._handshakes[conn] = None
                if evicted is not None:
                    evicted.shutdown()
                conn.start()
            except Exception:  # a failure with one connection must not stop the listener
                logger.exception("could not serve connection from %s", address)
                if conn is not None:  # its thread did not start (a thread or pids limit): free its slot
                    self._inbound_done(conn)
                sock.close()

    def refused_handshake(self, conn: InboundConnection, error: Exception) -> None:
        """Log a connection refused in its handshake: at most one warning per
        _WARN_EVERY_S, with the count since the last and the latest reason (cut
        short: a HELLO's names come from whoever connected)."""
        now = time.monotonic()
        with self._lock:
            self._refused += 1
            if now - self._refused_warned_at < _WARN_EVERY_S:
                return
            count, self._refused, self._refused_warned_at = self._refused, 0, now
        reason = str(error)
        if len(reason) > _REASON_CHARS:
            reason = reason[:_REASON_CHARS] + "..."
        logger.warning(
            "refused %d connection(s) in their handshake since the last warning; the latest, from %s: %s",
            count,
            conn.address,
            reason,
        )

    def _make_room(self, host: str) -> InboundConnection | None:
        """With _lock held, before a connection from ``host`` joins the
        handshakes: the oldest handshake to drop for it, if any (its
        address's oldest when that address holds its share, else the oldest
        of the address holding the most)."""
        mine = [c for c in self._handshakes if c.host == host]
        if len(mine) >= MAX_HANDSHAKES_PER_ADDRESS:
            victim = mine[0]
        elif len(self._handshakes) >= MAX_HANDSHAKES:
            counts = collections.Counter(c.host for c in self._handshakes)
            busiest = counts.most_common(1)[0][0]
            victim = next(c for c in self._handshakes if c.host == busiest)
        else:
            return None
        del self._handshakes[victim]
        victim.evicted = True
        self._evicted += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:  # a flood must not flood the log too
            logger.warning(
                "%d connections still in their handshake (at most %d, %d per address): dropped the "
                "oldest to make room, %d times since the last warning (the latest from %s, for one from %s)",
                len(self._handshakes) + 1,
                MAX_HANDSHAKES,
                MAX_HANDSHAKES_PER_ADDRESS,
                self._evicted,
                victim.address,
                host,
            )
            self._warned_at, self._evicted = now, 0
        return victim

    def serves(self, inode: int) -> bool:
        """An authenticated inbound connection's socket has this inode."""
        with self._lock:
            return any(c.inode == inode and c.authenticated for c in self._inbound)

    def authenticated(self, conn: InboundConnection, name: str, epoch: int) -> bool:
        """The connection passed its handshake: it leaves the handshakes and
        keeps its place; False when it was dropped to make room first.

        The connections of an earlier instance of that peer (its name with
        another epoch: it restarted) end first, and their threads are waited
        for: what such a connection still has buffered, say a WRITE a killed
        process sent whose packets came late, must not land after the new
        instance's requests (the chaos soak saw one land over newer data)."""
        with self._lock:
            if conn.evicted:
                return False
            self._handshakes.pop(conn, None)
            conn.authenticated = True
            conn.claimed = (name, epoch)
            stale = [
                c
                for c in self._inbound
                if c is not conn and c.claimed is not None and c.claimed[0] == name and c.claimed[1] != epoch
            ]
        if stale:
            logger.warning(
                "peer %s connected as a new instance (epoch %#x): ending %d connection(s) of its "
                "previous one (or of another live agent of that name: names must be unique)",
                name,
                epoch,
                len(stale),
            )
            for old in stale:
                old.shutdown()
            for old in stale:  # within the new connection's handshake deadline, all together
                old.thread.join(max(0.0, (conn._deadline or 0.0) - time.monotonic()))
            if any(old.thread.is_alive() for old in stale):
                # Its thread may still apply what it had buffered: the new instance must not
                # be served before that, lest its requests land first. It connects again.
                raise PeerLostError(
                    f"a connection of the previous instance of {name!r} is still being served; retry"
                )
        return True

    def revoke(self, region_id: int) -> None:
        """Ask every peer that leases ``region_id`` to give it back
        (RegionTable.on_remove: a deregistration started). Each peer's
        SHM_REVOKE is sent from a thread of its own: a peer that reads
        nothing holds back neither the others' revokes nor the
        deregistration, whose wait for the releases has its own deadline."""
        with self._lock:
            inbound = list(self._inbound)
        for conn in inbound:
            if conn.queue_revoke(region_id):
                conn.flush_soon()

    def _inbound_done(self, conn: InboundConnection) -> None:
        with self._lock:
            self._inbound.discard(conn)
            self._handshakes.pop(conn, None)

    def close(self) -> list[threading.Thread]:
        """Stop accepting and end every inbound connection; returns the threads to join."""
        with self._lock:
            self._closed = True
            inbound = list(self._inbound)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in inbound:
            conn.shutdown()
        return [self._accept_thread] + [c.thread for c in inbound]


def _address_key(host: str) -> str:
    """Whose connection this is, for the per-address bound: the IPv4
    address, or the /64 of an IPv6 one (one host can hold a whole /64)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)


class InboundConnection:
    """Serves one initiator's requests until it leaves or breaks the protocol."""

    def __init__(self, listener: Listener, sock: socket.socket, address: str) -> None:
        self.listener = listener
        self.ctx = listener.ctx
        self.sock = sock
        self.address = address
        self.peer_name = f"<unauthenticated {address}>"
        self.host = address  # the peer's address without its port (set by the listener)
        self.inode = os.fstat(sock.fileno()).st_ino  # how a same-host initiator names this connection
        self.authenticated = False
        self.claimed: tuple[str, int] | None = None  # the peer's (name, epoch), once authenticated
        self.evicted = False  # dropped during its handshake to make room
        self._deadline: float | None = None  # of the handshake
        self.closing = False
        self.pins: dict[int, int] = {}  # SHM_PIN request id -> region table token
        # Leases (SHM_PIN with PIN_KEEP): (region id, for writing) -> region table token.
        self.leases: dict[tuple[int, bool], int] = {}
        self.lease_lock = threading.Lock()
        # The serving thread holds send_lock while it serves a request; other
        # threads' messages (SHM_REVOKE) wait in the outbox until it is free.
        self.send_lock = threading.Lock()
        self._outbox: list[bytes] = []
        self._flush_waiter = False  # a thread waits to send what the peer did not take
        self._stuck = False  # the peer did not take all of the outbox in time (warned once)
        self.spins_caught = 0  # polls for the next request that ended readable (KVX_SERVE_SPIN_US)
        # Run once the connection has ended (a backend forgets what it set up for it).
        self._close_hooks: list[Callable[[], None]] = []
        self.thread = threading.Thread(target=self._run, name=f"kvx-serve-{address}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def shutdown(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            self._handshake()
            self._serve()
        except Fatal as fatal:
            if not self.closing:
                if self.authenticated:
                    logger.warning("closing connection from %s: %s", self.peer_name, fatal.error)
                else:  # anyone can connect: a flood of bad handshakes must not flood the log
                    self.listener.refused_handshake(self, fatal.error)
                # Under send_lock, as every send after the handshake: another thread's message
                # must not be cut into; one sent in part would garble the ERROR (then skipped).
                if self.send_lock.acquire(timeout=_LINGER_S):
                    try:
                        if not self._outbox:
                            self.send_error(fatal.request_id, fatal.error)
                    finally:
                        self.send_lock.release()
                self._linger()
        except (PeerLostError, TimeoutError, OSError) as exc:
            if not self.closing:
                logger.info("connection from %s ended: %s", self.peer_name, exc)
        except Exception:  # never let one peer's bug take the agent down
            logger.exception("internal error serving %s", self.peer_name)
        finally:
            # The initiator cannot copy through a pin once its connection is gone
            # (it keeps the connection up while it copies).
            for token in self.pins.values():
                self.ctx.regions.release(token)
            self.pins.clear()
            with self.lease_lock:
                leases, self.leases = list(self.leases.values()), {}
            for token in leases:
                self.ctx.regions.release(token)
            try:
                self.sock.close()
            finally:
                self.listener._inbound_done(self)
                self._run_close_hooks()

    def when_closed(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the connection has ended (from its serving thread:
        a handler that calls this runs before the end)."""
        self._close_hooks.append(fn)

    def _run_close_hooks(self) -> None:
        hooks, self._close_hooks = self._close_hooks, []
        for fn in hooks:
            try:
                fn()
            except Exception:  # the serving thread must end cleanly
                logger.exception("cleaning up after peer %s failed", self.peer_name)

    # Handshake.

    def _recv_message(self, expect: MsgType) -> bytes:
        header = recv_exact(self.sock, _wire.HEADER_SIZE, self._deadline)
        try:
            msg_type, _, payload_len, _, data_len = check_header(header)
        except (ProtocolError, VersionError) as exc:
            raise Fatal(exc) from None
        if msg_type != expect or data_len or payload_len > _wire.MAX_HANDSHAKE_BYTES:
            raise Fatal(ProtocolError(f"expected {expect.name} during the handshake, got type {msg_type}"))
        return bytes(recv_exact(self.sock, payload_len, self._deadline))

    def _handshake(self) -> None:
        ctx = self.ctx
        # One deadline for the whole handshake: a trickling peer cannot hold a slot.
        self._deadline = time.monotonic() + ctx.timeouts.connect_s
        try:
            hello = handshake_pb2.Hello.FromString(self._recv_message(MsgType.HELLO))
        except (Fatal, PeerLostError, TimeoutError):  # a peer that left or stalled is no malformed HELLO
            raise
        except Exception as exc:  # protobuf DecodeError and friends
            raise Fatal(ProtocolError(f"malformed HELLO: {exc}")) from None
        if hello.target_name != ctx.agent_name or hello.target_epoch != ctx.epoch:
            raise Fatal(
                EpochError(
                    f"this is agent {ctx.agent_name!r} epoch {ctx.epoch:#x}; the initiator addressed "
                    f"{hello.target_name!r} epoch {hello.target_epoch:#x} (the agent restarted, or "
                    "the metadata is stale): fetch its metadata again"
                )
            )
        if len(hello.nonce) != _wire.NONCE_BYTES:
            raise Fatal(ProtocolError("HELLO nonce must be 32 bytes"))
        try:
            check_name(hello.name)
        except ConfigError as exc:
            raise Fatal(ProtocolError(f"HELLO: {exc}")) from None
        secret = ctx.secret
        nonce = os.urandom(_wire.NONCE_BYTES)
        ids = (hello.name, ctx.agent_name, hello.epoch, ctx.epoch)
        reply = handshake_pb2.HelloReply(
            name=ctx.agent_name,
            epoch=ctx.epoch,
            nonce=nonce,
            auth_required=secret is not None,
            proof=_wire.target_proof(secret, hello.nonce, nonce, *ids) if secret else b"",
            max_message_bytes=ctx.limits.max_message_bytes,
            max_descs_per_message=ctx.limits.max_descs_per_message,
        ).SerializeToString()
        self.sock.settimeout(max(0.001, self._deadline - time.monotonic()))
        self.sock.sendall(_wire.pack(MsgType.HELLO_REPLY, payload_len=len(reply)) + reply)
        try:
            auth = handshake_pb2.Auth.FromString(self._recv_message(MsgType.AUTH))
        except (Fatal, PeerLostError, TimeoutError):
            raise
        except Exception as exc:
            raise Fatal(ProtocolError(f"malformed AUTH: {exc}")) from None
        if secret is not None:
            expected = _wire.initiator_proof(secret, hello.nonce, nonce, *ids)
            if not hmac.compare_digest(auth.proof, expected):
                raise Fatal(
                    AuthError(
                        f"peer {hello.name!r} failed the HMAC challenge: it has no, or another, auth_secret"
                    )
                )
        if not self.listener.authenticated(self, hello.name, hello.epoch):
            raise PeerLostError("dropped during the handshake to make room for newer connections")
        self.sock.settimeout(max(0.001, self._deadline - time.monotonic()))
        self.sock.sendall(_wire.pack(MsgType.AUTH_OK))
        self.peer_name = hello.name
        self.sock.settimeout(ctx.timeouts.io_s)
        logger.debug("peer %s (epoch %#x) connected from %s", hello.name, hello.epoch, self.address)

    # Requests.

    def _serve(self) -> None:
        handlers = self.listener.handlers
        fd, spin = self.sock.fileno(), self.listener.spin_us
        while not self.closing:
            if spin and _io.wait_readable(fd, spin):  # the next request, if it comes at once: no sleep
                self.spins_caught += 1
            header = recv_header(self.sock, lambda: not self.closing)
            if header is None or self.closing:  # ended (a newer instance of the peer): serve no more
                return
            try:
                msg_type, request_id, payload_len, aux, data_len = check_header(header)
            except (ProtocolError, VersionError) as exc:
                raise Fatal(exc) from None
            handler = handlers.get(msg_type)
            if handler is None:
                raise Fatal(ProtocolError(f"unexpected message type {msg_type}"), request_id)
            if msg_type in _wire.BACKEND_TYPES and (data_len or payload_len > _wire.MAX_HANDSHAKE_BYTES):
                # A backend's own control request: small, no data, whatever its handler does.
                raise Fatal(
                    LimitError(
                        f"control request {msg_type} of {payload_len} bytes and {data_len} of "
                        f"data; at most {_wire.MAX_HANDSHAKE_BYTES} and none"
                    ),
                    request_id,
                )
            with self.send_lock:
                # What waits in the outbox (a revoke sent in part, say) goes before any answer.
                if self._outbox and not self._send_outbox():
                    raise TimeoutError(f"peer {self.peer_name} takes no message")
                handler(self, request_id, payload_len, aux, data_len)
            if self._outbox:
                self.flush()

    def queue_revoke(self, region_id: int) -> bool:
        """Queue SHM_REVOKE if this peer leases the region (True; ``flush`` sends
        it); its SHM_RELEASE (or the end of the connection) releases the lease."""
        with self.lease_lock:
            if (region_id, False) not in self.leases and (region_id, True) not in self.leases:
                return False
            self._outbox.append(_wire.pack(MsgType.SHM_REVOKE, region_id))
        return True

    def send_oneway(self, message: bytes) -> None:
        """Send a message that gets no answer (a backend's notice, say
        RDMA_RESET) from any thread, without waiting for the peer to take it:
        from a thread of its own, after the request being served."""
        with self.lease_lock:
            self._outbox.append(message)
        self.flush_soon()

    def flush_soon(self) -> None:
        """``flush`` on a thread of its own: a caller with a message for each of
        several peers is held back by none that reads nothing."""
        try:
            threading.Thread(target=self.flush, name=f"kvx-send-{self.address}", daemon=True).start()
        except RuntimeError:  # no thread to be had (a threads or pids limit): send it from here
            self.flush()

    def flush(self) -> None:
        """Send what waits in the outbox, unless another thread is sending
        (the serving thread sends it before its next answer, and after its
        request). What the peer does not take within Timeouts.io_s stays at
        the head of the outbox, and the connection stays up: a peer that is
        stopped keeps its leases, so deregister waits for it (and raises
        RegionBusyError past its timeout) as for any stopped peer, for the
        peer may still copy once it runs again."""
        while self._outbox and self.send_lock.acquire(blocking=False):
            try:
                if not self._send_outbox():
                    self._flush_when_writable()
                    return
            finally:
                self.send_lock.release()

    def _flush_when_writable(self) -> None:
        """One thread per connection (at most) that sends what the peer did not take once
        its socket takes bytes again, until nothing waits or the connection ends: a peer
        that leases and copies sends no request that would carry it out."""
        with self.lease_lock:
            if self._flush_waiter:
                return
            self._flush_waiter = True

        def wait() -> None:
            again = False
            try:
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
                while self._outbox and not self.closing:
                    if poller.poll(1000):
                        self.flush()  # bounded; a failure leaves it to this thread again
                        time.sleep(0.05)  # the lock busy, or the peer took only a little
                again = True
            except (OSError, ValueError):
                pass  # the connection is ending: its end releases the leases
            finally:
                with self.lease_lock:
                    self._flush_waiter = False
                    # A message queued as this thread ended, whose own flush found it running.
                    again = again and bool(self._outbox) and not self.closing
            if again:
                self._flush_when_writable()

        try:
            threading.Thread(target=wait, name=f"kvx-flush-{self.address}", daemon=True).start()
        except RuntimeError:  # no thread to be had: the next request or revoke sends it
            with self.lease_lock:
                self._flush_waiter = False

    def _send_outbox(self) -> bool:
        """With send_lock held: send the outbox within Timeouts.io_s. False when
        the peer took less: the rest goes back to the outbox's head, so that a
        message sent in part is finished before anything else is sent."""
        with self.lease_lock:
            data, self._outbox = b"".join(self._outbox), []
        view = memoryview(data)
        deadline = time.monotonic() + self.ctx.timeouts.io_s
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLOUT)
            while view:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0 or not poller.poll(max(1, math.ceil(left_ms))):
                    break
                view = view[self.sock.send(view) :]
        except TimeoutError:
            pass  # nothing went in that call
        except (OSError, ValueError):  # ValueError: the socket is closed
            return True  # the connection is ending: its end releases the leases
        if not view:
            self._stuck = False
            return True
        with self.lease_lock:
            self._outbox.insert(0, bytes(view))
            warn, self._stuck = not self._stuck and not self.closing, True
        if warn:  # once until the peer takes it all
            logger.warning(
                "peer %s took no message for %.3g s (Timeouts.io_s); what it has not taken waits, "
                "and its leases hold deregister back",
                self.peer_name,
                self.ctx.timeouts.io_s,
            )
        return False

    def abandoned(self) -> bool:
        """The initiator reset the connection: it gave up on the requests
        still buffered here (a WRITE that timed out there must not land
        later, over newer data). Checked before memory is written."""
        try:
            return self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            return True

    def recv_descs(self, request_id: int, nbytes: int) -> np.ndarray:
        """A request's descriptor payload, within the limits."""
        limits = self.ctx.limits
        if nbytes % DESC_SIZE:
            raise Fatal(
                ProtocolError(f"descriptor payload of {nbytes} bytes is not a whole number of descriptors"),
                request_id,
            )
        if nbytes // DESC_SIZE > limits.max_descs_per_message:
            raise Fatal(
                LimitError(
                    f"{nbytes // DESC_SIZE} descriptors in one request; this agent "
                    f"takes at most {limits.max_descs_per_message}"
                ),
                request_id,
            )
        if not nbytes:
            return np.zeros(0, dtype=DESC_DTYPE)
        return np.frombuffer(recv_exact(self.sock, nbytes), dtype=DESC_DTYPE)

    def check_size(self, request_id: int, data_len: int) -> None:
        limit = self.ctx.limits.max_message_bytes
        if data_len > limit:
            raise Fatal(
                LimitError(f"request of {data_len} bytes; this agent takes at most {limit} per message"),
                request_id,
            )

    def deliver(self, request_id: int, data: bytes) -> bool:
        """Hand a notification to the application; False (and an ERROR sent)
        when its queue is full."""
        if self.ctx.deliver(self.peer_name, data):
            return True
        self.send_error(
            request_id,
            LimitError(
                f"agent {self.ctx.agent_name!r} has {self.ctx.limits.max_pending_notifications} notifications "
                "its application has not taken; the notification was refused"
            ),
        )
        return False

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

    def send_error(self, request_id: int, error: KvxError) -> None:
        """An ERROR response; the connection stays up."""
        text = str(error).encode()[: _wire.MAX_ERROR_TEXT_BYTES]
        with contextlib.suppress(OSError):
            self.sock.sendall(_wire.pack(MsgType.ERROR, request_id, len(text), error_code(error)) + text)


# The handlers every agent serves: notifications, and pins for the backends
# whose initiators move the bytes themselves (Link.post_pinned).


def _on_notify(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    if data_len or aux:
        raise Fatal(ProtocolError("NOTIFY carries no data"), request_id)
    if payload_len > conn.ctx.limits.max_notify_bytes:
        raise Fatal(
            LimitError(f"notification of {payload_len} bytes; at most {conn.ctx.limits.max_notify_bytes}"),
            request_id,
        )
    data = bytes(recv_exact(conn.sock, payload_len))
    if conn.abandoned():
        raise PeerLostError(f"peer {conn.peer_name!r} reset the connection; its notification is dropped")
    if conn.deliver(request_id, data):
        conn.sock.sendall(_wire.pack(MsgType.NOTIFY_ACK, request_id))


def _on_verify(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    """VERIFY: the initiator's checksums of a transfer it made, checked
    against this agent's memory; the notification goes only when all match."""
    limits = conn.ctx.limits
    notify_len = aux
    if data_len or notify_len > payload_len or notify_len > limits.max_notify_bytes:
        raise Fatal(
            ProtocolError("VERIFY carries descriptors, checksums and a notification, no data"), request_id
        )
    row = DESC_SIZE + 4
    if (payload_len - notify_len) % row:
        raise Fatal(ProtocolError("VERIFY: not a whole number of descriptors with checksums"), request_id)
    count = (payload_len - notify_len) // row
    if count > limits.max_descs_per_message:
        raise Fatal(
            LimitError(f"{count} descriptors in one VERIFY; at most {limits.max_descs_per_message}"),
            request_id,
        )
    descs = conn.recv_descs(request_id, count * DESC_SIZE)
    theirs = np.frombuffer(recv_exact(conn.sock, 4 * count), "<u4")
    notify = bytes(recv_exact(conn.sock, notify_len)) if notify_len else None
    table = conn.ctx.regions
    try:
        addrs, lens, total, token = table.resolve(descs, REMOTE_READ, "verify")
    except AccessError as exc:
        conn.send_error(request_id, exc)
        return
    try:
        # Descriptors may repeat: without this, one message of 65,536 copies of a
        # large region would have this thread checksum for hours, the table pinned.
        if total > limits.max_transfer_bytes:
            conn.send_error(
                request_id,
                LimitError(
                    f"VERIFY of {total} bytes; at most {limits.max_transfer_bytes} (Limits.max_transfer_bytes)"
                ),
            )
            return
        if table.device_of(descs, "verify") >= 0:
            raise AccessError("verify=True covers host memory only")
        ours = _checksum.segments(addrs, lens, lens)
    except (AccessError, ConfigError) as exc:
        conn.send_error(request_id, AccessError(str(exc)) if isinstance(exc, ConfigError) else exc)
        return
    finally:
        table.release(token)
    differ = np.flatnonzero(ours != theirs)
    if len(differ):
        i = int(differ[0])
        region, offset, length = descs[i].tolist()
        conn.send_error(
            request_id,
            IntegrityError(
                f"descriptor {i} (region {region}, offset {offset}, {length} bytes) differs: CRC-32C "
                f"{int(theirs[i]):#010x} on the initiator, {int(ours[i]):#010x} on agent "
                f"{conn.ctx.agent_name!r} ({len(differ)} of {count} descriptors differ)"
            ),
        )
        return
    if notify is not None and not conn.deliver(request_id, notify):
        return
    conn.sock.sendall(_wire.pack(MsgType.VERIFY_OK, request_id))


def _on_pin(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    ctx = conn.ctx
    ipc = bool(aux & _wire.PIN_IPC)
    rdma = bool(aux & _wire.PIN_RDMA)
    keep = bool(aux & _wire.PIN_KEEP)
    aux &= ~(_wire.PIN_IPC | _wire.PIN_KEEP | _wire.PIN_RDMA)
    if data_len or aux not in (_wire.PIN_READ, _wire.PIN_WRITE) or payload_len % 4 or (ipc and rdma):
        raise Fatal(
            ProtocolError(
                "SHM_PIN carries region ids, no data, says read or write, "
                "and asks for IPC handles or rdma keys, not both"
            ),
            request_id,
        )
    if payload_len // 4 > ctx.limits.max_descs_per_message:
        raise Fatal(LimitError(f"{payload_len // 4} regions in one SHM_PIN"), request_id)
    if request_id in conn.pins:
        raise Fatal(ProtocolError(f"SHM_PIN reuses request id {request_id}"), request_id)
    if len(conn.pins) >= MAX_PINS:
        raise Fatal(LimitError(f"{MAX_PINS} shm pins held by one connection; unpin first"), request_id)
    ids = np.frombuffer(recv_exact(conn.sock, payload_len), dtype="<u4").astype(np.intp)
    if not ctx.serves_pins:
        conn.send_error(
            request_id, AccessError(f"agent {ctx.agent_name!r} does not offer shm (backend={ctx.setting!r})")
        )
        return
    writing = aux == _wire.PIN_WRITE
    who = "remote write" if writing else "remote read"
    if keep:
        _lease(conn, request_id, ids, writing, who, ipc, rdma)
        return
    try:
        bases, sizes, token = ctx.regions.pin_regions(ids, REMOTE_WRITE if writing else REMOTE_READ, who)
    except AccessError as exc:
        conn.send_error(request_id, exc)
        return
    body = np.stack([bases, sizes], axis=1).astype("<u8").tobytes()
    if ipc or rdma:
        try:
            body += ctx.regions.ipc_export(ids, who) if ipc else ctx.regions.remote_keys(ids, who)
        except AccessError as exc:
            ctx.regions.release(token)
            conn.send_error(request_id, exc)
            return
    conn.pins[request_id] = token
    try:
        conn.sock.sendall(_wire.pack(MsgType.SHM_PIN_OK, request_id, payload_len=len(body)) + body)
    except OSError:
        raise PeerLostError("connection lost while answering SHM_PIN") from None


def _lease(
    conn: InboundConnection, request_id: int, ids: np.ndarray, writing: bool, who: str, ipc: bool, rdma: bool
) -> None:
    """SHM_PIN with PIN_KEEP: lease each region to this connection (once)
    and answer as for a pin (with PIN_IPC: the regions' CUDA IPC handles
    too; with PIN_RDMA: their keys)."""
    table = conn.ctx.regions
    need = REMOTE_WRITE if writing else REMOTE_READ
    # Under lease_lock: a deregistration that starts meanwhile finds the lease and revokes it.
    with conn.lease_lock:
        rids = ids.tolist()
        new = sorted({rid for rid in rids if (rid, writing) not in conn.leases})
        try:
            # Every region, leased already or not, is checked: one being
            # deregistered is refused, though its lease is not given back yet.
            bases, sizes, token = table.pin_regions(ids, need, who)
            try:
                keys = table.ipc_export(ids, who) if ipc else table.remote_keys(ids, who) if rdma else b""
                granted = table.lease(new, need, who)
            finally:
                table.release(token)
        except AccessError as exc:
            conn.send_error(request_id, exc)
            return
        for rid, (_, _, lease) in zip(new, granted, strict=True):
            conn.leases[(rid, writing)] = lease
    body = np.stack([bases, sizes], axis=1).astype("<u8").tobytes() + keys
    try:
        conn.sock.sendall(_wire.pack(MsgType.SHM_PIN_OK, request_id, payload_len=len(body)) + body)
    except OSError:
        raise PeerLostError("connection lost while answering SHM_PIN") from None


def _on_release(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    """SHM_RELEASE: the peer gave its lease on region ``request_id`` back."""
    if payload_len or aux or data_len:
        raise Fatal(ProtocolError("SHM_RELEASE carries nothing but the region id"), request_id)
    with conn.lease_lock:
        tokens = [conn.leases.pop((request_id, w), None) for w in (False, True)]
    for token in tokens:
        if token is not None:
            conn.ctx.regions.release(token)


def _on_unpin(conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int) -> None:
    if payload_len or aux or data_len:
        raise Fatal(ProtocolError("SHM_UNPIN carries nothing but the pin's request id"), request_id)
    token = conn.pins.pop(request_id, None)
    if token is None:
        raise Fatal(ProtocolError(f"SHM_UNPIN of request {request_id}, which holds no pin"), request_id)
    conn.ctx.regions.release(token)


_CORE_HANDLERS.update(
    {
        MsgType.NOTIFY: _on_notify,
        MsgType.SHM_PIN: _on_pin,
        MsgType.SHM_UNPIN: _on_unpin,
        MsgType.SHM_RELEASE: _on_release,
        MsgType.VERIFY: _on_verify,
    }
)
