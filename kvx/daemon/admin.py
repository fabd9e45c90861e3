"""A daemon's admin API: health, readiness, status, drain and metrics.

Reads are open (the port is for the cluster's operators and Prometheus: the
helm chart's NetworkPolicy keeps it inside the release); ``POST /v1/drain``
needs the admin bearer token, and is refused (403) when the daemon has none,
so that nobody who reaches the port can take an instance out of service.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:
    from kvx.daemon.run import Daemon


def build_admin(daemon: Daemon) -> FastAPI:
    app = FastAPI(title=f"kvx {daemon.s.role} daemon admin API", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> Any:
        alive, reason = daemon.alive()
        if alive:
            return {"status": "ok"}
        return JSONResponse({"status": "failing", "reason": reason}, status_code=503)

    @app.get("/readyz")
    async def readyz() -> Any:
        ready, reason = daemon.ready()
        if ready:
            return {"ready": True}
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return daemon.status()

    @app.post("/v1/drain", status_code=202)
    async def drain(request: Request) -> Any:
        if daemon.admin_token is None:
            return JSONResponse(
                {"error": "this daemon has no --admin-token-file: drain it with SIGTERM"}, status_code=403
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), daemon.admin_token):
            return JSONResponse(
                {"error": "missing or wrong bearer token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        daemon.request_drain("POST /v1/drain")
        return {"draining": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
