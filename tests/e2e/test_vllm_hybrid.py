"""Disaggregated prefill/decode of a sliding-window + full-attention model, real vLLM engines.

The tiny Llama with ``layer_types``: layer 0 attends a sliding window of
128 tokens, layer 1 everything (Gemma-2 style), so vLLM's hybrid allocator
keeps two KV-cache groups and nulls the sliding layer's blocks before the
window. One prefill engine, one decode engine and ``kvx proxy``; prompts
longer than the window (block size 128 on vLLM's CPU backend) must give the
same tokens as the prefill engine alone.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port, vllm_python

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WINDOW = 128
MAX_TOKENS = 6
_rng = random.Random(11)
# Within the window, one block past it, and two blocks with part of a third.
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (90, 300, 450)]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny-hybrid"
    subprocess.run(
        [vllm_python(), str(Path(__file__).parent / "tiny_model.py"), str(path)], check=True, timeout=120
    )
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def kvx_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "KvxConnector", "kv_role": role, "kv_connector_extra_config": {"lease_s": 20.0}}


@pytest.fixture(scope="module")
def cluster(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hybrid")
    engines = {
        "prefill": Engine("prefill", hybrid_model, tmp, kvx_config("kv_producer")),
        "decode": Engine("decode", hybrid_model, tmp, kvx_config("kv_consumer")),
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
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proxy.popen.poll() is not None:
                raise RuntimeError(f"proxy not ready:\n{proxy.tail()}")
            time.sleep(0.3)
        yield {**engines, "proxy": url}
    finally:
        for proc in procs:
            proc.stop()


def complete(url: str, prompt: list[int]) -> list[int]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_hybrid_pd_through_proxy_equals_single_engine(cluster: dict[str, Any]) -> None:
    prefill, decode = cluster["prefill"], cluster["decode"]
    for engine in (prefill, decode):
        log = engine.log.read_text(errors="replace")
        # The hybrid allocator stayed on: two groups, the sliding one first (vLLM's order).
        assert "Turning off hybrid kv cache manager" not in log
        assert "in 2 KV-cache group(s)" in log, engine.tail()
    # The oracle can fail: the output depends on the context, not only on the last tokens.
    tail = PROMPTS[2][-120:]
    assert complete(prefill.url, PROMPTS[2][:330] + tail) != complete(prefill.url, [7] * 330 + tail)

    reference = [complete(prefill.url, p) for p in PROMPTS]
    before = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    got = [complete(cluster["proxy"], p) for p in PROMPTS]
    assert got == reference
    after = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - before == sum(len(p) for p in PROMPTS), "the prompt KV did not come through kvx"


@pytest.mark.parametrize(
    "attack",
    ["one group", "null inside the window", "id past the cache"],
)
def test_hostile_kv_transfer_params_do_no_harm(cluster: dict[str, Any], attack: str) -> None:
    """Decode gets prefill's real params, tampered with: it computes the prompt itself
    (or fails the load and recomputes it), answers correctly and keeps serving."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    prompt = PROMPTS[2]
    body = {
        "model": httpx.get(prefill.url + "/v1/models", timeout=10).json()["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = httpx.post(prefill.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    sliding, full = params["remote_block_ids"]
    if attack == "one group":
        params["remote_block_ids"] = [full]
        reason = "one list per KV-cache group: this engine has 2"
    elif attack == "null inside the window":
        sliding[-1] = 0
        reason = "null block at position 3"
    else:
        # Below 2**31: only the worker, which knows prefill's cache, can tell. The last block:
        # decode always reads it (a local prefix hit may cover the others).
        full[-1] = 10**6
        reason = "outside its cache of"
    body = dict(body, max_tokens=MAX_TOKENS, return_token_ids=True, kv_transfer_params=params)
    resp = httpx.post(decode.url + "/v1/completions", json=body, timeout=120)
    if attack == "id past the cache":
        # A failed load under the default policy "fail" ends the request with an error.
        assert resp.status_code != 200 or resp.json()["choices"][0]["finish_reason"] != "length"
    else:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == complete(prefill.url, prompt)
    assert reason in decode.log.read_text(errors="replace")
    # Decode still serves disaggregated requests.
    assert complete(cluster["proxy"], PROMPTS[1]) == complete(prefill.url, PROMPTS[1])
