"""The side channel: an engine process serves its agents' metadata over HTTP.

Without a metadata service, a peer learns where an engine's agents listen
and how their memory is laid out from ``GET /kvx/v1/engine`` (vLLM: the
``remote_host:remote_port`` in ``kv_transfer_params``; SGLang: the transfer
session id). The document holds no secret: reading or writing memory still
needs the cluster secret.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from kvx.errors import ConnectError, ProtocolError

logger = logging.getLogger(__name__)

PATH = "/kvx/v1/engine"
MAX_DOCUMENT_BYTES = 16 << 20


class SideChannelServer:
    """Serves one JSON document; started once the ranks' metadata is known."""

    def __init__(self, host: str, port: int) -> None:
        self._doc = b"{}"
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path != PATH:
                    self.send_error(404, f"only {PATH} is served here")
                    return
                body = server._doc
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("side channel: " + fmt, *args)

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="kvx-side-channel",
            daemon=True,
        )
        self._thread.start()

    def publish(self, doc: dict[str, Any]) -> None:
        self._doc = json.dumps(doc).encode()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def fetch(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """The document an engine serves, or a ConnectError/ProtocolError."""
    url = f"http://{host}:{port}{PATH}" if ":" not in host else f"http://[{host}]:{port}{PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(MAX_DOCUMENT_BYTES + 1)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise ConnectError(f"side channel {url} unreachable: {exc}") from exc
    if len(body) > MAX_DOCUMENT_BYTES:
        raise ProtocolError(f"side channel {url} sent more than {MAX_DOCUMENT_BYTES} bytes")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"side channel {url} sent invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"side channel {url} sent no JSON object")
    return doc
