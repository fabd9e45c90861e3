"""Disaggregated prefill/decode with real vLLM engines and KvxConnector.

A prefill engine, two decode engines (kv_load_failure_policy "fail" and
"recompute") and ``kvx proxy`` in front, all real processes on loopback. The
model is a tiny Llama with seeded random weights, so the decode output
depends on the KV cache it received: token equality with a single engine
means the KV arrived intact.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 10.0
MAX_TOKENS = 8
_rng = random.Random(7)
# Lengths around and across the block size (128 on vLLM's CPU backend), none a multiple of it.
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (5, 70, 129, 200, 300, 383)]
# The oracle's self-check: same last token, different context.
ORACLE_PAIR = [list(range(5, 74)) + [74], [7] * 69 + [74]]
BLOCK_SIZE = 128  # vLLM's CPU backend's default
MAX_MODEL_LEN = 1024  # the engines' --max-model-len (tests/e2e/conftest.py)


def kvx_config(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KvxConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """prefill and decode find each other through a kvx metadata service; decode_recompute
    uses prefill's side channel, over tcp. ``proxy`` knows its instances from the command line,
    ``proxy_discovering`` from the metadata service."""
    tmp = tmp_path_factory.mktemp("pd")
    env = dict(os.environ)
    md_port = free_port()
    metadata = Proc(
        "metadata",
        [
            sys.executable,
            "-m",
            "kvx",
            "metadata",
            "--listen",
            f"127.0.0.1:{md_port}",
            "--admin-listen",
            "off",
        ],
        env,
        tmp / "metadata.log",
    )
    procs: list[Proc] = [metadata]
    md = f"127.0.0.1:{md_port}"
    engines = {
        "prefill": Engine(
            "prefill", tiny_model, tmp, kvx_config("kv_producer", lease_s=LEASE_S, metadata=md, api_url="")
        ),
        "decode": Engine(
            "decode",
            tiny_model,
            tmp,
            kvx_config("kv_consumer", transfer_timeout_s=10, metadata=md, api_url=""),
        ),
        # Loaded by module path rather than by the name the plugin registers: both ways work.
        # Its agent is forced to tcp, the path between hosts, which a same-host pair never takes;
        # decode reads, so decode's setting picks the transport (prefill stays "auto": it serves
        # decode over shm at the same time).
        "decode_recompute": Engine(
            "decode_recompute",
            tiny_model,
            tmp,
            dict(
                kvx_config("kv_consumer", transfer_timeout_s=10, backend="tcp"),
                kv_connector_module_path="kvx.connectors.vllm",
                kv_load_failure_policy="recompute",
            ),
        ),
    }
    procs += engines.values()
    try:
        deadline = time.monotonic() + ENGINE_START_S
        for engine in engines.values():
            engine.wait_ready(deadline)
        urls = {}
        for name, args in (
            ("proxy", ["--prefill", engines["prefill"].url, "--decode", engines["decode"].url]),
            ("proxy_discovering", ["--metadata", md]),
        ):
            port = free_port()
            proxy = Proc(
                name,
                [
                    sys.executable,
                    "-m",
                    "kvx",
                    "proxy",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--timeout-s",
                    "120",
                    *args,
                ],
                env,
                tmp / f"{name}.log",
            )
            procs.append(proxy)
            urls[name] = f"http://127.0.0.1:{port}"
            _wait_http(urls[name] + "/healthz", proxy)
        yield {**engines, **urls, "tmp": tmp}
    finally:
        for proc in procs:
            proc.stop()


def _wait_http(url: str, proc: Proc, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready:\n{proc.tail()}")


def complete(
    url: str,
    prompt: list[int],
    *,
    kv: dict[str, Any] | None = None,
    max_tokens: int = MAX_TOKENS,
    timeout_s: float = 120,
    **extra: Any,
) -> httpx.Response:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    if kv is not None:
        body["kv_transfer_params"] = kv
    return httpx.post(url + "/v1/completions", json=_with_model(url, body), timeout=timeout_s)


_models: dict[str, str] = {}


def _with_model(url: str, body: dict[str, Any]) -> dict[str, Any]:
    if url not in _models:
        _models[url] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return dict(body, model=_models[url])


def token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def prefill_leg(cluster: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    resp = complete(
        cluster["prefill"].url,
        prompt,
        max_tokens=1,
        kv={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["kvx"]["agents"], params
    return params


def wait_until(fn, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if fn():
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def prefill_blocks_in_use(cluster: dict[str, Any]) -> float:
    return cluster["prefill"].metric("vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> dict[int, list[int]]:
    """Greedy outputs of one engine alone (prefill's engine, no transfer involved)."""
    out = {}
    for i, prompt in enumerate(PROMPTS + ORACLE_PAIR):
        out[i] = token_ids(complete(cluster["prefill"].url, prompt))
    return out


def test_the_oracle_can_fail(reference: dict[int, list[int]]) -> None:
    n = len(PROMPTS)
    assert reference[n] != reference[n + 1], (
        "the model ignores the context: token equality would prove nothing"
    )


def test_pd_through_proxy_equals_single_engine(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    decode = cluster["decode"]
    before = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: token_ids(complete(cluster["proxy"], p)), PROMPTS))
    assert got == [reference[i] for i in range(len(PROMPTS))]
    after = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - before == sum(len(p) for p in PROMPTS), "the prompt KV did not come through the connector"
    # Decode's "done" notifications free prefill's blocks, well before the lease would.
    took = wait_until(lambda: prefill_blocks_in_use(cluster) == 0, LEASE_S / 2, "prefill freed the blocks")
    assert took < LEASE_S / 2


