"""Socket helpers shared by both sides of the control connection."""

from __future__ import annotations

import builtins
import socket
import time
from collections.abc import Callable

from kvx.backends.control import wire as _wire
from kvx.errors import PeerLostError, ProtocolError, TimeoutError, VersionError

# TimeoutError in this module is kvx's; the socket's own timeout (socket.timeout) is the
# builtin one, caught as builtins.TimeoutError.

_SCRATCH_BYTES = 1 << 20


def tune(sock: socket.socket, timeout_s: float) -> None:
    # A Python timeout makes the descriptor non-blocking; the C data path
    # then waits in poll() on EAGAIN. Measured: blocking sockets with
    # SO_RCVTIMEO/SO_SNDTIMEO moved bulk transfers at 0.75-0.82 of the raw
    # socket limit against 0.91-1.0 in this mode (benchmarks/RESULTS.md).
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Read exactly n bytes. The socket's timeout bounds each wait; a
    ``deadline`` (time.monotonic()) bounds them all together."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer sent {got} of {n} expected bytes before the deadline")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except (builtins.TimeoutError, BlockingIOError):
            raise TimeoutError(f"peer sent {got} of {n} expected bytes, then nothing") from None
        except OSError as exc:
            raise PeerLostError(f"connection lost: {exc}") from exc
        if k == 0:
            raise PeerLostError(f"connection closed by peer after {got} of {n} bytes")
        got += k
    return buf


def recv_header(sock: socket.socket, idle_ok: Callable[[], bool]) -> bytearray | None:
    """The next message header; None on a clean close between messages.

    When a wait times out before any byte of it, ``idle_ok()`` decides:
    True keeps waiting (an idle connection is fine), False is a TimeoutError.
    """
    header = bytearray(_wire.HEADER_SIZE)
    view = memoryview(header)
    got = 0
    while got < _wire.HEADER_SIZE:
        try:
            k = sock.recv_into(view[got:], _wire.HEADER_SIZE - got, socket.MSG_WAITALL)
        except (builtins.TimeoutError, BlockingIOError):
            if got == 0 and idle_ok():
                continue
            raise TimeoutError("no message from the peer within the timeout") from None
        if k == 0:
            if got == 0:
                return None
            raise PeerLostError("connection closed in the middle of a message header")
        got += k
    return header


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop n bytes, keeping the framing after a refused request."""
    scratch = bytearray(min(n, _SCRATCH_BYTES))
    view = memoryview(scratch)
    while n > 0:
        try:
            k = sock.recv_into(view[: min(n, len(scratch))])
        except (builtins.TimeoutError, BlockingIOError):
            raise TimeoutError("peer stopped sending the data of a refused request") from None
        if k == 0:
            raise PeerLostError("connection closed by peer while draining a refused request")
        n -= k


def check_header(header: bytes | bytearray) -> tuple[int, int, int, int, int]:
    """Validate magic and version: (type, request id, payload len, aux, data len)."""
    magic, version, msg_type, request_id, payload_len, aux, data_len = _wire.unpack(header)
    if magic != _wire.MAGIC:
        raise ProtocolError(f"not a kvx message (magic {bytes(magic)!r}); is the peer a kvx agent?")
    if version != _wire.PROTOCOL_VERSION:
        raise VersionError(
            f"peer speaks kvx protocol version {version}, this agent {_wire.PROTOCOL_VERSION}; "
            "run the same kvx version on both sides"
        )
    return msg_type, request_id, payload_len, aux, data_len
