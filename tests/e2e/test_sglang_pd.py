"""SGLang prefill/decode with ``--disaggregation-transfer-backend kvx``, real engines.

The engines run from ``$KVX_SGLANG_PYTHON`` (SGLang 0.5.23 on CPU with kvx
installed: ``scripts/sglang_env.sh`` builds ``.venv-sglang``), where the
``kvx`` choice comes from kvx's ``sglang.srt.plugins`` entry point alone.
Greedy outputs of the pair must equal a single engine's, token for token,
through SGLang's manual bootstrap flow and through its router; SGLang's
``fake`` decode is the negative control that must fail the comparison.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Proc, free_port

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_NEW = 8
CHUNK = 64  # --chunked-prefill-size: longer prompts are prefilled, and sent, in chunks
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 64, 100, 257)]
ORACLE_PAIR = [list(range(5, 74)) + [74], [7] * 69 + [74]]
# Request ids of the fake-transfer negative control: its first token is a hash of the id.
FAKE_RIDS = ("kvx-negative-control-0", "kvx-negative-control-1")
VOCAB = 1024  # tests/e2e/tiny_model.py


def fake_handoff_token(rid: str) -> int:
    """The first token SGLang's fake transfer gives a request, whatever its prompt
    (``_generate_fake_prefill_handoff_output_id`` in SGLang 0.5.23's decode)."""
    digest = hashlib.blake2b(rid.encode(), digest_size=8, person=b"fake-pd").digest()
    return int.from_bytes(digest, "little") % VOCAB


def sglang_python() -> str:
    path = os.environ.get("KVX_SGLANG_PYTHON")
    if not path or not os.path.exists(path):
        msg = (
            "no SGLang environment: set KVX_SGLANG_PYTHON (scripts/sglang_env.sh builds .venv-sglang "
            "and prints the variables)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def sglang_env() -> dict[str, str]:
    repo = Path(__file__).resolve().parents[2]
    native = Path(sglang_python()).parent.parent / "lib" / "native"
    env = dict(
        os.environ,
        SGLANG_USE_CPU_ENGINE="1",
        KVX_LOG_LEVEL="DEBUG",
        PYTHONPATH=str(repo / "tests" / "sglang_env" / "stubs"),
        # Prefill gives up on a decode that never sends its KV indices after this long.
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="15",
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT="15",
        SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="1",
    )
    if native.exists():
        env["LD_LIBRARY_PATH"] = str(native)
    # uv installed the environment without .pyc files: let the first process write them, or
    # each engine compiles SGLang and torch from source again (some 20 s a process here).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


class Server(Proc):
    def __init__(
        self, name: str, model: Path, tmp: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sglang_python(),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-total-tokens",
            "32768",
            "--chunked-prefill-size",
            str(CHUNK),
            *args,
        ]
        super().__init__(name, argv, {**sglang_env(), **(env or {})}, tmp / f"{name}.log")


def pair(model: Path, tmp: Path, backend: str, tag: str):
    bootstrap = free_port()
    prefill = Server(
        f"{tag}-prefill",
        model,
        tmp,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        backend,
        "--disaggregation-bootstrap-port",
        str(bootstrap),
        "--disable-overlap-schedule",
    )
    decode = Server(
        f"{tag}-decode",
        model,
        tmp,
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        backend,
        "--disaggregation-decode-retraction-backup",
        "cpu_tensor",
    )
    return prefill, decode, bootstrap


def generate(url: str, ids: list[int], timeout_s: float = 120, **extra: Any) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}, **extra}
    return httpx.post(url + "/generate", json=body, timeout=timeout_s)