def test_side_channel_path_over_tcp_equals_single_engine(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    """decode_recompute has no metadata service (it finds prefill through prefill's side
    channel) and its agent is forced to tcp, the path between hosts."""
    decode = cluster["decode_recompute"]
    source = {"source": "external_kv_transfer"}
    before = decode.metric("vllm:prompt_tokens_by_source_total", **source)
    for i in range(3):
        params = prefill_leg(cluster, PROMPTS[i])
        assert token_ids(complete(decode.url, PROMPTS[i], kv=params)) == reference[i], i
    # Its load-failure policy is "recompute": equal tokens alone could come from a local
    # prefill. The counter says the prompts' KV was loaded through the connector.
    after = decode.metric("vllm:prompt_tokens_by_source_total", **source)
    assert after - before == sum(len(p) for p in PROMPTS[:3]), "the KV did not come through the connector"
    log = decode.log.read_text(errors="replace")
    assert re.search(r"peer \S+ epoch \S+ over tcp ", log), "decode_recompute did not read over tcp"
    assert not re.search(r"peer \S+ epoch \S+ over (?!tcp )", log), "decode_recompute used another backend"
    # The same pair of engines on one host, backend "auto": decode reads over shm.
    assert " over shm " in cluster["decode"].log.read_text(errors="replace")


def test_discovering_proxy(cluster: dict[str, Any], reference: dict[int, list[int]]) -> None:
    # The second proxy found both engines through the metadata service (their api_url).
    health = httpx.get(cluster["proxy_discovering"] + "/healthz", timeout=10).json()
    assert cluster["prefill"].url in json.dumps(health) and cluster["decode"].url in json.dumps(health)
    assert token_ids(complete(cluster["proxy_discovering"], PROMPTS[0])) == reference[0]


def test_streaming_through_proxy(cluster: dict[str, Any], reference: dict[int, list[int]]) -> None:
    body = _with_model(
        cluster["proxy"],
        {
            "model": "m",
            "prompt": PROMPTS[3],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "stream": True,
        },
    )
    tokens: list[int] = []
    with httpx.stream("POST", cluster["proxy"] + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    tokens.extend(choice.get("token_ids") or [])
    assert tokens == reference[3]


def test_same_request_id_on_both_legs(cluster: dict[str, Any]) -> None:
    resp = httpx.post(
        cluster["proxy"] + "/v1/completions",
        headers={"X-Request-Id": "kvx-e2e-rid-1"},
        json=_with_model(
            cluster["proxy"], {"model": "m", "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
        ),
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("x-request-id") == "kvx-e2e-rid-1"
    for name in ("prefill", "decode"):
        assert "kvx-e2e-rid-1" in cluster[name].log.read_text(errors="replace"), name


KVX_SERIES = {
    "transfers": "vllm:kvx_xfer_time_seconds_count",
    "bytes": "vllm:kvx_bytes_transferred_sum",
    "descriptors": "vllm:kvx_num_descriptors_sum",
    "failed": "vllm:kvx_num_failed_transfers_total",
    "expired": "vllm:kvx_num_kv_expired_reqs_total",
}


def kvx_counters(engine: Engine) -> dict[str, float]:
    """The engine's ``vllm:kvx_*`` series, from vLLM's own /metrics."""
    return {key: engine.metric(name) for key, name in KVX_SERIES.items()}


def block_bytes(model: Path) -> int:
    """The bytes of one KV-cache block of the tiny model, all layers, K and V (bfloat16)."""
    c = json.loads((model / "config.json").read_text())
    return c["num_hidden_layers"] * 2 * BLOCK_SIZE * c["num_key_value_heads"] * c["head_dim"] * 2


def test_kvx_metrics_in_vllm_equal_what_moved(cluster: dict[str, Any], tiny_model: Path) -> None:
    """vLLM's /metrics carries the connector's vllm:kvx_* series, and they count exactly
    the bytes, descriptors and transfers of the requests sent."""
    decode, prefill = cluster["decode"], cluster["prefill"]
    before, prefill_before = kvx_counters(decode), kvx_counters(prefill)
    # Fresh prompts (no prefix of them is cached on decode), so decode reads every block.
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (100, 257, 383)]
    blocks = 0
    for prompt in prompts:
        params = prefill_leg(cluster, prompt)
        assert len(params["remote_block_ids"][0]) == -(-len(prompt) // BLOCK_SIZE)
        blocks += len(params["remote_block_ids"][0])
        assert complete(decode.url, prompt, kv=params).status_code == 200
    assert blocks == 1 + 3 + 3
    # A request's numbers reach vLLM with its "finished receiving", ahead of its first token;
    # the front end records them from the same step's stats: wait for them, then compare exactly.
    wait_until(
        lambda: kvx_counters(decode)["transfers"] >= before["transfers"] + len(prompts),
        30,
        "decode's vllm:kvx_xfer_time_seconds_count counted the reads",
    )
    after = kvx_counters(decode)
    delta = {key: after[key] - before[key] for key in after}
    # One read per request (both engines have tensor parallelism 1).
    c = json.loads((tiny_model / "config.json").read_text())
    assert delta == {
        "transfers": len(prompts),
        "bytes": blocks * block_bytes(tiny_model),
        # One descriptor per block, layer, plane (K, V) and head.
        "descriptors": blocks * c["num_hidden_layers"] * 2 * c["num_key_value_heads"],
        "failed": 0,
        "expired": 0,
    }, (before, after)
    # Every read decode made so far succeeded (the fault tests run later).
    assert after["failed"] == 0
    # Prefill serves the reads: it made none itself, and every lease ended with decode's "done".
    assert kvx_counters(prefill) == prefill_before
    assert prefill_before["transfers"] == prefill_before["expired"] == 0
    # Backend in use: decode reads over shm (same host, "auto"), decode_recompute over tcp (forced).
    assert decode.metric("vllm:kvx_backend_info", backend="shm") == 1
    assert decode.metric("vllm:kvx_backend_info", backend="tcp") == 0
    assert cluster["decode_recompute"].metric("vllm:kvx_backend_info", backend="tcp") == 1
    assert cluster["decode_recompute"].metric("vllm:kvx_backend_info", backend="shm") == 0


def test_unread_blocks_are_freed_when_the_lease_ends(cluster: dict[str, Any]) -> None:
    wait_until(lambda: prefill_blocks_in_use(cluster) == 0, LEASE_S + 5, "prefill idle")
    expired = cluster["prefill"].metric(KVX_SERIES["expired"])
    prefill_leg(cluster, PROMPTS[4])  # decode never comes
    held_at = time.monotonic()
    assert prefill_blocks_in_use(cluster) > 0, "prefill did not hold the blocks for decode"
    wait_until(lambda: prefill_blocks_in_use(cluster) == 0, LEASE_S + 10, "the lease freed the blocks")
    assert time.monotonic() - held_at >= LEASE_S * 0.8, "freed before the lease ended"
    # vLLM's /metrics on prefill counts the expiry, once.
    wait_until(
        lambda: cluster["prefill"].metric(KVX_SERIES["expired"]) >= expired + 1,
        30,
        "prefill's vllm:kvx_num_kv_expired_reqs counted the expiry",
    )
    assert cluster["prefill"].metric(KVX_SERIES["expired"]) == expired + 1


def test_a_prefix_hit_on_decode_still_releases_prefill(
    cluster: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    prompt = PROMPTS[5]
    # Decode computes the prompt itself first, so its prefix cache holds it (vLLM still
    # loads the last block, so decode reads just that)...
    assert token_ids(complete(cluster["decode"].url, prompt)) == reference[5]
    params = prefill_leg(cluster, prompt)
    assert token_ids(complete(cluster["decode"].url, prompt, kv=params)) == reference[5]
    # ...and prefill's blocks are still released at once, not at the lease's end.
    took = wait_until(lambda: prefill_blocks_in_use(cluster) == 0, LEASE_S / 2, "prefill freed the blocks")
    assert took < LEASE_S / 2


def test_abort_on_decode_releases_prefill(cluster: dict[str, Any]) -> None:
    params = prefill_leg(cluster, PROMPTS[2])
    url = cluster["decode"].url
    body = _with_model(
        url,
        {
            "model": "m",
            "prompt": PROMPTS[2],
            # As many tokens as fit, streamed: the client goes away at the first of them,
            # while decode still has hundreds to make, and decode aborts the request. (A
            # deadline on a whole answer raced the engine: one run made them all in time.)
            "max_tokens": MAX_MODEL_LEN - len(PROMPTS[2]),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "kv_transfer_params": params,
        },
    )
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                assert line != "data: [DONE]", "decode finished before the client went away: nothing to abort"
                choices = json.loads(line[6:]).get("choices") or [{}]
                assert choices[0].get("finish_reason") is None, f"decode finished at once: {line[:300]}"
                break  # the first tokens: leave, closing the connection
    wait_until(lambda: prefill_blocks_in_use(cluster) == 0, LEASE_S + 10, "prefill freed the blocks")
    # Decode is healthy afterwards.
    assert complete(cluster["decode"].url, PROMPTS[0]).status_code == 200


def test_prefill_killed_mid_transfer(cluster: dict[str, Any], reference: dict[int, list[int]]) -> None:
    """Runs last: it kills the prefill engine."""
    fail_params = prefill_leg(cluster, PROMPTS[4])
    recompute_params = prefill_leg(cluster, PROMPTS[5])
    prefill = cluster["prefill"]
    failed = {name: cluster[name].metric(KVX_SERIES["failed"]) for name in ("decode", "decode_recompute")}
    prefill.signal(signal.SIGSTOP)  # frozen: decode's reads hang on it...
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fail = pool.submit(complete, cluster["decode"].url, PROMPTS[4], kv=fail_params)
        recompute = pool.submit(complete, cluster["decode_recompute"].url, PROMPTS[5], kv=recompute_params)
        time.sleep(1.5)
        killed_at = time.monotonic()
        prefill.signal(signal.SIGKILL)  # ...until it dies
        fail_resp = fail.result(60)
        fail_s = time.monotonic() - killed_at
        recompute_resp = recompute.result(60)
        recompute_s = time.monotonic() - killed_at
    assert fail_resp.status_code >= 500, fail_resp.text  # kv_load_failure_policy "fail"
    assert token_ids(recompute_resp) == reference[5]  # "recompute": computed locally instead
    assert fail_s < 15 and recompute_s < 20, (fail_s, recompute_s)
    # vLLM's /metrics on each decode engine counts its one failed read, exactly.
    series = KVX_SERIES["failed"]
    wait_until(
        lambda: all(cluster[n].metric(series) >= failed[n] + 1 for n in failed),
        30,
        "each decode engine counted its failed read",
    )
    assert {n: cluster[n].metric(series) - failed[n] for n in failed} == dict.fromkeys(failed, 1)
    # Both decode engines keep serving.
    for name in ("decode", "decode_recompute"):
        assert token_ids(complete(cluster[name].url, PROMPTS[1])) == reference[1]
