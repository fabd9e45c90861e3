"""Each fuzz target for a short, seeded budget (atheris, in a subprocess),
on the data path KVX_NATIVE selects; and the handshake target over the
agent's real listener on loopback.

KVX_FUZZ_RUNS=N runs N inputs per target instead of the CI budget;
KVX_FUZZ_SEED picks libFuzzer's seed (default 1). Without atheris the same
targets run on hypothesis-generated inputs (derandomized).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvx
from kvx.backends.control import wire as _wire
from kvx.backends.control.wire import MsgType
from tests.conftest import native_pass_only
from tests.fuzz import targets


@pytest.fixture(autouse=True, scope="module")
def _kvx_logging_restored():
    """The in-process target quiets kvx's logger (the refusals it provokes
    are warnings); the tests that run after these must see it as it was."""
    log = logging.getLogger("kvx")
    saved = log.level, log.propagate, list(log.handlers)
    yield
    if targets._TARGET is not None:
        targets._TARGET.close()
        targets._TARGET = None
    log.setLevel(saved[0])
    log.propagate = saved[1]
    log.handlers[:] = saved[2]


ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("KVX_FUZZ_SEED", "1"))
# Inputs per target in CI: together well under a minute on two cores.
CI_RUNS = {"header": 20000, "descs": 20000, "protobuf": 20000, "handshake": 3000}
# Paths each run must have taken at least once: a harness that stopped reaching
# them would pass while testing nothing.
REACHED = {
    "header": ["header.ok", "header.bad_magic", "header.bad_version"],
    "descs": ["descs.good", "descs.bad"],
    "protobuf": ["protobuf.Hello.decoded", "protobuf.Hello.refused", "protobuf.Auth.decoded"],
    "handshake": [
        "handshake.raw",
        "handshake.hello_refused",
        "handshake.auth_refused",
        "handshake.authenticated",
        "handshake.read_served",
        "handshake.write_served",
        "handshake.request_refused",
    ],
}
HAVE_ATHERIS = importlib.util.find_spec("atheris") is not None


def runs_for(name: str) -> int:
    return int(os.environ.get("KVX_FUZZ_RUNS", "0")) or CI_RUNS[name]


def fuzz(name: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    """Runs the target under atheris; fails with the reproducer on a finding."""
    runs = runs_for(name)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "tests.fuzz.runner",
        name,
        f"-runs={runs}",
        f"-seed={SEED}",
        "-timeout=60",  # seconds per input: a hang is a finding
        "-rss_limit_mb=4096",
        f"-artifact_prefix={tmp_path}/",
        str(corpus),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600 + runs // 10,
    )
    found = sorted(p for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    tail = "\n".join(line for line in proc.stderr.splitlines() if "Instrumenting" not in line)[-6000:]
    assert proc.returncode == 0 and not found, (
        f"fuzz target {name!r} found a problem; reproduce with\n"
        f"  python -m tests.fuzz.runner {name} {found[0] if found else ''}\n{tail}"
    )
    stats = [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stderr.splitlines()
        if line.startswith("kvx-fuzz-stats ")
    ]
    assert stats and stats[-1]["inputs"] == runs, tail
    return stats[-1]["paths"]


def hypothesis_fuzz(name: str) -> dict:
    """The fallback without atheris: the same target on derandomized inputs."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    targets.STATS.clear()
    fn = targets.TARGETS[name]

    @settings(
        max_examples=min(runs_for(name), 2000),
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(st.sampled_from(targets.seeds(name)), st.binary(max_size=targets.MAX_LEN)))
    def check(data: bytes) -> None:
        fn(data)

    check()
    return dict(targets.STATS)


# The protobuf target decodes messages alone: no byte path, so one pass is enough.
@pytest.mark.parametrize(
    "name", ["header", "descs", pytest.param("protobuf", marks=native_pass_only), "handshake"]
)
def test_fuzz_target(name, tmp_path):
    paths = fuzz(name, tmp_path) if HAVE_ATHERIS else hypothesis_fuzz(name)
    if HAVE_ATHERIS or name != "handshake":  # random bytes rarely pass the handshake
        missing = [p for p in REACHED[name] if not paths.get(p)]
        assert not missing, f"the {name} target never reached {missing}: {paths}"


@native_pass_only
@pytest.mark.skipif(not HAVE_ATHERIS, reason="atheris is not installed (the test extra has it)")
def test_fuzz_protobuf_pure_python_decoder(tmp_path):
    """The handshake messages through protobuf's pure-Python decoder, which a
    machine without the upb extension uses."""
    paths = fuzz("protobuf", tmp_path, {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"})
    assert paths.get("protobuf.Hello.decoded") and paths.get("protobuf.Hello.refused_utf8"), paths


def _mutations(count: int) -> list[bytes]:
    """Seeded mutations of the handshake target's seeds: flipped, cut and grown."""
    rng = random.Random(SEED)
    out = list(targets.seeds("handshake"))
    while len(out) < count:
        data = bytearray(rng.choice(out[:4]))
        for _ in range(rng.randint(1, 8)):
            op = rng.randrange(3)
            if op == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1:
                data[rng.randrange(len(data) + 1) :] = b""
            else:
                data += rng.randbytes(rng.randint(1, 64))
        out.append(bytes(data))
    return out


def test_handshake_over_loopback_then_a_real_peer_reads():
    """Fuzzed handshakes and request streams through the agent's real
    listener (accept, connection accounting, the serving threads); then a
    real kvx peer connects and reads the right bytes."""
    t = targets.target()
    for data in _mutations(120):
        targets.handshake(data, loopback=True)
    t.legitimate_read()
    for backend in ("tcp", "auto"):
        with kvx.Agent(f"fuzz-reader-{backend}", auth_secret=targets.SECRET, backend=backend) as reader:
            buf = np.zeros(256, np.uint8)
            local = reader.register(buf)
            peer = reader.add_peer(t.agent.metadata())
            peer.read(local.descs(0, 256), peer.region(t.rw.id).descs(100, 256)).wait(30)
            want = t.pool[targets.GUARD_BYTES + 100 : targets.GUARD_BYTES + 356]
            assert np.array_equal(buf, want), f"a real peer ({peer.backend}) read other bytes"
    t.check_intact(True)


def test_a_malformed_hello_reply_is_a_kvx_error_and_leaks_no_socket():
    """The initiator's side: a listener that answers HELLO with bytes that are
    not a HelloReply must give a kvx error (and close the socket), not
    protobuf's DecodeError."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    victim = kvx.Agent("fuzz-initiator")

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            head = conn.recv(32, socket.MSG_WAITALL)
            conn.recv(_wire.unpack(head)[4], socket.MSG_WAITALL)
            bad = b"\x0a\x04a\x10\xfe\xe4\x02\x00\x00\x00"  # name "a\x10\xfe..": truncated, invalid
            conn.sendall(_wire.pack(MsgType.HELLO_REPLY, payload_len=len(bad)) + bad)
            conn.recv(1)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        imposter = kvx.Agent("fuzz-imposter")
        metadata = imposter.metadata_message()
        metadata.endpoints[0].address = f"127.0.0.1:{port}"
        imposter.close()
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(kvx.KvxError):
            victim.add_peer(metadata.SerializeToString())
        thread.join(10)
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        victim.close()
        server.close()
