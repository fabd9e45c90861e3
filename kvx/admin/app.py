"""The admin REST API of the metadata service, next to its gRPC API on one event loop.

Endpoints (OpenAPI at ``/openapi.json``, interactive docs at ``/docs``):

    GET    /healthz             200 {"status": "ok"} while the process runs
    GET    /readyz              200 {"ready": true, "store": ...} when the store answers, else 503
    GET    /v1/agents           ?role=prefill|decode|other &label=key=value (repeatable)
                                &page_size=N &page_token=...  ->  {"agents": [...], "next_page_token": ...}
    GET    /v1/agents/{name}    one record, 404 when absent
    DELETE /v1/agents/{name}    evict an agent  ->  {"evicted": true|false}   (admin token)
    GET    /metrics             Prometheus text format

Records are ``kvx.v1.AgentRecord`` in protobuf's JSON mapping, field names as
in the .proto (64-bit integers are strings), never with a lease id. Eviction
needs ``Authorization: Bearer <admin token>`` and is refused when the service
has no admin token. Reads and /metrics need a token too (the admin token or
the gRPC token) when the service has a gRPC token, or with
``admin_reads_need_token``: they show what GetAgent shows, to whoever may call
it. /healthz and /readyz are always open. Errors are ``{"detail": "..."}``: 400
for bad parameters, 401 without a token, 403 with a wrong one, 404, 503
while the store is unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from typing import Any

import grpc
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvx._http import MAX_HEADER_BYTES, deadline_protocol
from kvx._net import bind_listener, format_address
from kvx._version import __version__
from kvx.config import check_name
from kvx.errors import ConfigError
from kvx.metadata.refused import Refused
from kvx.metadata.roles import RoleName, role_filter
from kvx.metadata.store import StoreError
from kvx.v1 import metadata_pb2

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_bearer = HTTPBearer(auto_error=False, description="The admin token the service was started with.")


def _record(record: metadata_pb2.AgentRecord) -> dict[str, Any]:
    assert not record.lease_id, "the servicer clears lease ids before anything is read out"
    return MessageToDict(record, preserving_proto_field_name=True)


def _check_name(name: str) -> None:
    try:
        check_name(name)
    except ConfigError as exc:
        raise HTTPException(400, str(exc)) from None


def create_app(server: Any) -> FastAPI:
    """The FastAPI app for one ``MetadataServer``."""

    def check_token(creds: HTTPAuthorizationCredentials | None) -> None:
        if not server.admin_token:
            raise HTTPException(
                403,
                "this endpoint is disabled: start the metadata service with an "
                "admin token (kvx metadata --admin-token-file FILE) to enable it",
            )
        if creds is None:
            raise HTTPException(
                401,
                "missing token: send 'Authorization: Bearer <admin token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(creds.credentials.encode(), server.admin_token.encode()):
            raise HTTPException(403, "wrong admin token")

    def check_reader(creds: HTTPAuthorizationCredentials | None) -> None:
        # Who may call GetAgent may read here too: the admin token or the gRPC token.
        tokens = [t for t in (server.admin_token, server.token) if t]
        if creds is None:
            raise HTTPException(
                401,
                "missing token: send 'Authorization: Bearer <admin or gRPC token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        sent = creds.credentials.encode()
        if not any([hmac.compare_digest(sent, t.encode()) for t in tokens]):  # every one compared
            raise HTTPException(403, "wrong token")

    async def require_admin(creds: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:
        check_token(creds)

    async def require_reader(creds: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:
        check_reader(creds)

    # The scheme shows in the OpenAPI document only where it is enforced.
    reads_need_token = bool(server.admin_reads_need_token or server.token)
    reads = [Depends(require_reader)] if reads_need_token else []
    admin = [Depends(require_admin)]

    app = FastAPI(
        title="kvx metadata admin",
        version=__version__,
        description="Admin REST API of the kvx metadata service.",
        # Every route answers a request that fails validation with 400 (_bad_request), not 422.
        responses={400: {"description": "Bad request: a parameter fails validation"}},
    )

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=_HTTP_STATUS.get(exc.code, 500))

    @app.exception_handler(StoreError)
    async def _store_down(request: Request, exc: StoreError) -> JSONResponse:
        return JSONResponse({"detail": server.servicer.unavailable(exc)}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{' '.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}"
            for err in exc.errors()
        )
        return JSONResponse({"detail": f"bad request: {problems}"}, status_code=400)

    @app.get("/healthz", tags=["health"], summary="Liveness: the process runs")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="Readiness: the store answers",
        responses={503: {"description": "The store does not answer"}},
    )
    async def readyz() -> JSONResponse:
        ready = bool(server.ready)
        return JSONResponse({"ready": ready, "store": server.store.name}, status_code=200 if ready else 503)

    @app.get("/v1/agents", tags=["agents"], dependencies=reads, summary="List agents")
    async def list_agents(
        role: RoleName | None = Query(None, description="Only this role"),
        label: list[str] = Query([], description="key=value; repeat for several (all must match)"),
        page_size: int = Query(
            0, ge=0, le=INT32_MAX, description="0 means the service default; larger than its maximum: lowered"
        ),
        page_token: str = Query("", description="next_page_token of the previous page"),
    ) -> dict[str, Any]:
        request = metadata_pb2.ListAgentsRequest(
            role=role_filter(role), page_size=page_size, page_token=page_token
        )
        for item in label:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise HTTPException(400, f"label {item!r}: expected key=value")
            if request.labels.get(key, value) != value:
                raise HTTPException(400, f"label {key!r} given twice with different values")
            request.labels[key] = value
        response = await server.servicer.list(request)
        return {"agents": [_record(r) for r in response.records], "next_page_token": response.next_page_token}

    @app.get(
        "/v1/agents/{name}",
        tags=["agents"],
        dependencies=reads,
        summary="Get one agent",
        responses={404: {"description": "No such agent"}},
    )
    async def get_agent(name: str = Path(description="Agent name")) -> dict[str, Any]:
        _check_name(name)
        return _record((await server.servicer.get(name)).record)

    @app.delete(
        "/v1/agents/{name}",
        tags=["agents"],
        dependencies=admin,
        summary="Evict an agent (its record and lease)",
        responses={401: {"description": "No token"}, 403: {"description": "Wrong token, or none configured"}},
    )
    async def evict_agent(name: str = Path(description="Agent name")) -> dict[str, bool]:
        _check_name(name)
        response = await server.servicer.unregister(name, evict=True)
        logger.log(
            logging.WARNING if response.existed else logging.INFO,
            "admin API: evict %r: %s",
            name,
            "evicted" if response.existed else "no such agent",
        )
        return {"evicted": response.existed}

    @app.get(
        "/metrics",
        tags=["metrics"],
        dependencies=reads,
        summary="Prometheus metrics",
        response_class=Response,
    )
    async def metrics() -> Response:
        await server.metrics.store_collector.refresh()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Uvicorn(uvicorn.Server):
    """Leaves signal handling to the process that hosts the metadata service."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class AdminServer:
    """The running admin API; ``await stop()`` shuts it down."""

    def __init__(self, uv: uvicorn.Server, task: asyncio.Task, sock: socket.socket, address: str) -> None:
        self._uv, self._task, self._sock, self.address = uv, task, sock, address

    async def stop(self) -> None:
        self._uv.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_TIMEOUT_S)
        except TimeoutError:
            logger.warning("admin API did not stop within %s s; cancelling it", STOP_TIMEOUT_S)
            self._uv.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # noqa: BLE001 - already logged by _serve
            pass
        finally:
            self._sock.close()


