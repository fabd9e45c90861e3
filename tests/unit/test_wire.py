import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvx.backends.control import wire as _wire
from kvx.backends.control.link import plan_cuts
from kvx.descs import Descs

ROOT = Path(__file__).resolve().parents[2]


def test_header_is_32_bytes_and_round_trips():
    raw = _wire.pack(_wire.MsgType.WRITE_REQ, 7, 48, 5, 1 << 40)
    assert len(raw) == 32
    assert _wire.unpack(raw) == (b"KVXF", _wire.PROTOCOL_VERSION, 8, 7, 48, 5, 1 << 40)


def test_proofs_depend_on_role_secret_and_transcript():
    args = (b"n1" * 16, b"n2" * 16, "a", "b", 1, 2)
    t = _wire.target_proof(b"s" * 16, *args)
    i = _wire.initiator_proof(b"s" * 16, *args)
    assert t != i  # a reflected proof is useless
    assert t != _wire.target_proof(b"x" * 16, *args)
    assert t != _wire.target_proof(b"s" * 16, *args[:-1], 3)


@pytest.mark.parametrize("seed", range(20))
def test_plan_cuts_respect_limits_and_cover_everything(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    lengths = rng.integers(1, 5000, n)
    remote = Descs.build(1, np.cumsum(lengths) * 2, lengths).array
    total = int(lengths.sum())
    max_bytes = int(rng.integers(100, 20000))
    max_descs = int(rng.integers(1, 50))
    cuts = plan_cuts(remote, total, max_bytes, max_descs, int(rng.integers(1, 5)))
    assert cuts[0] == 0 and cuts[-1] == total and np.all(np.diff(cuts) > 0)
    assert np.diff(cuts).max() <= max_bytes
    cut, idx = Descs(remote).split_at(cuts)
    assert np.diff(idx).max() <= max_descs
    assert cut.total_bytes == total


def test_generated_protobuf_code_is_not_edited(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "proto"),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        check=True,
    )
    services = [p for p in protos if "\nservice " in (ROOT / "proto" / p).read_text()]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "proto"),
            f"--grpc_python_out={tmp_path}",
            *services,
        ],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    checked_in = sorted(p.relative_to(ROOT) for p in (ROOT / "kvx" / "v1").glob("*_pb2*.py*"))
    assert generated == checked_in, "generated files and checked-in files differ in name"
    assert generated, "protoc generated nothing"
    for rel in generated:
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), (
            f"{rel} differs from proto/: run scripts/gen_proto.sh"
        )
