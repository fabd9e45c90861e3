"""Mismatched tensor parallelism with real vLLM engines: an engine of two
ranks and an engine of one, each both a producer and a consumer of KV
(``kv_both``), hand prompts to each other in both directions.

The rank-two engine holds each layer's KV heads split over its two ranks
(one head each, for the tiny model's two); the rank-one engine holds both.
Decode's ranks read the heads they hold from the prefill ranks that hold
them, so the KV of one request crosses the engines as one read per rank pair.
Token equality with the engines alone, and KV counted as
``external_kv_transfer``, mean every head landed where it belongs.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ENGINE_START_S, Engine, Proc
from tests.e2e.test_vllm_pd import complete, kvx_config, token_ids

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_rng = random.Random(23)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (9, 130, 400)]
# One OpenMP thread per rank: three ranks share this machine's two cores.
ENV = {"OMP_NUM_THREADS": "1"}
# No prefix cache: every handed-over prompt is read whole, and the same prompts serve as the
# engines' references (computed alone, they would otherwise be cached on decode).
# float32, not the checkpoint's bf16: two ranks sum each row-parallel product in another order
# than one, and in bf16 that moved a near-tie greedy token on some CPUs (the engines disagreed
# alone); in float32 the difference is some 1e-6 of a logit.
ARGS = ["--no-enable-prefix-caching", "--dtype", "float32"]


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tp")
    both = kvx_config("kv_both")
    pair = {
        "tp2": Engine("tp2", tiny_model, tmp, both, ENV, [*ARGS, "--tensor-parallel-size", "2"]),
        "tp1": Engine("tp1", tiny_model, tmp, both, ENV, ARGS),
    }
    procs: list[Proc] = list(pair.values())
    try:
        deadline = time.monotonic() + ENGINE_START_S
        for engine in pair.values():
            engine.wait_ready(deadline)
        yield pair
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def alone(engines: dict[str, Engine]) -> list[list[int]]:
    """Each prompt's greedy tokens from each engine alone; both must agree, or the
    comparison below could not tell a wrong head from a rounding difference."""
    outs = {name: [token_ids(complete(e.url, p)) for p in PROMPTS] for name, e in engines.items()}
    assert outs["tp2"] == outs["tp1"], "the two engines disagree even without a transfer"
    return outs["tp1"]


def _handed_over(prefill: Engine, decode: Engine, prompt: list[int]) -> list[int]:
    resp = complete(
        prefill.url, prompt, max_tokens=1, kv={"do_remote_decode": True, "do_remote_prefill": False}
    )
    params = token_ids(resp) and resp.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    return token_ids(complete(decode.url, prompt, kv=params))


@pytest.mark.parametrize(("prefill", "decode"), [("tp2", "tp1"), ("tp1", "tp2")])
def test_prompts_cross_between_two_ranks_and_one(
    engines: dict[str, Engine], alone: list[list[int]], prefill: str, decode: str
) -> None:
    series, source = "vllm:prompt_tokens_by_source_total", "external_kv_transfer"
    before = engines[decode].metric(series, source=source)
    got = [_handed_over(engines[prefill], engines[decode], p) for p in PROMPTS]
    assert got == alone
    after = engines[decode].metric(series, source=source)
    assert after - before == sum(len(p) for p in PROMPTS), "the prompt KV did not come through the connector"
