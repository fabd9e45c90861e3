"""uvicorn's HTTP/1.1 protocol with a deadline on each request's headers, for
every HTTP server kvx runs (kvx proxy, the metadata admin API, the daemons'
APIs): uvicorn alone keeps a client that sends its headers a byte at a time
connected for good."""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvx._net import format_address

logger = logging.getLogger(__name__)

# Request line and headers together; uvicorn answers 400 beyond (its default is 16 KiB too).
MAX_HEADER_BYTES = 16 * 1024
# How long a client has to send a request's line and headers (kvx proxy: --header-timeout-s).
HEADER_TIMEOUT_S = 10.0


class _HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus one deadline for a request's request line and headers.

    uvicorn times out idle keep-alive connections but not a client that
    sends its headers a byte at a time (slowloris): each byte restarts
    nothing, yet the connection stays open for good. Here the deadline runs
    from the connection's start, or from the first byte of a later request
    on it, and the connection is closed when the headers are not in by then.
    ``header_timeout_s`` is set on a subclass made per server.
    """

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

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

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        logger.debug(
            "closing %s: no complete request headers within %s s",
            format_address(*self.client) if self.client else "a client",
            self.header_timeout_s,
        )
        self.transport.close()


def header_deadline_protocol(timeout_s: float | None = None) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``http=``): headers due within ``timeout_s``
    (default HEADER_TIMEOUT_S)."""
    timeout_s = HEADER_TIMEOUT_S if timeout_s is None else timeout_s
    return type("HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})