async def serve_admin(server: Any) -> AdminServer:
    """Start the admin API of ``server`` on ``server.admin_listen`` (port 0: any free port)
    on the running event loop; sets ``server.admin_address`` to the bound "host:port"."""
    sock = bind_listener(
        server.admin_listen,
        what="admin API",
        backlog=128,
        hint="pick another with --admin-listen, or turn it off with --admin-listen off",
    )
    host, port = sock.getsockname()[:2]
    address = format_address(host, port)
    config = uvicorn.Config(
        create_app(server),
        host=host,
        port=port,
        log_level="warning",
        log_config=None,
        lifespan="off",
        access_log=False,
        http=deadline_protocol(),  # a client trickling its headers, or not reading, is cut off
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    uv = _Uvicorn(config)

    async def run() -> None:
        try:
            await uv.serve(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits on startup failures; keep the event loop alive
            raise RuntimeError(f"admin API on {address} failed to start (exit {exc.code})") from None
        except Exception:
            logger.exception("admin API on %s failed", address)
            raise

    task = asyncio.create_task(run(), name="kvx-metadata-admin")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while not uv.started:
        if task.done():
            sock.close()
            exc = task.exception()
            raise RuntimeError(f"admin API on {address} stopped while starting: {exc}") from exc
        if loop.time() > deadline:
            uv.should_exit = True
            task.cancel()
            sock.close()
            raise RuntimeError(f"admin API on {address} did not start within {START_TIMEOUT_S} s")
        await asyncio.sleep(0.01)
    server.admin_address = address
    logger.info("kvx metadata admin API on http://%s", address)
    return AdminServer(uv, task, sock, address)
