"""Serving the proxy app with uvicorn, with a deadline on each request's headers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvx._net import bind_listener, format_address
from kvx.errors import ConfigError
from kvx.proxy._app import build_app
from kvx.proxy._config import ProxyConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10  # graceful shutdown: open streams get this long to finish
# Request line and headers together; uvicorn answers 400 beyond (its default is 16 KiB too).
MAX_HEADER_BYTES = 16 * 1024


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
            "kvx proxy: closing %s: no complete request headers within %s s",
            format_address(*self.client) if self.client else "a client",
            self.header_timeout_s,
        )
        self.transport.close()


def uvicorn_config(app: Any, config: ProxyConfig, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn settings the proxy runs with (tests serve the app with these too)."""
    protocol = type(
        "HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": config.header_timeout_s}
    )
    settings: dict[str, Any] = {
        "log_config": None,
        "access_log": False,
        "lifespan": "on",
        "timeout_graceful_shutdown": STOP_TIMEOUT_S,
        "http": protocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        # uvicorn's "auto" would pick uvloop wherever it is installed (kvx[uvloop], the image):
        # the proxy runs on the loop it is tested on.
        "loop": "asyncio",
    }
    settings.update(kwargs)
    return uvicorn.Config(app, **settings)


def serve(config: ProxyConfig) -> None:
    """Serve ``config.listen`` until SIGINT or SIGTERM (then open streams get
    STOP_TIMEOUT_S to finish); port 0 picks a free port, which is logged."""
    app = build_app(config)
    try:
        sock = bind_listener(config.listen, what="kvx proxy", hint="pick another with --listen", backlog=1024)
    except OSError as exc:  # to the kvx error `kvx proxy` reports; the message says what to change
        raise ConfigError(exc.strerror or str(exc)) from None
    host, port = sock.getsockname()[:2]
    uv = uvicorn.Server(uvicorn_config(app, config))
    logger.info("kvx proxy on http://%s", format_address(host, port))
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
    if not uv.started:
        raise ConfigError("kvx proxy did not start; the log above says why")
