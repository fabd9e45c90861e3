"""Schema-based fuzzing of kvx's HTTP surfaces with schemathesis.

Each test serves an app on loopback (uvicorn, the settings it runs with),
loads its OpenAPI document from ``/openapi.json`` and sends requests
generated from it (valid ones and ones that break the schema) to every
operation. Every answer must be no server error and must conform to the
document (status code, content type, body schema).

The budget is KVX_FUZZ_EXAMPLES examples per operation (default 20: the
whole file in well under a minute); a longer run raises it, e.g.
``KVX_FUZZ_EXAMPLES=2000 python3 -m pytest tests/fuzz``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.proxy import ProxyConfig, build_app
from tests.conftest import native_pass_only
from tests.integration.test_proxy import Served

pytestmark = [pytest.mark.timeout(120), native_pass_only]

EXAMPLES = int(os.environ.get("KVX_FUZZ_EXAMPLES", "20"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=list(HealthCheck),
)


def fake_vllm(role: str) -> FastAPI:
    """An instance that answers any JSON object like vLLM with a KV connector would."""
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        body = json.loads(await request.body())
        if role == "prefill":
            return JSONResponse(
                {"id": "p", "kv_transfer_params": {"remote_engine_id": "e", "remote_port": 1}}
            )
        if body.get("stream") is True:

            async def events():
                yield b'data: {"choices": []}\n\n'
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"id": "d", "choices": [{"index": 0, "text": "ok"}]})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake"}]}

    return app


@pytest.fixture(scope="module")
def proxy_schema():
    prefill, decode = Served(fake_vllm("prefill")), Served(fake_vllm("decode"))
    config = ProxyConfig(prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_body_bytes=1 << 20)
    proxy = Served(build_app(config), config)
    try:
        yield schemathesis.openapi.from_url(f"{proxy.url}/openapi.json", timeout=10)
    finally:
        for served in (proxy, prefill, decode):
            served.stop()


@pytest.fixture(scope="module")
def admin_schema():
    service = ThreadedServer(
        MetadataServer("127.0.0.1:0", admin_listen="127.0.0.1:0", admin_token=ADMIN_TOKEN), start_timeout_s=20
    )
    try:
        yield schemathesis.openapi.from_url(f"http://{service.server.admin_address}/openapi.json", timeout=10)
    finally:
        service.stop()


proxy = schemathesis.pytest.from_fixture("proxy_schema")
admin = schemathesis.pytest.from_fixture("admin_schema")
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@proxy.parametrize()
@FUZZ_SETTINGS
def test_the_proxy_answers_every_request_by_its_schema(case):
    case.call_and_validate(checks=CHECKS, timeout=10)


@admin.parametrize()
@FUZZ_SETTINGS
def test_the_admin_api_answers_every_request_by_its_schema(case):
    case.call_and_validate(checks=CHECKS, headers=AS_ADMIN, timeout=10)


def test_listing_agents_with_a_page_size_over_int32_is_no_server_error(admin_schema):
    case = admin_schema["/v1/agents"]["GET"].Case(query={"page_size": 2**31})
    case.call_and_validate(checks=[not_a_server_error], headers=AS_ADMIN, timeout=10)


def test_listing_agents_with_a_bad_role_answers_a_documented_status(admin_schema):
    case = admin_schema["/v1/agents"]["GET"].Case(query={"role": "null"})
    case.call_and_validate(checks=[status_code_conformance], headers=AS_ADMIN, timeout=10)
