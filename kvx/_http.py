"""uvicorn's HTTP/1.1 protocol with two deadlines, for every HTTP server kvx
runs (kvx proxy, the metadata admin API, the daemons' APIs): one on each
request's headers, one on the client taking its answer. uvicorn alone keeps
a client that sends its headers a byte at a time, or that stops reading its
answer, connected for good."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvx._net import format_address

logger = logging.getLogger(__name__)

# Request line and headers together; uvicorn answers 400 beyond (its default is 16 KiB too).
MAX_HEADER_BYTES = 16 * 1024
# How long a client has to send a request's line and headers (kvx proxy: --header-timeout-s).
HEADER_TIMEOUT_S = 10.0
# How long a client may take to read SEND_PROGRESS_BYTES of its answer while its
# connection's buffers are full (kvx proxy: --send-timeout-s).
SEND_TIMEOUT_S = 60.0
SEND_PROGRESS_BYTES = 64 * 1024
# Connections reset for not reading: one warning per this many seconds, with a count.
_WARN_EVERY_S = 10.0
_warned = {"at": -_WARN_EVERY_S, "since": 0}


class _DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for a request's line and
    headers and one for the client taking its answer.

    Headers: uvicorn times out idle keep-alive connections but not a client
    that sends its headers a byte at a time (slowloris). Here the deadline
    runs from the connection's start, or from the first byte of a later
    request on it, and the connection is closed when the headers are not in
    by then.

    Answers: once the connection's buffers are full (the kernel's, then the
    transport's past its high-water mark) uvicorn waits for the client to
    read, without end, and a stream relayed to it keeps its upstream busy
    meanwhile. Here, while the transport's buffer stays above its low-water
    mark, the client must take SEND_PROGRESS_BYTES of it every
    ``send_timeout_s``; one that does not is reset (buffers dropped: a
    plain close would wait for the client to read them), and the app sees
    it gone, as when it disconnects. A slow reader of a large answer is not
    cut off; one that stopped reading, or takes under 64 KiB a minute (about
    1 KB/s), is.

    ``header_timeout_s`` and ``send_timeout_s`` are set on a subclass made
    per server (``deadline_protocol``).
    """

    header_timeout_s: float = HEADER_TIMEOUT_S
    send_timeout_s: float = SEND_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None
    _send_mark = 0  # the transport's buffered bytes when the send timer was set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self._stop_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        self._stop_send_timer()
        super().resume_writing()

    def _watch_headers(self) -> None:
        # h11 keeps the client IDLE until its request line and headers are complete.
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting:
            self._stop_header_timer()
        elif self._header_timer is None:
            # A new connection, or the first bytes of a later request: the deadline starts now.
            # (An idle keep-alive connection is timeout_keep_alive's: no bytes, no call here.)
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _arm_send_timer(self) -> None:
        self._send_mark = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._answer_not_taken)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _client(self) -> str:
        return format_address(*self.client) if self.client else "a client"

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        logger.debug(
            "closing %s: no complete request headers within %s s", self._client(), self.header_timeout_s
        )
        self.transport.close()

    def _answer_not_taken(self) -> None:
        self._send_timer = None
        if self.transport.get_write_buffer_size() <= self._send_mark - SEND_PROGRESS_BYTES:
            self._arm_send_timer()  # it reads, if slowly: its buffers stay full while it does
            return
        now = self.loop.time()
        _warned["since"] += 1
        if now - _warned["at"] >= _WARN_EVERY_S:  # anyone can connect: no warning per connection
            logger.warning(
                "reset %d connection(s) whose client took under %d bytes of its answer in %s s "
                "(it stopped reading); the latest: %s",
                _warned["since"],
                SEND_PROGRESS_BYTES,
                self.send_timeout_s,
                self._client(),
            )
            _warned["at"], _warned["since"] = now, 0
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a close: the kernel drops what it still holds for the client too
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


def deadline_protocol(
    header_timeout_s: float | None = None, send_timeout_s: float | None = None
) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``http=``): headers due within
    ``header_timeout_s``, answers taken within ``send_timeout_s`` (defaults:
    HEADER_TIMEOUT_S, SEND_TIMEOUT_S)."""
    settings = {
        "header_timeout_s": HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s,
        "send_timeout_s": SEND_TIMEOUT_S if send_timeout_s is None else send_timeout_s,
    }
    return type("DeadlineProtocol", (_DeadlineProtocol,), settings)
