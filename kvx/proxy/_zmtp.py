"""The client end of a ZMQ connection (ZMTP 3.0, NULL mechanism), bounded in size and time.

vLLM publishes its KV cache events on a ZMQ PUB socket and answers replays on a
ROUTER; the proxy reads both with this module rather than with libzmq. libzmq's
reader runs ahead of the application and its high-water mark counts whole
messages: a publisher that sends one message of endless frames makes it queue
every frame until the process runs out of memory. Here at most ``READ_CHUNK``
bytes are read ahead of what the caller asks for, and:

- a frame is at most ``max_frame_bytes`` (its length is checked before its body
  is read), and only the frames the caller keeps are held;
- a message is at most ``MAX_MESSAGE_FRAMES`` frames, and its last byte comes
  within ``MESSAGE_TIMEOUT_S`` of its first;
- connecting (each address a name resolves to) and the handshake take at most
  ``timeout_s`` in all; resolving the name is the system resolver's affair.

Anything beyond a bound raises ``ZmtpError`` and the caller closes the
connection. Only ZMTP 3.0 with the NULL mechanism is spoken: what vLLM's
publisher speaks (libzmq 4.x speaks ZMTP 3.1, and speaks 3.0 to a peer that
announces 3.0). A PING between messages (a publisher with ZMQ_HEARTBEAT_IVL
set) is answered with a PONG.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvx.errors import ConfigError, ProtocolError

HANDSHAKE_TIMEOUT_S = 5.0  # connect, greetings and READY commands
MESSAGE_TIMEOUT_S = 10.0  # from a message's first byte to its last
MAX_MESSAGE_FRAMES = 64  # more frames than this in one message: the peer is cut off
MAX_COMMAND_BYTES = 4096  # READY, PING, ERROR: a few dozen bytes each
READ_CHUNK = 1 << 16
STOP_POLL_S = 0.2  # a blocked connect or read looks at the caller's stop flag this often
_SIGNATURE = b"\xff" + (1).to_bytes(8, "big") + b"\x7f"  # as libzmq sends it
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_MAX_PING_CONTEXT = 16  # ZMTP 3.1: a PING's context, echoed in its PONG
# Which peer each of our socket types talks to (ZMTP 23, "Socket compatibility").
_PEERS = {"SUB": (b"PUB", b"XPUB"), "DEALER": (b"ROUTER", b"DEALER")}


class ZmtpError(ProtocolError):
    """The peer broke ZMTP or one of this module's bounds; the connection is unusable."""


class ZmtpTimeout(ZmtpError):
    """The peer did not send in time what was asked for."""


class Stopped(Exception):
    """The caller's stop flag was set while a connect or a read waited."""


