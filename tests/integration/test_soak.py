"""The chaos soak (benchmarks/soak.py) for about a minute with a fixed seed.

Four agents in their own network namespaces READ and WRITE verified blocks
while agents are killed and restarted, stopped and resumed, their links lose
packets or are throttled, and the metadata service and etcd restart. It
must see no corrupted block, no hang, no error that is not a kvx error and
no crash, every kind of fault, and transfers done throughout.

It runs in the KVX_NATIVE=1 pass only: the faults hit processes and the
network, not the byte path, and one minute of two cores is its whole cost.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = 60
SEED = 7

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "the soak creates network namespaces and needs root (CI runs the suite as root)"
    tools = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}
    absent = sorted({package for tool, package in tools.items() if shutil.which(tool) is None})
    if shutil.which("etcd") is None and not os.path.exists("/usr/bin/etcd"):
        absent.append("etcd-server")
    if absent:
        return f"the soak needs {', '.join(absent)}: scripts/test.sh installs them (apt-get install {' '.join(absent)})"
    return None


@pytest.mark.timeout(DURATION_S + 420)
def test_chaos_soak_keeps_every_block_intact_and_never_hangs(tmp_path):
    if conftest.NATIVE == "0":
        pytest.skip(
            "the soak runs in the KVX_NATIVE=1 pass: its faults hit processes and links, not the byte path"
        )
    reason = _missing()
    if reason:
        pytest.skip(reason)
    report_path = tmp_path / "soak.json"
    args = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration-s", str(DURATION_S),
            "--seed", str(SEED), "--json-out", str(report_path), "--keep-logs", str(tmp_path / "logs")]  # fmt: skip
    soak = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        # Setup, the final drain and the clean-up are bounded too.
        stdout, stderr = soak.communicate(timeout=DURATION_S + 360)
    finally:
        if soak.poll() is None:
            soak.kill()  # its agents and services die with it (PR_SET_PDEATHSIG)
            soak.communicate(timeout=30)
    output = f"{stdout[-6000:]}\n{stderr[-4000:]}"
    assert soak.returncode == 0, output
    report = json.loads(report_path.read_text())
    assert report["corrupted_blocks"] == 0, output
    assert report["hangs"] == 0, output
    assert report["not_kvx_errors"] == [], output
    assert report["crashes"] == 0, output
    assert report["service_log_errors"] == 0 and report["agent_log_errors"] == 0, output
    # It really soaked: every kind of fault hit, and bytes moved and were checked on both sides.
    assert set(report["faults"]) == {"kill", "stop", "loss", "bandwidth", "metadata", "etcd"}, output
    assert report["reads_done"] > 100 and report["writes_done"] > 100, output
    assert report["landed_blocks_verified"] > 100, output
    if conftest.NATIVE == "1":
        assert report["data_path"] == "native", output
    # Nothing of this run is left: no namespace, no agent or etcd process.
    mark = f"kvxsoak-{soak.pid}-"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert mark not in namespaces, namespaces
    assert not [cmd for cmd in _command_lines() if mark in cmd or f'"parent": {soak.pid},' in cmd]


def _command_lines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile
            pass
    return out
