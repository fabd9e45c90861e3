"""``kvx proxy --mode push``: both legs at once, tied by a push id.

Decode gets the client's request with ``kv_transfer_params`` that name the
prefill engine (its kvx identity: engine id, side channel, agents and their
epochs, as a pull-mode prefill answer carries them) and ``kvx.push``; prefill
gets the one-token leg with ``kvx_push``. Decode allocates the prompt's blocks
and registers them with prefill over kvx; prefill WRITEs each layer as it
computes it. The proxy learns a prefill instance's identity from the first
request it sends there, which runs in pull mode; a prefill leg that fails
forgets it (a restarted engine has new agent epochs).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.responses import Response

from kvx.proxy._legs import PREFILL_KV_TRANSFER_PARAMS, _dumps, _LegFailed, _passthrough, prefill_body

if TYPE_CHECKING:
    from kvx.proxy._app import _Router
    from kvx.proxy._instances import Instance
    from kvx.proxy._kv_routing import Choice

MAX_KNOWN = 4096  # prefill identities remembered (one per instance)


def identity(params: dict[str, Any]) -> dict[str, Any] | None:
    """What decode needs to find a prefill engine, from a pull-mode prefill answer."""
    kvx = params.get("kvx")
    keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")
    if not isinstance(kvx, dict) or any(params.get(k) is None for k in keys[:4]):
        return None
    return {k: params.get(k) for k in keys} | {
        "kvx": {k: kvx.get(k) for k in ("agents", "epochs", "digest", "lease_s")}
    }


class PushFlow:
    def __init__(self, router: _Router) -> None:
        self.router = router
        self.known: dict[str, dict[str, Any]] = {}  # prefill URL -> identity

    def learn(self, url: str, params: dict[str, Any]) -> None:
        ident = identity(params)
        if ident is not None and (url in self.known or len(self.known) < MAX_KNOWN):
            self.known[url] = ident

    def knows(self, url: str) -> bool:
        return url in self.known

    async def complete(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        request_id: str,
        instance: Instance,
        choice: Choice | None,
    ) -> Response:
        """The client's answer, through ``instance``: a prefill instance the router acquired
        (by load, or KV-aware, as in pull mode) and ``knows``. Released here, whatever happens."""
        r = self.router
        pool = r.pools["prefill"]
        queued = choice.queued_tokens if choice else 0
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                pool.release(instance, queued)

        try:
            ident = self.known.get(instance.url)
            if ident is None:  # forgotten since the router asked (a prefill leg failed there)
                raise _LegFailed(r._no_instance("prefill"))
            r._count_choice("prefill", instance, choice, request_id)
            push_id = f"{request_id[:64]}-{uuid.uuid4().hex}"
            leg = prefill_body(body)
            leg["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS, kvx_push=push_id)
            decode_params = dict(
                ident,
                do_remote_prefill=True,
                do_remote_decode=False,
                remote_request_id=push_id,
                remote_block_ids=[],
                kvx=dict(ident["kvx"], push=push_id),
            )
            prefill_content = await _dumps(leg)
            decode_content = await _dumps({**body, "kv_transfer_params": decode_params})
            failed: list[Response] = []
            answer: list[Response] = []

            async def prefill_leg(scope: anyio.CancelScope) -> None:
                try:
                    request = r.client.build_request(
                        "POST", instance.url + path, headers=headers, content=prefill_content
                    )
                    response = await r.whole(
                        await r.send_request(request, "prefill", instance.url), "prefill", instance.url
                    )
                    if response.status_code >= 400:
                        failed.append(_passthrough(response, "prefill"))
                except r.httpx.RequestError as exc:
                    failed.append(r._transport_error(exc, "prefill", instance.url))
                except _LegFailed as exc:  # its answer too large, or not done in time
                    failed.append(exc.response)
                finally:
                    release()
                if failed:
                    self.known.pop(instance.url, None)
                    scope.cancel()  # the decode leg: its engine then releases the push

            async with anyio.create_task_group() as tg:
                tg.start_soon(prefill_leg, tg.cancel_scope)
                try:
                    if body.get("stream") is True:
                        answer.append(await r._decode_stream(path, decode_content, headers, request_id))
                    else:
                        _, response = await r._call(
                            "decode", "POST", path, headers, request_id, decode_content
                        )
                        answer.append(_passthrough(response))
                except _LegFailed as exc:
                    answer.append(exc.response)
                    tg.cancel_scope.cancel()  # the prefill leg: its engine then stops pushing
        finally:
            release()
        if failed:
            stream = answer[0] if answer else None
            if stream is not None and hasattr(stream, "_on_close"):
                await stream._on_close()
            raise _LegFailed(failed[0])
        return answer[0]