def parse_endpoint(endpoint: str) -> tuple[str, str | tuple[str, int]]:
    """``tcp://host:port`` (a name, an IPv4 address or ``[IPv6]``) as ``("tcp", (host,
    port))``, or ``ipc://path`` (``ipc://@name``: the abstract namespace) as ``("ipc", path)``."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ConfigError(f"ZMQ endpoint {endpoint!r}: expected tcp://host:port")
        if host == "*":
            raise ConfigError(f"ZMQ endpoint {endpoint!r}: * is where the publisher binds; give its host")
        try:
            host.encode("idna")  # what the resolver is asked: a name it cannot encode is refused here
        except UnicodeError:
            raise ConfigError(f"ZMQ endpoint {endpoint!r}: {host!r} is not a host name") from None
        return "tcp", (host, int(port))
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://@"):
        path = endpoint[len("ipc://") :]
        return "ipc", "\0" + path[1:] if path.startswith("@") else path
    raise ConfigError(f"ZMQ endpoint {endpoint!r}: expected tcp://host:port or ipc://path")


class ZmtpConnection:
    """One connection to a ZMQ peer: ``send`` a message, ``receive`` the next one.

    Not thread-safe; one thread reads and writes it. ``stopping()``, when given, is
    polled while a connect or a read waits: when it turns true they raise ``Stopped``.
    Connecting and the handshake take at most ``timeout_s`` (by default
    ``HANDSHAKE_TIMEOUT_S``). Error messages do not repeat the endpoint: the caller
    names it.
    """

    def __init__(
        self,
        endpoint: str,
        socket_type: str,
        max_frame_bytes: int,
        stopping: Callable[[], bool] = lambda: False,
        timeout_s: float | None = None,
    ) -> None:
        scheme, address = parse_endpoint(endpoint)
        self.max_frame_bytes = max_frame_bytes
        self._stopping = stopping
        self._buffer = bytearray()
        deadline = time.monotonic() + (HANDSHAKE_TIMEOUT_S if timeout_s is None else timeout_s)
        targets: list[tuple[socket.AddressFamily, Any]]
        if scheme == "ipc":
            targets = [(socket.AF_UNIX, address)]
        else:
            assert isinstance(address, tuple)
            try:
                found = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)
            except UnicodeError as exc:  # parse_endpoint checked it; the resolver may still refuse
                raise OSError(f"cannot resolve {address[0]!r}: {exc}") from None
            targets = [(family, sockaddr) for family, _, _, _, sockaddr in found]
        self._sock = self._connect(targets, deadline)
        try:
            self._handshake(socket_type, deadline)
        except BaseException:
            self._sock.close()
            raise

    def _connect(self, targets: list[tuple[socket.AddressFamily, Any]], deadline: float) -> socket.socket:
        """The first of ``targets`` (family, address) that accepts, each tried in turn
        until the deadline; the wait for each looks at the stop flag."""
        error: OSError = OSError("no address to connect to")
        for family, address in targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                code = sock.connect_ex(address)
                if code in (errno.EINPROGRESS, errno.EAGAIN):
                    _wait(sock, select.POLLOUT, deadline, self._stopping, "connecting timed out")
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
                if family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    # A publisher whose host vanished is found by the kernel, not by waiting forever.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
                        if hasattr(socket, option):
                            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
                return sock
            except ZmtpTimeout:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ZmtpConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the handshake ----------------------------------------------------------

    def _handshake(self, socket_type: str, deadline: float) -> None:
        self._send_all(_GREETING, deadline)
        signature = self._read(10, deadline)
        if signature[0] != 0xFF or not signature[9] & 0x01:
            raise ZmtpError("not a ZMQ peer (no ZMTP signature)")
        greeting = signature + self._read(54, deadline)
        if greeting[10] < 3:
            raise ZmtpError(f"the peer speaks ZMTP {greeting[10]}.x; 3.0 or later is needed")
        mechanism = greeting[12:32].rstrip(b"\0")
        if mechanism != b"NULL":
            raise ZmtpError(
                f"the peer asks for the {mechanism!r} security mechanism; only NULL is spoken here"
            )
        value = socket_type.encode()
        ready = b"\x05READY\x0bSocket-Type" + len(value).to_bytes(4, "big") + value
        self._send_all(self._frame(ready, _COMMAND), deadline)
        flags, body = self._next_frame(deadline, keep=False)
        if not flags & _COMMAND:
            raise ZmtpError("a message before the peer's READY")
        name, data = self._command(body)
        if name == b"ERROR":
            raise ZmtpError(f"the peer refused the handshake: {self._reason(data)!r}")
        if name != b"READY":
            raise ZmtpError(f"{name!r} where READY was expected")
        peer_type = self._properties(data).get(b"socket-type")
        if peer_type not in _PEERS[socket_type]:
            raise ZmtpError(
                f"the peer's socket is {'of no type' if peer_type is None else repr(peer_type)}; "
                f"a {socket_type} talks to {' or '.join(p.decode() for p in _PEERS[socket_type])}"
            )

    @staticmethod
    def _command(body: bytes) -> tuple[bytes, bytes]:
        if not body or len(body) < 1 + body[0]:
            raise ZmtpError("a malformed command")
        return body[1 : 1 + body[0]], body[1 + body[0] :]

    @staticmethod
    def _reason(data: bytes) -> str:
        """An ERROR command's reason (a short string), as text."""
        return data[1 : 1 + data[0]].decode(errors="replace") if data else ""

    @staticmethod
    def _properties(data: bytes) -> dict[bytes, bytes]:
        properties: dict[bytes, bytes] = {}
        i = 0
        while i < len(data):
            end = i + 1 + data[i]
            if end + 4 > len(data):
                raise ZmtpError("a malformed READY")
            name = data[i + 1 : end]
            size = int.from_bytes(data[end : end + 4], "big")
            if end + 4 + size > len(data):
                raise ZmtpError("a malformed READY")
            properties[name.lower()] = data[end + 4 : end + 4 + size]
            i = end + 4 + size
        return properties

    # -- messages ---------------------------------------------------------------

    @staticmethod
    def _frame(body: bytes, flags: int = 0) -> bytes:
        if len(body) > 255:
            return bytes((flags | _LONG,)) + len(body).to_bytes(8, "big") + body
        return bytes((flags, len(body))) + body

    def send(self, frames: Sequence[bytes], timeout_s: float | None = None) -> None:
        """Send one message of ``frames``; raises ``OSError`` when not all was sent within
        ``timeout_s`` (by default ``HANDSHAKE_TIMEOUT_S``)."""
        last = len(frames) - 1
        wire = b"".join(self._frame(f, 0 if i == last else _MORE) for i, f in enumerate(frames))
        self._send_all(wire, time.monotonic() + (HANDSHAKE_TIMEOUT_S if timeout_s is None else timeout_s))

    def subscribe(self, topic: bytes) -> None:
        """What a SUB socket sends for a subscription in ZMTP 3.0: a message of 1 + the prefix."""
        self.send([b"\x01" + topic])

    def receive(self, max_frames: int, deadline: float = math.inf) -> list[bytes] | None:
        """The next message: its frames when there are at most ``max_frames`` of them,
        else None (the frames past ``max_frames`` are read and dropped, never kept).

        Waits for its first byte until ``deadline`` (by default as long as it takes); its
        last byte must follow within ``MESSAGE_TIMEOUT_S``. A PING between messages is
        answered. Raises ``ZmtpTimeout`` past a deadline, ``ZmtpError`` past another
        bound, ``ConnectionError`` when the peer closed, ``Stopped`` when the stop flag
        was set."""
        frames: list[bytes] = []
        seen = 0
        message_deadline = deadline
        while True:
            if seen == 0:
                while not self._buffer:
                    self._fill(deadline)
                message_deadline = min(deadline, time.monotonic() + MESSAGE_TIMEOUT_S)
            flags, body = self._next_frame(message_deadline, keep=seen < max_frames)
            if flags & _COMMAND:
                self._between_messages(body, seen, message_deadline)
                continue
            seen += 1
            if seen <= max_frames:
                frames.append(body)
            if not flags & _MORE:
                return frames if seen <= max_frames else None
            if seen >= MAX_MESSAGE_FRAMES:
                raise ZmtpError(f"a message of more than {MAX_MESSAGE_FRAMES} frames")

    def _between_messages(self, body: bytes, seen: int, deadline: float) -> None:
        """A command after the handshake: a PING is answered, anything else but ERROR skipped."""
        name, data = self._command(body)
        if seen:
            raise ZmtpError(f"a {name!r} command between the frames of a message")
        if name == b"ERROR":
            raise ZmtpError(f"the peer sent ERROR: {self._reason(data)!r}")
        if name == b"PING" and len(data) >= 2:  # a 2-byte TTL, then a context for the PONG
            pong = b"\x04PONG" + data[2 : 2 + _MAX_PING_CONTEXT]
            self._send_all(self._frame(pong, _COMMAND), min(deadline, time.monotonic() + STOP_POLL_S * 5))

    def _next_frame(self, deadline: float, keep: bool = True) -> tuple[int, bytes]:
        """The next frame's flags and body (``b""`` for a message frame with ``keep`` False:
        its bytes are read and dropped). A message frame is at most ``max_frame_bytes``,
        a command ``MAX_COMMAND_BYTES``."""
        flags = self._read(1, deadline)[0]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise ZmtpError(f"frame flags {flags:#04x}")
        size = int.from_bytes(self._read(8 if flags & _LONG else 1, deadline), "big")
        if flags & _COMMAND:
            if flags & _MORE or size > MAX_COMMAND_BYTES:
                raise ZmtpError(f"a command of {size} bytes, or of several frames")
            return flags, self._read(size, deadline)
        if size > self.max_frame_bytes:
            raise ZmtpError(f"a frame of {size} bytes; at most {self.max_frame_bytes} are read")
        if keep:
            return flags, self._read(size, deadline)
        self._skip(size, deadline)
        return flags, b""

    # -- bytes ------------------------------------------------------------------

    def _wait_readable(self, deadline: float) -> None:
        _wait(
            self._sock,
            select.POLLIN,
            deadline,
            self._stopping,
            "nothing, or not all of a message, came in time",
        )

    def _fill(self, deadline: float) -> None:
        """Read what has arrived (at least one byte, at most READ_CHUNK) into the buffer."""
        while True:
            self._wait_readable(deadline)
            try:
                chunk = self._sock.recv(READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            self._buffer += chunk
            return

    def _read(self, n: int, deadline: float) -> bytes:
        if n - len(self._buffer) > READ_CHUNK:  # a large body: read straight into its place
            out = bytearray(n)
            have = len(self._buffer)
            out[:have] = self._buffer
            self._buffer.clear()
            view = memoryview(out)
            while have < n:
                self._wait_readable(deadline)
                try:
                    got = self._sock.recv_into(view[have:])
                except BlockingIOError:
                    continue
                if not got:
                    raise ConnectionError("the peer closed the connection")
                have += got
            return bytes(out)
        while len(self._buffer) < n:
            self._fill(deadline)
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _skip(self, n: int, deadline: float) -> None:
        while n:
            if not self._buffer:
                self._fill(deadline)
            step = min(n, len(self._buffer))
            del self._buffer[:step]
            n -= step

    def _send_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            _wait(self._sock, select.POLLOUT, deadline, self._stopping, "sending timed out")
            try:
                view = view[self._sock.send(view) :]
            except BlockingIOError:
                continue


def _wait(sock: socket.socket, event: int, deadline: float, stopping: Callable[[], bool], late: str) -> None:
    """Until ``sock`` is ready for ``event`` (or in error: the next call on it says
    which), the deadline passes (``ZmtpTimeout(late)``) or ``stopping()`` (``Stopped``).
    poll, not select: a process with many connections has descriptors past FD_SETSIZE."""
    poller = select.poll()
    poller.register(sock, event)
    while True:
        if stopping():
            raise Stopped
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ZmtpTimeout(late)
        if poller.poll(max(1, math.ceil(min(remaining, STOP_POLL_S) * 1000))):
            return
