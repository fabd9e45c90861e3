"""KV-aware routing with real vLLM engines: a prompt goes where its prefix is cached.

Two prefill engines publish their KV cache events (``--kv-events-config``,
ZMQ), one decode engine pulls over kvx, and ``kvx proxy --prefill-kv-events``
routes. A first long prompt lands on one prefill engine; a second one that
shares its first blocks must go to that same engine (where load alone would
send it to the other, idle one, in turn) and hit its prefix cache there.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc, free_port

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU backend
# The routing is the proxy's: each engine runs its worker inside its engine core's process
# (the CPU backend's executor stays "uni"), two processes instead of three, and starts in
# two thirds of the time. The connector's worker in a process of its own, as on GPUs with
# tensor parallelism, is test_vllm_pd.py's and test_vllm_tp.py's.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_rng = random.Random(11)
SHARED = [_rng.randrange(3, 1000) for _ in range(3 * BLOCK)]  # three full blocks
FIRST = SHARED + [_rng.randrange(3, 1000) for _ in range(40)]
SECOND = SHARED + [_rng.randrange(3, 1000) for _ in range(50)]


def kvx_config(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KvxConnector", "kv_role": role, "kv_connector_extra_config": extra}


def kv_events_args(port: int) -> list[str]:
    # "*": vLLM binds the endpoint; with a host it would connect to it instead.
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ["--kv-events-config", json.dumps(config)]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return 0.0


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("kvroute")
    events = {name: free_port() for name in ("p0", "p1")}
    engines = {
        name: Engine(
            name,
            tiny_model,
            tmp,
            kvx_config("kv_producer", lease_s=30),
            extra_env=ONE_PROCESS,
            extra_args=kv_events_args(port),
        )
        for name, port in events.items()
    }
    engines["d0"] = Engine(
        "d0", tiny_model, tmp, kvx_config("kv_consumer", transfer_timeout_s=30), extra_env=ONE_PROCESS
    )
    procs: list[Proc] = list(engines.values())
    try:
        deadline = time.monotonic() + ENGINE_START_S
        for engine in engines.values():
            engine.wait_ready(deadline)
        port = free_port()
        argv = [sys.executable, "-m", "kvx", "proxy", "--listen", f"127.0.0.1:{port}", "--timeout-s", "120"]
        for name in ("p0", "p1"):
            url = engines[name].url
            argv += ["--prefill", url, "--prefill-kv-events", f"{url}=tcp://127.0.0.1:{events[name]}"]
        argv += ["--decode", engines["d0"].url]
        proxy = Proc("proxy", argv, dict(os.environ), tmp / "proxy.log")
        procs.append(proxy)
        proxy.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        proxy.wait_ready(time.monotonic() + 30)
        yield {**engines, "proxy": proxy}
    finally:
        for proc in procs:
            proc.stop()


def test_a_shared_prefix_goes_to_the_prefill_engine_that_holds_it(cluster: dict[str, Any]) -> None:
    proxy = cluster["proxy"]
    prefills = {name: cluster[name] for name in ("p0", "p1")}
    with httpx.Client(base_url=proxy.url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        first = client.post("/v1/completions", json={"model": model, "prompt": FIRST, "max_tokens": 2})
        assert first.status_code == 200, first.text
        done = {name: e.metric("vllm:request_success_total") for name, e in prefills.items()}
        holder = max(done, key=done.__getitem__)
        other = "p1" if holder == "p0" else "p0"
        assert done == {holder: 1.0, other: 0.0}
        # The holder's stored blocks reach the proxy's index.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = client.get("/healthz").json()
            if health["kv_events"][prefills[holder].url]["blocks"] >= 3:
                break
            time.sleep(0.5)
        assert health["kv_events"][prefills[holder].url]["blocks"] >= 3, (health, proxy.tail())
        hits_before = prefills[holder].metric("vllm:prefix_cache_hits_total")

        second = client.post("/v1/completions", json={"model": model, "prompt": SECOND, "max_tokens": 2})
        assert second.status_code == 200, second.text
        assert prefills[holder].metric("vllm:request_success_total") == 2.0
        assert prefills[other].metric("vllm:request_success_total") == 0.0
        assert prefills[holder].metric("vllm:prefix_cache_hits_total") - hits_before >= len(SHARED)
        metrics = client.get("/metrics").text
    assert _metric(metrics, 'kvx_proxy_route_total{leg="prefill",reason="prefix"}') == 1.0
    assert _metric(metrics, 'kvx_proxy_route_total{leg="prefill",reason="load"}') == 1.0
    assert _metric(metrics, "kvx_proxy_prefill_cached_tokens_sum") == len(SHARED)
    assert f"prefill on {prefills[holder].url} (prefix: {len(SHARED)} prompt tokens cached" in proxy.tail(200)
