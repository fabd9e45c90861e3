"""``kvx proxy``: an OpenAI-compatible router for disaggregated vLLM serving.

Each completion runs twice: first on a prefill instance with ``max_tokens=1``
and ``kv_transfer_params.do_remote_decode`` (it computes the prompt's KV
cache and holds it), then on a decode instance with the client's request and
the ``kv_transfer_params`` the prefill returned (it pulls the KV cache and
generates). Both instances run vLLM with a KV connector (``kv_producer`` or
``kv_both`` on prefill, ``kv_consumer`` or ``kv_both`` on decode). The
instance with the fewest requests in flight gets each leg; ties go round robin.
With ``prefill_kv_events`` the prefill leg goes instead to the instance where
the prompt's longest prefix is cached, balanced against load: the proxy reads
each engine's vLLM KV cache events (``_kv_events``, ``_kv_routing``).

Endpoints:

    POST /v1/completions        prefill, then decode; ``"stream": true`` relays
    POST /v1/chat/completions   the decode's server-sent events as they come
    GET  /v1/models             from a decode instance
    GET  /healthz, /health      200 with the instances and their requests in
                                flight; 503 without a prefill or a decode instance
    GET  /metrics               Prometheus: routing choices, KV event batches

Both legs carry the client's ``X-Request-Id`` (or a new one, returned in the
answer) and its ``Authorization``. Errors are OpenAI-style
``{"error": {"message", "type", "leg"}}``; header ``X-Kvx-Failed-Leg`` names
the leg that failed. An instance's own HTTP error comes back as it was sent;
an instance that cannot be reached gives 502 (type ``upstream_unavailable``),
one that does not answer in time 504 (``upstream_timeout``); a stream that
breaks ends with a ``data: {"error": ...}`` event.

Clients are not trusted: a body over ``max_body_bytes`` gets 413, one not in
within ``body_timeout_s`` 408, one nested deeper than ``max_json_depth`` 400;
a connection whose headers are not in within ``header_timeout_s`` is closed,
one whose client takes under 64 KiB of its answer in ``send_timeout_s``
(its buffers full) reset.

Needs httpx (``pip install kvx[proxy]``), imported when an app is built.
"""

from __future__ import annotations

from kvx.proxy._app import build_app
from kvx.proxy._config import ProxyConfig
from kvx.proxy._serve import serve

__all__ = ["ProxyConfig", "build_app", "serve"]
