"""Serving the proxy app with uvicorn."""

from __future__ import annotations

import logging
import socket

import uvicorn

from kvx.errors import ConfigError
from kvx.proxy._app import build_app
from kvx.proxy._config import ProxyConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # graceful shutdown: open streams get this long to finish


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"kvx proxy cannot listen on {listen}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"kvx proxy cannot listen on {listen}: {exc.strerror or exc} "
                          "(is another process on that port? pick another with --listen)") from None
    return sock


def serve(config: ProxyConfig) -> None:
    """Serve ``config.listen`` until SIGINT or SIGTERM (then open streams get
    STOP_TIMEOUT_S to finish); port 0 picks a free port, which is logged."""
    app = build_app(config)
    sock = _bind(config.listen)
    host, port = sock.getsockname()[:2]
    uv = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                       timeout_graceful_shutdown=STOP_TIMEOUT_S))
    logger.info("kvx proxy on http://%s:%s", f"[{host}]" if ":" in host else host, port)
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
    if not uv.started:
        raise ConfigError("kvx proxy did not start; the log above says why")
