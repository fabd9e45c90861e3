"""Serving the proxy app with uvicorn, with a deadline on each request's headers."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from kvx._http import MAX_HEADER_BYTES, deadline_protocol
from kvx._net import bind_listener, format_address
from kvx.errors import ConfigError
from kvx.proxy._app import build_app
from kvx.proxy._config import ProxyConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10  # graceful shutdown: open streams get this long to finish


def uvicorn_config(app: Any, config: ProxyConfig, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn settings the proxy runs with (tests serve the app with these too)."""
    protocol = deadline_protocol(config.header_timeout_s, config.send_timeout_s)
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
