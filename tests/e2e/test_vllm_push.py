"""Push mode with real vLLM engines: prefill WRITEs each layer into decode's blocks.

One prefill and one decode engine, both ``"mode": "push"`` with chunked
prefill in small chunks (a long prompt takes several steps, each WRITEing the
blocks its chunk touched, layer by layer), and ``kvx proxy --mode push`` in
front. Token equality with a single engine means every layer of every block
arrived intact before decode used it. Prompts run from 5 to 3,000 tokens (the
longest is prefilled in 47 chunks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port, vllm_python
from tests.e2e.test_vllm_pd import (
    BLOCK_SIZE,
    _wait_http,
    block_bytes,
    complete,
    kvx_config,
    kvx_counters,
    token_ids,
    wait_until,
)

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 20.0
CHUNK_TOKENS = 64  # --max-num-batched-tokens: a 700-token prompt is prefilled in 11 steps
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (5, 70, 200, 700, 3000)]
LAYERS = 2  # tiny_model.py's
MAX_MODEL_LEN = 4096
ENGINE_ARGS = [
    "--max-num-batched-tokens",
    str(CHUNK_TOKENS),
    "--max-num-seqs",
    "8",
    "--max-model-len",
    str(MAX_MODEL_LEN),
]
# Prefill stops a push whose id starts with "killed-" after its first WRITE landed, and says
# so in its log (stall_push/sitecustomize.py): test_prefill_killed_mid_push kills it there.
STALL_PREFIX = "killed-"
STALL_ENV = {
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent / "stall_push"), os.environ.get("PYTHONPATH")])
    ),
    "E2E_STALL_PUSH_PREFIX": STALL_PREFIX,
}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (same weights) with room for the 3,000-token prompt."""
    import subprocess

    path = tmp_path_factory.mktemp("long-model") / "tiny-llama"
    script = Path(__file__).parent / "tiny_model.py"
    subprocess.run([vllm_python(), str(script), str(path), str(MAX_MODEL_LEN)], check=True, timeout=120)
    return path


@pytest.fixture(scope="module")
def cluster(long_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("push")
    engines = {
        "prefill": Engine(
            "prefill",
            long_model,
            tmp,
            kvx_config("kv_producer", mode="push", lease_s=LEASE_S),
            extra_env=STALL_ENV,
            extra_args=ENGINE_ARGS,
        ),
        "decode": Engine(
            "decode",
            long_model,
            tmp,
            dict(
                kvx_config("kv_consumer", mode="push", transfer_timeout_s=10),
                kv_load_failure_policy="recompute",
            ),
            extra_args=ENGINE_ARGS,
        ),
    }
    procs: list[Proc] = list(engines.values())
    try:
        deadline = time.monotonic() + ENGINE_START_S
        for engine in engines.values():
            engine.wait_ready(deadline)
        port = free_port()
        proxy = Proc(
            "proxy",
            [
                sys.executable,
                "-m",
                "kvx",
                "proxy",
                "--mode",
                "push",
                "--listen",
                f"127.0.0.1:{port}",
                "--timeout-s",
                "120",
                "--prefill",
                engines["prefill"].url,
                "--decode",
                engines["decode"].url,
            ],
            dict(os.environ),
            tmp / "proxy.log",
        )
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/healthz", proxy)
        yield {**engines, "proxy": url}
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> dict[int, list[int]]:
    """Greedy outputs of one engine alone (prefill's, no transfer involved)."""
    return {i: token_ids(complete(cluster["prefill"].url, p)) for i, p in enumerate(PROMPTS)}


def usage(cluster: dict[str, Any], name: str) -> float:
    return cluster[name].metric("vllm:kv_cache_usage_perc")


def log_count(cluster: dict[str, Any], name: str, text: str) -> int:
    return cluster[name].log.read_text(errors="replace").count(text)


def pull_identity(cluster: dict[str, Any]) -> dict[str, Any]:
    """Prefill's kvx identity, as the proxy learns it: from a pull-mode prefill answer."""
    from kvx.proxy._push import identity

    resp = complete(
        cluster["prefill"].url,
        PROMPTS[0],
        max_tokens=1,
        kv={"do_remote_decode": True, "do_remote_prefill": False},
    )
    params = resp.json()["kv_transfer_params"]
    assert token_ids(complete(cluster["decode"].url, PROMPTS[0], kv=params))  # frees prefill's blocks
    ident = identity(params)
    assert ident is not None, params
    return ident


def decode_push_params(ident: dict[str, Any], push_id: str) -> dict[str, Any]:
    return dict(
        ident,
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_request_id=push_id,
        remote_block_ids=[],
        kvx=dict(ident["kvx"], push=push_id),
    )


def prefill_push_params(push_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "kvx_push": push_id}


def test_push_through_proxy_equals_single_engine(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    # The proxy's first request to a prefill instance runs in pull mode: it learns prefill's identity.
    assert token_ids(complete(cluster["proxy"], PROMPTS[1])) == reference[1]
    landed = log_count(cluster, "decode", "every layer landed")
    decode = cluster["decode"]
    before = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: token_ids(complete(cluster["proxy"], p)), PROMPTS))
    assert got == [reference[i] for i in range(len(PROMPTS))]
    after = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - before == sum(len(p) for p in PROMPTS), "the prompt KV did not come through the connector"
    # Each request was pushed (not pulled): decode waited for prefill's "pushed".
    assert log_count(cluster, "decode", "every layer landed") - landed == len(PROMPTS)
    # Both sides free their blocks once the push is over; no lease runs out.
    wait_until(lambda: usage(cluster, "prefill") == 0, LEASE_S / 2, "prefill freed its blocks")
    wait_until(lambda: usage(cluster, "decode") == 0, LEASE_S / 2, "decode freed its blocks")


