"""kvx doctor against machines built in a directory (tests/unit/sysfs_trees.py:
a DGX H100, a RoCE host, a host with no RDMA device) and, as a command, on
this machine, which has no RDMA device and no GPU."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
import types

import pytest

from kvx import _doctor
from kvx._datapath import gpu
from tests.conftest import native_pass_only
from tests.unit import sysfs_trees

# Its one call into the byte path, the CMA probe, is tested on both twins by test_cma.py:
# it runs in the KVX_NATIVE=1 pass only.
pytestmark = native_pass_only

UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
CUDA_H100 = {"cupy": "13.3.0", "cupy_devices": 8, "driver_devices": 8, "dma_buf": True}
CUDA_NONE: dict = {"cupy_missing": "No module named 'cupy'"}


def _report(root, env=None, **kw):
    kw.setdefault("cuda", lambda: CUDA_H100)
    kw.setdefault("cma", lambda: None)
    kw.setdefault("memlock", UNLIMITED)
    return _doctor.collect(str(root), env or {}, **kw)


def _lines(report, section):
    (found,) = [s for s in report["sections"] if s["name"] == section]
    return [(line["status"], line["text"], line["fix"]) for line in found["lines"]]


def _statuses(report, section):
    return [status for status, _, _ in _lines(report, section)]


@pytest.fixture
def dgx(tmp_path):
    tree = sysfs_trees.dgx_h100(tmp_path)
    tree.kernel("5.15.0-1042-nvidia")
    return tmp_path


def test_a_healthy_dgx_h100(dgx):
    report = _report(dgx)
    assert report["ok"] is True
    rdma = _lines(report, "rdma")
    assert len(rdma) == 12  # 8 compute + 4 storage functions, one port each
    assert any(
        "mlx5_0 port 1: ACTIVE LinkUp, InfiniBand, 400 Gb/sec (4X NDR) (PCI 0000:18:00.0, NUMA 0" in text
        and "LID 0x1, GID index 0" in text
        for _, text, _ in rdma
    )
    # The storage ports (Ethernet, link-local only): a WARN with the fix, not a FAIL.
    storage = [line for line in rdma if line[1].startswith("mlx5_7")]
    assert storage[0][0] == "WARN" and "IPv4 address" in storage[0][2]
    (affinity,) = [s for s in report["sections"] if s["name"] == "affinity"]
    assert [(r["gpu"], r["nics"], r["level"]) for r in affinity["table"]] == [
        (i, [f"{name}:1"], "pcie-switch") for i, (name, *_x) in enumerate(sysfs_trees.DGX_H100_RAILS)
    ]
    assert _lines(report, "gpudirect")[0][:2] == (
        "OK",
        "kvx registers GPU memory by dma-buf (kernel 5.15.0-1042-nvidia >= 5.12, CUDA says supported, "
        "nvidia_peermem not loaded)",
    )
    text = _doctor.render(report)
    assert "0 FAIL" in text and "GPU  PCI           NUMA  NICs       distance" in text


def test_no_active_port_and_low_memlock_fail_with_the_fix(dgx):
    tree = sysfs_trees.SysfsTree(dgx)
    for name in [r[0] for r in sysfs_trees.DGX_H100_RAILS] + sysfs_trees.DGX_H100_STORAGE:
        tree.set_port_state(name, 1, "2: INIT", "5: LinkUp")
    report = _report(dgx, memlock=(8 << 20, 8 << 20))
    assert report["ok"] is False
    rdma = _lines(report, "rdma")
    assert rdma[-1][0] == "FAIL" and "no RDMA port is ACTIVE" in rdma[-1][1]
    assert "opensm" in rdma[0][2]  # INIT: no subnet manager
    (memlock,) = _lines(report, "memlock")
    assert memlock[0] == "FAIL" and "8 MiB" in memlock[1]
    assert "ulimit -l unlimited" in memlock[2] and "LimitMEMLOCK=infinity" in memlock[2]
    assert "--ulimit memlock=-1" in memlock[2] and "IPC_LOCK" in memlock[2]


def test_bad_pinning_and_gid_index_fail(dgx):
    report = _report(dgx, env={"KVX_RDMA_DEVICES": "mlx5_42", "KVX_RDMA_GID_INDEX": "7"})
    assert report["ok"] is False
    ((status, text, fix),) = _lines(report, "affinity")
    assert status == "FAIL" and "KVX_RDMA_DEVICES" in text and "these exist: mlx5_0" in fix
    assert _statuses(report, "rdma")[0] == "FAIL"
    assert "KVX_RDMA_GID_INDEX=7" in _lines(report, "rdma")[0][2]


def test_roce_host_shows_the_gid_kvx_picks(tmp_path):
    sysfs_trees.roce_host(tmp_path)
    report = _report(tmp_path, memlock=(2 << 30, resource.RLIM_INFINITY))
    rdma = _lines(report, "rdma")
    assert rdma[0][0] == "OK"
    assert "GID index 3 ::ffff:c0a8:10a (RoCE v2, IPv4-mapped, netdev ens1f0np0 up)" in rdma[0][1]
    assert rdma[1][0] == "WARN" and "link-local" in rdma[1][1]
    (memlock,) = _lines(report, "memlock")
    assert memlock[0] == "WARN" and "2 GiB (hard unlimited)" in memlock[1]
    # No GPU on this host: nothing to pair, no registration needed.
    assert _statuses(report, "affinity") == ["OK"] and _statuses(report, "gpudirect") == ["OK"]


def test_gpudirect_choice(dgx):
    tree = sysfs_trees.SysfsTree(dgx)
    tree.kernel("5.4.0-150-generic")
    report = _report(dgx, cuda=lambda: {**CUDA_H100, "dma_buf": False})
    ((status, text, fix),) = _lines(report, "gpudirect")
    assert status == "WARN" and "cannot be registered" in text and "kvx stages it through host memory" in text
    assert "modprobe nvidia-peermem" in fix
    tree.module("nvidia_peermem")
    ((status, text, _),) = _lines(_report(dgx, cuda=lambda: {**CUDA_H100, "dma_buf": False}), "gpudirect")
    assert status == "OK" and "peer memory" in text and "kernel 5.4.0-150-generic < 5.12" in text


def test_gpus_on_the_bus_that_cuda_does_not_see_fail(dgx):
    report = _report(dgx, cuda=lambda: CUDA_NONE)
    assert report["ok"] is False
    status, text, fix = _lines(report, "cuda")[-1]
    assert status == "FAIL" and "8 NVIDIA GPU(s) on the PCI bus, none visible to CUDA" in text
    assert "CUDA_VISIBLE_DEVICES" in fix


def test_shm_section_reports_ptrace_scope_and_the_probe(tmp_path):
    sysfs_trees.no_rdma(tmp_path)
    scope = tmp_path / "proc" / "sys" / "kernel" / "yama" / "ptrace_scope"
    scope.parent.mkdir(parents=True)
    scope.write_text("1\n")
    report = _report(tmp_path, cma=lambda: "cross-memory attach to pid 7 is not permitted (EPERM): ...")
    (first, second) = _lines(report, "shm")
    assert first[0] == "WARN" and "ptrace_scope is 1" in first[1] and "ptrace_scope=0" in first[2]
    assert second[0] == "WARN" and "EPERM" in second[1]


def test_the_real_cma_probe_reads_a_child():
    assert _doctor.probe_cma() is None


def test_an_unreachable_metadata_service_fails_within_the_bound(tmp_path):
    sysfs_trees.no_rdma(tmp_path)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    report = _report(tmp_path, metadata=f"127.0.0.1:{port}", timeout_s=2.0)
    # TEST-NET-1: packets go nowhere; the probe must stop at its timeout.
    report2 = _report(tmp_path, metadata="192.0.2.1:50051", timeout_s=2.0)
    assert time.monotonic() - start < 30
    for r in (report, report2):
        assert r["ok"] is False
        ((status, text, fix),) = _lines(r, "metadata")
        assert status == "FAIL" and "unavailable" in text and "kvx metadata runs there" in fix


def _kvx(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvx", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_the_command_on_this_machine_says_there_is_no_rdma_and_no_gpu():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has an RDMA device")
    done = _kvx()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARN  no RDMA device" in done.stdout and "kvx moves bytes between hosts over tcp" in done.stdout
    if gpu.available():  # a GPU machine (scripts/gpu_check.sh)
        assert "CUDA device(s) visible" in done.stdout
    else:
        assert "no NVIDIA GPU" in done.stdout
    assert "0 FAIL" in done.stdout
    report = json.loads(_kvx("--json").stdout)
    assert report["ok"] is True and report["sysfs_root"] == "/"
    assert [s["name"] for s in report["sections"]] == [
        "rdma",
        "affinity",
        "gpudirect",
        "memlock",
        "libfabric",
        "cuda",
        "shm",
    ]


def test_the_command_on_a_built_dgx_exits_1_when_cuda_sees_no_gpu(dgx):
    if gpu.available():
        pytest.skip("CUDA sees a device here; this runs where it sees none (CI, any CPU machine)")
    done = _kvx("--json", env={"KVX_SYSFS_ROOT": str(dgx)})
    report = json.loads(done.stdout)
    (affinity,) = [s for s in report["sections"] if s["name"] == "affinity"]
    assert len(affinity["table"]) == 8
    # The machine running the test has no CUDA device for the 8 GPUs in the tree.
    assert done.returncode == 1 and report["ok"] is False


def test_bad_arguments_exit_2(tmp_path):
    assert _kvx("--timeout-s", "-1").returncode == 2
    done = _kvx("--sysfs-root", str(tmp_path / "absent"))
    assert done.returncode == 2 and "is not a directory" in done.stderr
    assert _kvx("--metadata-admin", "http://127.0.0.1:1").returncode == 2


def test_the_admin_api_version_is_compared_with_this_kvx():
    import http.server
    import threading

    from kvx import __version__

    versions = iter([__version__, "0.0.1"])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            body = json.dumps({"info": {"version": next(versions)}}).encode()
            self.send_response(200 if self.path == "/openapi.json" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert _doctor._admin_version(url, 5.0)[0] == "OK"
        status, text, _ = _doctor._admin_version(url, 5.0)
        assert status == "WARN" and "runs kvx 0.0.1" in text
        assert _doctor._admin_version("file:///etc/passwd", 5.0)[0] == "FAIL"
    finally:
        server.shutdown()
        server.server_close()


def test_libfabric_providers_are_named_once_with_their_domains():
    rows = [
        types.SimpleNamespace(provider="tcp;ofi_rxm", domain="eth0"),
        types.SimpleNamespace(provider="tcp;ofi_rxm", domain="eth0"),  # another address family
        types.SimpleNamespace(provider="tcp;ofi_rxm", domain="lo"),
        types.SimpleNamespace(provider="efa", domain="rdmap16s27-rdm"),
    ]
    assert _doctor.describe_providers(rows) == "tcp;ofi_rxm on eth0, lo; efa on rdmap16s27-rdm"
