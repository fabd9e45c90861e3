"""Pieces of a proxied request's legs that the pull flow (``kvx.proxy._app``) and
the push flow (``kvx.proxy._push``) share."""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi.responses import Response

FAILED_LEG_HEADER = "X-Kvx-Failed-Leg"
# What vLLM's KV connectors read on the prefill leg: compute the KV cache and
# hold it for a decode elsewhere, which fills in the remote_* fields it returns.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def _dumps(obj: Any) -> bytes:
    """JSON for an upstream, encoded off the event loop (a body may be megabytes)."""
    return await anyio.to_thread.run_sync(lambda: json.dumps(obj).encode())


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: one token, not streamed, KV cache kept for a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat: vLLM takes it over max_tokens
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)  # only valid with stream=True
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def _passthrough(response: Any, leg: str | None = None) -> Response:
    """An upstream's whole answer (status, body, content type) for the client."""
    headers = {FAILED_LEG_HEADER: leg} if leg is not None else {}
    content_type = response.headers.get("content-type")
    if content_type:
        headers["content-type"] = content_type
    return Response(response.content, status_code=response.status_code, headers=headers)


class _LegFailed(Exception):
    """Ends a request with ``response``, the error the client sees."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response

    @property
    def message(self) -> str:
        """The error's message, for a log line."""
        try:
            return str(json.loads(bytes(self.response.body))["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return f"HTTP {self.response.status_code}"


def content_encoding(response: Any) -> str:
    """The codings an answer's Content-Encoding names besides identity ("" for none)."""
    codings = [c.strip().lower() for c in ",".join(response.headers.get_list("content-encoding")).split(",")]
    return ", ".join(c for c in codings if c and c != "identity")