def test_streaming_push_through_proxy(cluster: dict[str, Any], reference: dict[int, list[int]]) -> None:
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True}
    from tests.e2e.test_vllm_pd import _with_model

    got: list[int] = []
    with httpx.stream(
        "POST",
        cluster["proxy"] + "/v1/completions",
        json=_with_model(cluster["prefill"].url, body),
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                import json

                got += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert got == reference[3]


def test_a_long_prompt_is_written_layer_by_layer_as_each_chunk_is_computed(
    cluster: dict[str, Any], long_model: Path
) -> None:
    """Prefill's WRITEs, counted in vLLM's /metrics: one per layer in every step that computed
    a chunk of the prompt, so the transfer went out while prefill was still computing; the
    bytes and descriptors are exactly those of the blocks each chunk touched."""
    prompt = [_rng.randrange(3, 1000) for _ in range(700)]  # in no cache yet
    series = "vllm:kvx_xfer_time_seconds_count"
    before = kvx_counters(cluster["prefill"])
    got = token_ids(complete(cluster["proxy"], prompt))
    steps = -(-len(prompt) // CHUNK_TOKENS)
    wait_until(
        lambda: cluster["prefill"].metric(series) - before["transfers"] >= LAYERS * steps,
        30,
        "the WRITEs counted",
    )
    after = kvx_counters(cluster["prefill"])
    # A chunk of 64 tokens lies in one 128-token block: each step WRITEs that block, every layer.
    assert CHUNK_TOKENS <= BLOCK_SIZE and BLOCK_SIZE % CHUNK_TOKENS == 0
    c = json.loads((long_model / "config.json").read_text())
    assert {key: after[key] - before[key] for key in after} == {
        "transfers": LAYERS * steps,
        "bytes": steps * block_bytes(long_model),
        # One descriptor per block, layer, plane (K, V) and head.
        "descriptors": steps * LAYERS * 2 * c["num_key_value_heads"],
        "failed": 0,
        "expired": 0,
    }
    assert got == token_ids(complete(cluster["prefill"].url, prompt))  # the single engine's answer


def test_decode_abort_before_and_during_the_push_frees_both_sides(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    ident = pull_identity(cluster)
    # Before: decode registers, then its client leaves; prefill's request comes only after.
    early = f"abort-early-{uuid.uuid4().hex}"
    with pytest.raises(httpx.TimeoutException):
        complete(cluster["decode"].url, PROMPTS[2], kv=decode_push_params(ident, early), timeout_s=2)
    resp = complete(cluster["prefill"].url, PROMPTS[2], max_tokens=1, kv=prefill_push_params(early))
    assert resp.status_code == 200, resp.text
    # During: both legs at once, decode's client gone after a moment, wherever the push is then.
    during = f"abort-during-{uuid.uuid4().hex}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leg = pool.submit(
            complete, cluster["prefill"].url, PROMPTS[3], max_tokens=1, kv=prefill_push_params(during)
        )
        # Whether the client leaves before, during or after the push depends on the machine's
        # speed; every case must end with both sides' blocks free.
        with contextlib.suppress(httpx.TimeoutException):
            complete(
                cluster["decode"].url,
                PROMPTS[3],
                kv=decode_push_params(ident, during),
                max_tokens=200,
                timeout_s=0.5,
            )
        assert leg.result(60).status_code == 200
    # Prefill stops pushing and frees; decode frees once prefill said it writes no more.
    wait_until(lambda: usage(cluster, "prefill") == 0, LEASE_S, "prefill freed its blocks")
    wait_until(lambda: usage(cluster, "decode") == 0, LEASE_S, "decode freed its blocks")
    # Both keep serving, pushed.
    assert token_ids(complete(cluster["proxy"], PROMPTS[2])) == reference[2]


def test_a_push_that_never_comes_ends_within_the_lease(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    """Decode registers, its prefill leg never arrives: after prefill's lease (2 s here) decode
    asks prefill to drop the push, and once prefill confirmed, fails the load; "recompute"
    answers with the single engine's tokens. Nothing waits longer than lease plus one transfer
    timeout."""
    ident = pull_identity(cluster)
    ident["kvx"]["lease_s"] = 2
    released = log_count(cluster, "prefill", "released it before it started")
    start = time.monotonic()
    resp = complete(
        cluster["decode"].url, PROMPTS[2], kv=decode_push_params(ident, f"lost-{uuid.uuid4().hex}")
    )
    assert token_ids(resp) == reference[2]
    assert time.monotonic() - start < 2 + 10 + 15  # lease + decode's transfer_timeout_s + slack
    assert log_count(cluster, "decode", "prefill did not push within the lease") >= 1
    assert log_count(cluster, "prefill", "released it before it started") == released + 1
    wait_until(lambda: usage(cluster, "decode") == 0, 30, "decode freed its blocks")


def _side_channel(cluster: dict[str, Any], name: str) -> tuple[str, int]:
    m = re.search(
        r"kvx side channel for engine \S+ on ([\d.]+):(\d+)", cluster[name].log.read_text(errors="replace")
    )
    assert m, f"{name} logged no side channel"
    return m.group(1), int(m.group(2))


def _rogue_peer(agent: Any, host: str, port: int) -> Any:
    import base64

    from kvx.connectors import side_channel

    doc = side_channel.fetch(host, port, 10)
    return agent.add_peer(base64.b64decode(doc["ranks"][0]["agent_metadata"]))


def test_a_rogue_agent_can_neither_redirect_nor_fake_a_push(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    """An agent that is neither side of a push (it holds the cluster secret: here there is
    none) registers blocks for a push it names, pointing prefill at prefill's own cache, and
    tells decode a push it waits for has landed. Both refuse it: the registration is not from
    the agent the named engine announces, the "pushed" is not from the prefill agent decode
    registered with. Decode still gets the real KV: its tokens equal the single engine's."""
    from kvx.agent import Agent
    from kvx.connectors.vllm.push import push_note

    ident = pull_identity(cluster)
    prompt = [_rng.randrange(3, 1000) for _ in range(300)]  # in no cache yet
    expected = token_ids(complete(cluster["prefill"].url, prompt))
    host, port = _side_channel(cluster, "decode")
    refused = log_count(cluster, "prefill", "refusing the registration")
    faked = log_count(cluster, "decode", "refusing pushed")
    with Agent(f"rogue-{uuid.uuid4().hex[:8]}") as rogue:
        to_prefill = _rogue_peer(rogue, ident["remote_host"], ident["remote_port"])
        to_decode = _rogue_peer(rogue, host, port)
        # Redirect: prefill's WRITEs for this push into prefill's own blocks 0..2.
        redirect = f"rogue-redirect-{uuid.uuid4().hex}"
        me = {k: ident[k] for k in ("remote_engine_id", "remote_host", "remote_port")}
        me["kvx"] = {k: ident["kvx"][k] for k in ("agents", "epochs", "digest")}
        to_prefill.notify(push_note("push_reg", redirect, blocks=[0, 1, 2], decode=me)).wait(10)
        resp = complete(cluster["prefill"].url, prompt, max_tokens=1, kv=prefill_push_params(redirect))
        assert resp.status_code == 200, resp.text
        wait_until(
            lambda: log_count(cluster, "prefill", "refusing the registration") > refused, 30, "refused"
        )
        # Fake: decode waits for push `real`; the rogue says it landed before prefill ever ran.
        real = f"rogue-real-{uuid.uuid4().hex}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, cluster["decode"].url, prompt, kv=decode_push_params(ident, real))
            wait_until(
                lambda: log_count(cluster, "prefill", f"push {real}: registration") > 0,
                30,
                "decode registered",
            )
            to_decode.notify(push_note("pushed", real)).wait(10)
            wait_until(
                lambda: log_count(cluster, "decode", "refusing pushed") > faked, 30, "decode refused it"
            )
            assert not fut.done(), "decode went ahead on a fake notification"
            leg = complete(cluster["prefill"].url, prompt, max_tokens=1, kv=prefill_push_params(real))
            assert leg.status_code == 200, leg.text
            assert token_ids(fut.result(60)) == expected
    # Prefill's own cache was not written over: it still answers as before.
    assert token_ids(complete(cluster["prefill"].url, PROMPTS[2])) == reference[2]
    wait_until(lambda: usage(cluster, "prefill") == 0, LEASE_S, "prefill freed its blocks")


def test_prefill_killed_mid_push(cluster: dict[str, Any], reference: dict[int, list[int]]) -> None:
    """Runs last: it kills the prefill engine while it pushes. Both legs of the 3,000-token
    prompt go out (47 chunks, two WRITEs each); prefill's first WRITE lands in decode's
    blocks, prefill posts no other (its start-up hook stalls the push there) and is stopped
    and killed, so decode never sees every layer land. Its load fails at once (the agent is
    lost, no lease runs out), vLLM's "recompute" computes the prompt locally, and decode
    counts the failed transfer."""
    ident = pull_identity(cluster)
    prompt, expected = PROMPTS[4], reference[4]
    prefill, decode = cluster["prefill"], cluster["decode"]
    failed = decode.metric("vllm:kvx_num_failed_transfers_total")
    lease_ran_out = log_count(cluster, "decode", "prefill did not push within the lease")
    push_id = f"{STALL_PREFIX}{uuid.uuid4().hex}"
    # Both engines computed this prompt before (the reference, earlier pushes): a prefix-cache
    # hit would leave prefill one chunk to compute and send every block with it, at once. A
    # salt of this push's own makes both compute it: prefill in 47 steps.
    salt = {"cache_salt": push_id}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(complete, decode.url, prompt, kv=decode_push_params(ident, push_id), **salt)
        wait_until(
            lambda: log_count(cluster, "prefill", f"push {push_id}: registration") > 0,
            30,
            "decode registered its blocks with prefill",
        )
        pool.submit(
            complete, prefill.url, prompt, max_tokens=1, kv=prefill_push_params(push_id), timeout_s=5, **salt
        )
        stalled = f"e2e: push {push_id} stalled after its first WRITE"
        wait_until(lambda: log_count(cluster, "prefill", stalled) > 0, 30, "prefill's first WRITE")
        assert log_count(cluster, "prefill", f"{stalled} (landed)") == 1, "its first WRITE did not land"
        prefill.signal(signal.SIGSTOP)
        killed_at = time.monotonic()
        prefill.signal(signal.SIGKILL)
        resp = fut.result(120)
        took_s = time.monotonic() - killed_at
    # Stopped mid-push: decode never saw every layer land (it logs each push that did).
    assert not log_count(cluster, "decode", f"push {push_id}: every layer landed"), "the push was over"
    assert token_ids(resp) == expected
    # Decode learnt of the loss from the connection, not from its lease running out.
    assert log_count(cluster, "decode", "prefill's agent is lost") >= 1
    assert log_count(cluster, "decode", "prefill did not push within the lease") == lease_ran_out
    assert took_s < 60, f"decode answered {took_s:.1f} s after the kill"
    assert decode.metric("vllm:kvx_num_failed_transfers_total") == failed + 1
    wait_until(lambda: usage(cluster, "decode") == 0, 30, "decode freed its blocks")
