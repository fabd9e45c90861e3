"""Serving the proxy app with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from kvx._net import bind_listener, format_address
from kvx.errors import ConfigError
from kvx.proxy._app import build_app
from kvx.proxy._config import ProxyConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10  # graceful shutdown: open streams get this long to finish


def serve(config: ProxyConfig) -> None:
    """Serve ``config.listen`` until SIGINT or SIGTERM (then open streams get
    STOP_TIMEOUT_S to finish); port 0 picks a free port, which is logged."""
    app = build_app(config)
    try:
        sock = bind_listener(config.listen, what="kvx proxy", hint="pick another with --listen", backlog=1024)
    except OSError as exc:  # to the kvx error `kvx proxy` reports; the message says what to change
        raise ConfigError(exc.strerror or str(exc)) from None
    host, port = sock.getsockname()[:2]
    uv = uvicorn.Server(
        uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=STOP_TIMEOUT_S
        )
    )
    logger.info("kvx proxy on http://%s", format_address(host, port))
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
    if not uv.started:
        raise ConfigError("kvx proxy did not start; the log above says why")