def disaggregated(
    prefill: Server, decode: Server, bootstrap: int, ids: list[int], host: str = "127.0.0.1"
) -> tuple[httpx.Response, httpx.Response]:
    """SGLang's manual bootstrap flow: the same request to both, at once."""
    room = random.randrange(2**63)
    extra = {"bootstrap_host": host, "bootstrap_port": bootstrap, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(generate, prefill.url, ids, **extra)
        d = pool.submit(generate, decode.url, ids, **extra)
        return p.result(), d.result()


def output_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sgl-model") / "tiny-llama"
    subprocess.run(
        [sglang_python(), str(Path(__file__).parent / "tiny_model.py"), str(path)], check=True, timeout=120
    )
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sgl")


@pytest.fixture(scope="module")
def reference(model: Path, tmp: Path) -> dict[int, list[int]]:
    """A single engine's greedy outputs for every prompt, then, for the negative control,
    for each oracle prompt followed by the token the fake transfer hands over."""
    single = Server("single", model, tmp)
    handed = [ids + [fake_handoff_token(rid)] for ids, rid in zip(ORACLE_PAIR, FAKE_RIDS, strict=True)]
    try:
        single.wait_ready(time.monotonic() + 300)
        return {i: output_ids(generate(single.url, p)) for i, p in enumerate(PROMPTS + ORACLE_PAIR + handed)}
    finally:
        single.stop()


@pytest.fixture(scope="module")
def kvx_pair(model: Path, tmp: Path, reference):
    prefill, decode, bootstrap = pair(model, tmp, "kvx", "kvx")
    procs: list[Proc] = [prefill, decode]
    try:
        deadline = time.monotonic() + 300
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        yield prefill, decode, bootstrap, procs
    finally:
        for proc in procs:
            proc.stop()


def test_oracle_can_fail(reference: dict[int, list[int]]) -> None:
    n = len(PROMPTS)
    assert reference[n] != reference[n + 1]


def test_fake_transfer_fails_the_comparison(kvx_pair, reference: dict[int, list[int]]) -> None:
    """The negative control, through the same decode: SGLang's fake transfer (bootstrap
    host 2.2.2.2) moves nothing, hands over a token hashed from the request id, and
    decode goes on from it over prompt KV that nothing filled. What it decodes after that
    token must differ from what a single engine decodes after the prompt and that token:
    the comparison sees missing KV. The requests go to decode alone (the fake receiver
    never contacts prefill) and use the oracle's prompts, which no kvx test sends:
    decode may cache what it decoded from empty KV.

    SGLang's own ``mooncake_tcp`` is compared with kvx, output for output, by
    ``benchmarks/sglang_pd.py``, not here: its pair cost two engine starts, some 150 s."""
    _, decode, bootstrap, _ = kvx_pair
    after_handoff = len(PROMPTS) + len(ORACLE_PAIR)
    for j, (ids, rid) in enumerate(zip(ORACLE_PAIR, FAKE_RIDS, strict=True)):
        room = random.randrange(2**63)
        resp = generate(
            decode.url, ids, rid=rid, bootstrap_host="2.2.2.2", bootstrap_port=bootstrap, bootstrap_room=room
        )
        fake = output_ids(resp)
        assert len(fake) == MAX_NEW
        assert fake[0] == fake_handoff_token(rid), "SGLang's fake transfer changed: revisit this control"
        assert fake[1:] != reference[after_handoff + j][: MAX_NEW - 1], f"prompt {j}: the fake passed"


def test_kvx_pair_equals_single_engine(kvx_pair, reference: dict[int, list[int]]) -> None:
    prefill, decode, bootstrap, _ = kvx_pair
    for i, ids in enumerate(PROMPTS):  # a few tokens to past the chunk size
        assert output_ids(disaggregated(prefill, decode, bootstrap, ids)[1]) == reference[i], i
    for i in (1, 4):  # repeated: radix-cache hits on both sides
        assert output_ids(disaggregated(prefill, decode, bootstrap, PROMPTS[i])[1]) == reference[i], i
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # a concurrent batch
        got = list(
            pool.map(lambda ids: output_ids(disaggregated(prefill, decode, bootstrap, ids)[1]), PROMPTS)
        )
    # Batched, decode's later tokens can drift from the unbatched reference: bf16 on CPU
    # rounds differently with the batch's composition (seen: the 3-token prompt, equal for
    # 6 tokens, then different; the same with any transfer). The first tokens after the
    # prompt depend on every transferred position and must match.
    assert all(len(g) == MAX_NEW for g in got)
    assert [g[:4] for g in got] == [reference[i][:4] for i in range(len(PROMPTS))]
    assert "kvx transfer engine" in decode.log.read_text(errors="replace")
    assert " over shm " in prefill.log.read_text(errors="replace")  # prefill pushes: its agent chose


def test_kvx_over_tcp_equals_single_engine(
    kvx_pair, model: Path, tmp: Path, reference: dict[int, list[int]]
) -> None:
    """A decode whose agent is set to tcp (KVX_BACKEND) serves no same-host copies, so
    prefill pushes to it over tcp: the path between hosts, which the pair above never takes."""
    prefill, paired_decode, bootstrap, procs = kvx_pair
    # An idle SGLang engine on CPU polls without sleeping, a core each: on a small machine a
    # third engine hardly starts beside two idle ones. The paired decode sleeps meanwhile.
    paired_decode.signal(signal.SIGSTOP)
    decode = Server(
        "kvx-decode-tcp",
        model,
        tmp,
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        "kvx",
        "--disaggregation-decode-retraction-backup",
        "cpu_tensor",
        env={"KVX_BACKEND": "tcp"},
    )
    procs.append(decode)
    try:
        decode.wait_ready(time.monotonic() + 400)
        for i, ids in enumerate(PROMPTS[:3]):
            assert output_ids(disaggregated(prefill, decode, bootstrap, ids)[1]) == reference[i], i
        # The decode's agent, by name, and how prefill's agent reached it.
        agent = re.search(r"kvx transfer engine (\S+): session", decode.log.read_text(errors="replace"))
        assert agent, "the tcp decode did not start kvx's engine"
        log = prefill.log.read_text(errors="replace")
        chosen = re.findall(rf"peer {re.escape(agent[1])} epoch \S+ over (\S+) ", log)
        assert chosen and set(chosen) == {"tcp"}, f"prefill reached {agent[1]} over {chosen}"
    finally:
        decode.stop()
        paired_decode.signal(signal.SIGCONT)


def test_kvx_pair_through_sglang_router(kvx_pair, tmp: Path, reference: dict[int, list[int]]) -> None:
    prefill, decode, bootstrap, procs = kvx_pair
    port = free_port()
    router = Proc(
        "router",
        [
            sglang_python(),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bootstrap),
            "--decode",
            decode.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        sglang_env(),
        tmp / "router.log",
    )
    procs.append(router)
    url = f"http://127.0.0.1:{port}"
    # The router's start, then a first request that may fail after SGLang's 15 s
    # bootstrap timeout: the paired decode was stopped (SIGSTOP) by the tcp test
    # before this one, and SGLang's decode finds its keep-alive sessions to the
    # prefill's bootstrap server stale once it runs again. 60 s was not enough for
    # both on a slow 2-core host.
    deadline = time.monotonic() + 180
    while True:
        try:
            resp = generate(url, PROMPTS[2], timeout_s=30)
            if resp.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, router.tail()
        time.sleep(1)
    assert output_ids(resp) == reference[2]
    # One at a time: the concurrent batch is covered above, and through the router a batch's
    # later tokens can drift with the batch's composition (bf16 on CPU), not with the KV.
    got = [output_ids(generate(url, ids)) for ids in PROMPTS]
    assert got == [reference[i] for i in range(len(PROMPTS))]
    router.stop()  # with the child that leaves its process group (Proc.stop ends descendants)
    assert router.popen.poll() is not None
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_decode_that_never_sends_indices_times_out_on_prefill(kvx_pair) -> None:
    prefill, _, bootstrap, _ = kvx_pair
    start = time.monotonic()
    resp = generate(
        prefill.url,
        PROMPTS[1],
        timeout_s=120,
        bootstrap_host="127.0.0.1",
        bootstrap_port=bootstrap,
        bootstrap_room=random.randrange(2**63),
    )
    took = time.monotonic() - start
    # SGLang aborts the request when its bootstrap times out, and answers 500 with the reason.
    assert resp.status_code == 500, resp.text
    assert "Prefill bootstrap failed" in resp.text, resp.text
    assert took < 60, took


def test_prefill_killed_mid_transfer(kvx_pair, reference: dict[int, list[int]]) -> None:
    """Runs last among the kvx tests: it kills the prefill server."""
    prefill, decode, bootstrap, _ = kvx_pair
    room = random.randrange(2**63)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    prefill.signal(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(generate, decode.url, PROMPTS[4], **extra)
        pool.submit(lambda: generate(prefill.url, PROMPTS[4], timeout_s=5, **extra))
        time.sleep(2)
        killed = time.monotonic()
        prefill.signal(signal.SIGKILL)
        resp = d.result(120)
    took = time.monotonic() - killed
    # SGLang aborts the request on decode and answers 500 with the reason: the handshake
    # (prefill, frozen, may not have answered it yet) or the transfer failed.
    assert resp.status_code == 500, resp.text
    assert re.search(r"Decode (handshake|transfer) failed", resp.text), resp.text
    assert took < 30, took
    # Decode keeps serving new requests: with prefill gone, one through SGLang's fake
    # transfer (bootstrap host 2.2.2.2) runs to completion.
    resp = generate(
        decode.url,
        PROMPTS[0],
        bootstrap_host="2.2.2.2",
        bootstrap_port=bootstrap,
        bootstrap_room=random.randrange(2**63),
    )
    assert len(output_ids(resp)) == MAX_NEW
    assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
