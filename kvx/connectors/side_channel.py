"""The side channel: an engine process serves its agents' metadata over HTTP.

Without a metadata service, a peer learns where an engine's agents listen
and how their memory is laid out from ``GET /kvx/v1/engine`` (vLLM: the
``remote_host:remote_port`` in ``kv_transfer_params``; SGLang: the transfer
session id). The document holds no secret: reading or writing memory still
needs the cluster secret.

Anyone who reaches the port can connect, so each connection is bounded: one
deadline for the whole exchange (request in, document out), a cap on the
request's bytes, and a cap on the connections handled at once. When every
handler is taken, the connection handled longest is cut off to make room
(an honest one takes milliseconds): clients that trickle their request or
read the answer slowly cannot keep a peer from its document, however many
they open.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import io
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from kvx.errors import ConfigError, ConnectError, ProtocolError

logger = logging.getLogger(__name__)

PATH = "/kvx/v1/engine"
MAX_DOCUMENT_BYTES = 16 << 20
REQUEST_DEADLINE_S = 5.0  # one connection: request line, headers and the document sent back
MAX_REQUEST_BYTES = 16 << 10  # request line and headers; a peer's GET is about 150 bytes
MAX_HANDLERS = 16  # connections handled at once, each on its own thread
LISTEN_BACKLOG = 64


class _RequestTooLarge(http.client.HTTPException):
    """The request passed MAX_REQUEST_BYTES (an HTTPException, so a header overflow gets 431)."""


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, every read bounded by what is left of one deadline, and all
    of them together by ``max_bytes``."""

    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int) -> None:
        super().__init__()
        self._sock, self._deadline, self._left = sock, deadline, max_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            raise _RequestTooLarge(f"request over {MAX_REQUEST_BYTES} bytes")
        remaining_s = self._deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(remaining_s)
        with memoryview(buffer) as view:
            received = self._sock.recv_into(view[: self._left])
        self._left -= received
        return received


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server  # narrower than the stdlib's

    def setup(self) -> None:
        super().setup()
        self.deadline = time.monotonic() + self.server.deadline_s
        self.rfile.close()  # the stdlib's reader, without a deadline
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, self.deadline, self.server.max_request_bytes)
        )

    def handle(self) -> None:
        try:
            super().handle()
        except (OSError, _RequestTooLarge) as exc:  # TimeoutError is an OSError
            logger.debug("side channel: dropped %s: %s", self.client_address, exc)

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path != PATH:
            self.send_error(404, f"only {PATH} is served here")
            return
        body = self.server.doc
        remaining_s = self.deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("request deadline passed")
        # sendall under a timeout bounds the whole write: a peer that reads slowly is dropped.
        self.connection.settimeout(remaining_s)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("side channel: " + fmt, *args)


class _Server(http.server.HTTPServer):
    """One thread per connection, at most ``max_handlers`` at once."""

    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self, address: tuple[str, int], deadline_s: float, max_handlers: int, max_request_bytes: int
    ) -> None:
        self.doc = b"{}"
        self.deadline_s = deadline_s
        self.max_request_bytes = max_request_bytes
        self._slots = threading.BoundedSemaphore(max_handlers)
        self._lock = threading.Lock()
        # Connections being handled, oldest first (a dict keeps the order).
        self._active: dict[socket.socket, None] = {}
        super().__init__(address, _Handler)

    def _done(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.pop(sock, None)

    def _cut_oldest(self, newcomer: socket.socket) -> None:
        """Every handler is taken: end the connection (not ``newcomer``) that
        has been handled longest, sending its request slowly or reading the
        answer slowly (an honest one takes milliseconds); its handler then
        frees its slot."""
        with self._lock:
            oldest = next((s for s in self._active if s is not newcomer), None)
            if oldest is not None:
                del self._active[oldest]
        if oldest is not None:
            logger.debug("side channel: every handler taken; cutting off the slowest connection")
            with contextlib.suppress(OSError):  # it ended meanwhile
                oldest.shutdown(socket.SHUT_RDWR)

    def _take_slot(self, request: socket.socket) -> bool:
        """A handler for ``request``, cutting off slow requests to make room;
        False when none frees within the deadline (every handler is sending)."""
        # Registered before its handler runs, so a newer connection can cut it off at once.
        with self._lock:
            self._active[request] = None
        deadline = time.monotonic() + self.deadline_s + 1
        while not self._slots.acquire(timeout=0.05):
            if time.monotonic() > deadline:
                self._done(request)
                return False
            self._cut_oldest(request)
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        # Every handler ends within deadline_s, so one frees a slot by then at the latest.
        if not self._take_slot(request):
            logger.warning("side channel: no free handler for %s; dropping it", client_address)
            self.shutdown_request(request)
            return
        try:
            threading.Thread(
                target=self._handle,
                args=(request, client_address),
                name="kvx-side-channel-request",
                daemon=True,
            ).start()
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._done(request)
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("side channel: request from %s failed", client_address, exc_info=True)


class SideChannelServer:
    """Serves one JSON document; started once the ranks' metadata is known.

    deadline_s:   one connection's whole life: request in, document out.
    max_handlers: connections handled at once; more wait to be accepted.
    max_request_bytes: request line and headers together.
    """

    def __init__(
        self,
        host: str,
        port: int,
        deadline_s: float = REQUEST_DEADLINE_S,
        max_handlers: int = MAX_HANDLERS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        if not deadline_s > 0 or max_handlers <= 0 or max_request_bytes <= 0:
            raise ConfigError(
                "side channel: deadline_s, max_handlers and max_request_bytes must be positive, not "
                f"{deadline_s!r}, {max_handlers!r}, {max_request_bytes!r}"
            )
        self._httpd = _Server((host, port), deadline_s, max_handlers, max_request_bytes)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="kvx-side-channel",
            daemon=True,
        )
        self._thread.start()

    def publish(self, doc: dict[str, Any]) -> None:
        self._httpd.doc = json.dumps(doc).encode()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def fetch(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """The document an engine serves, or a ConnectError/ProtocolError.

    ``timeout_s`` bounds each connect and read, and the whole document too: a
    server that trickles it is given up on after at most about twice that.
    """
    url = f"http://{host}:{port}{PATH}" if ":" not in host else f"http://[{host}]:{port}{PATH}"
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            while size <= MAX_DOCUMENT_BYTES and (chunk := resp.read1(MAX_DOCUMENT_BYTES + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise ConnectError(
                        f"side channel {url} sent {size} bytes but not its whole document "
                        f"within {timeout_s} s; is the engine overloaded?"
                    )
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as exc:
        raise ConnectError(f"side channel {url} unreachable: {exc}") from exc
    if size > MAX_DOCUMENT_BYTES:
        raise ProtocolError(f"side channel {url} sent more than {MAX_DOCUMENT_BYTES} bytes")
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise ProtocolError(f"side channel {url} sent invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"side channel {url} sent no JSON object")
    return doc
