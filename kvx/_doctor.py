"""``kvx doctor``: what to run first when a transfer is slow or fails.

Each section is a list of lines, each OK, WARN or FAIL with the fix:

- ``rdma``: RDMA devices, ports (state, link layer, rate, LID), the GID kvx
  would address each port by;
- ``affinity``: which NIC ports each GPU would use, and how near they are;
- ``gpudirect``: how GPU memory would be registered with the NIC: dma-buf
  (kernel >= 5.12 and CUDA's CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) or peer
  memory (the nvidia_peermem module);
- ``memlock``: RLIMIT_MEMLOCK, which bounds the host memory a NIC may pin;
- ``libfabric``: whether kvx was built with it and the RMA providers it sees;
- ``cuda``: CuPy, torch and the devices they see (in a child process);
- ``shm``: Yama's ptrace_scope and a real process_vm_readv on a child;
- ``metadata``: with ``--metadata``, whether the service answers, and with
  ``--metadata-admin`` its version.

Every probe is bounded in time: the CUDA probe and the shm child are killed
at their deadline, network probes carry timeouts. The sysfs and procfs read
come from a root directory (``KVX_SYSFS_ROOT``, default ``/``), so tests run
the whole command against a machine built in a temporary directory. WARN: it
works, slower than it could, or a feature is off; FAIL: something kvx would
use is broken. The exit status is 1 when any line FAILs.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvx.backends.rdma import topology
from kvx.errors import ConfigError

OK, WARN, FAIL = "OK", "WARN", "FAIL"
SYSFS_ROOT_ENV = "KVX_SYSFS_ROOT"
CUDA_PROBE_TIMEOUT_S = 30.0
SHM_PROBE_TIMEOUT_S = 10.0
# Below this, registering a KV cache's host memory with a NIC fails.
MEMLOCK_MIN_BYTES = 1 << 30
DMA_BUF_KERNEL = (5, 12)
MAX_ANSWER_BYTES = 1 << 20


@dataclasses.dataclass
class Line:
    status: str
    text: str
    fix: str = ""


@dataclasses.dataclass
class Section:
    name: str
    lines: list[Line] = dataclasses.field(default_factory=list)
    table: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, status: str, text: str, fix: str = "") -> None:
        self.lines.append(Line(status, text, fix))


def _read(root: str, *parts: str) -> str:
    try:
        with open(os.path.join(root, *parts), "rb") as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except OSError:
        return ""


# --- rdma ------------------------------------------------------------------------------------


def check_rdma(root: str, env: Mapping[str, str]) -> tuple[Section, list[topology.RdmaDevice]]:
    section = Section("rdma")
    devices = topology.rdma_devices(root)
    if not devices:
        section.add(
            WARN,
            "no RDMA device (/sys/class/infiniband is empty or absent): kvx moves bytes between hosts over tcp",
            "on a host with InfiniBand or RoCE NICs: load the driver (modprobe mlx5_ib) and install "
            "rdma-core; in a container, pass /dev/infiniband (Kubernetes: an RDMA device plugin)",
        )
        return section, devices
    for device in devices:
        where = (
            f"PCI {device.place.address}, NUMA {device.place.numa_node}"
            if device.place
            else "not a PCI device"
        )
        if device.virtual_function:
            where += ", SR-IOV virtual function"
        if device.netdevs:
            where += f", netdev {','.join(device.netdevs)}"
        if not device.ports:
            section.add(
                WARN, f"{device.name} ({where}): no port in sysfs", "check the driver (dmesg | grep mlx5)"
            )
        for port in device.ports:
            section.add(*_port_line(device, port, where, root, env))
    if not any(d.active for d in devices):
        section.add(
            FAIL,
            "no RDMA port is ACTIVE: kvx cannot use rdma on this host",
            "InfiniBand: is a subnet manager running (sminfo; state INIT means none)? Ethernet: is the "
            "link up (ip link)? Check cables and switch ports (ibstat, ibv_devinfo)",
        )
    return section, devices


def _port_line(
    device: topology.RdmaDevice, port: topology.Port, where: str, root: str, env: Mapping[str, str]
) -> tuple[str, str, str]:
    head = (
        f"{device.name} port {port.number}: {port.state or '?'} {port.phys_state or '?'}, "
        f"{port.link_layer or '?'}, {port.rate or 'rate ?'} ({where})"
    )
    if not port.active:
        fix = (
            "no subnet manager has configured the port: start one (opensm) or check the fabric"
            if port.state == "INIT"
            else "check the cable, the switch port and the NIC's link type (mlxconfig LINK_TYPE_P1)"
        )
        return WARN, f"{head}: not ACTIVE, kvx does not use it", fix
    try:
        gid, why = topology.pick_gid(port, root, env)
    except ConfigError as exc:
        return FAIL, f"{head}: no GID to address it by", str(exc)
    if port.link_layer == topology.INFINIBAND:
        return OK, f"{head}, LID {port.lid:#x}, GID index {gid.index} ({why})", ""
    address = gid.address
    shown = str(address) if address is not None else gid.gid
    status = OK if "link-local" not in why else WARN
    fix = "" if status == OK else "give the netdev an IPv4 address so RoCE v2 routes beyond one L2 segment"
    return status, f"{head}, GID index {gid.index} {shown} ({why})", fix


# --- affinity --------------------------------------------------------------------------------


def check_affinity(root: str, env: Mapping[str, str], devices: list[topology.RdmaDevice]) -> Section:
    section = Section("affinity")
    found = topology.gpus(root)
    if not found:
        section.add(OK, "no NVIDIA GPU in /sys/bus/pci: no GPU to pair with a NIC")
        return section
    try:
        table = topology.affinity(root, env)
    except ConfigError as exc:
        section.add(FAIL, f"{topology.DEVICES_ENV} is wrong", str(exc))
        return section
    if not table:
        section.add(
            WARN, f"{len(found)} GPU(s) and no usable RDMA NIC: GPU memory goes between hosts over tcp"
        )
        return section
    for item in table:
        section.table.append(
            {
                "gpu": item.gpu.index,
                "pci": item.gpu.place.address,
                "numa": item.gpu.place.numa_node,
                "nics": [str(e) for e in item.endpoints],
                "level": item.level,
                "reason": item.reason,
            }
        )
        nics = ", ".join(str(e) for e in item.endpoints)
        if item.level in ("pinned", "pcie-switch", "root-complex"):
            section.add(OK, f"GPU {item.gpu.index} -> {nics} ({item.level}: {item.reason})")
        else:
            section.add(
                WARN,
                f"GPU {item.gpu.index} -> {nics} ({item.level}: {item.reason}): GPUDirect reads cross the CPU",
                f"put a NIC behind the GPU's PCIe switch, or pin the NICs with {topology.DEVICES_ENV}",
            )
    shared: dict[str, list[int]] = {}
    for item in table:
        for endpoint in item.endpoints:
            shared.setdefault(str(endpoint), []).append(item.gpu.index)
    for name, users in shared.items():
        if len(users) > 1 and table[0].level != "pinned":
            section.add(OK, f"{name} is shared by GPUs {', '.join(map(str, users))}")
    return section


# --- gpudirect -------------------------------------------------------------------------------


def kernel_release(root: str) -> str:
    return _read(root, "proc", "sys", "kernel", "osrelease") or (os.uname().release if root == "/" else "")


def _version(release: str) -> tuple[int, int] | None:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "0")
    except (IndexError, ValueError):
        return None


def check_gpudirect(root: str, cuda: dict[str, Any], has_gpu: bool, has_rdma: bool) -> Section:
    section = Section("gpudirect")
    release = kernel_release(root)
    version = _version(release)
    kernel_ok = version is not None and version >= DMA_BUF_KERNEL
    peermem = next(
        (
            m
            for m in ("nvidia_peermem", "nv_peer_mem")
            if os.path.isdir(os.path.join(root, "sys", "module", m))
        ),
        "",
    )
    dma_buf = cuda.get("dma_buf")  # True, False, or None: CUDA did not answer
    if not has_gpu:
        section.add(OK, "no NVIDIA GPU: GPU memory registration is not needed")
        return section
    kernel_text = f"kernel {release or '?'} {'>=' if kernel_ok else '<'} 5.12"
    cuda_text = {True: "CUDA says supported", False: "CUDA says not supported", None: "CUDA did not say"}[
        dma_buf
    ]
    peer_text = f"{peermem} loaded" if peermem else "nvidia_peermem not loaded"
    facts = f"{kernel_text}, {cuda_text}, {peer_text}"
    if kernel_ok and dma_buf:
        section.add(OK, f"kvx registers GPU memory by dma-buf ({facts})")
    elif peermem:
        section.add(OK, f"kvx registers GPU memory through peer memory ({facts})")
        if kernel_ok and dma_buf is None:
            section.add(OK, "dma-buf is preferred when CUDA reports it: install kvx[gpu] (CuPy) to check")
    elif kernel_ok and dma_buf is None:
        section.add(
            WARN,
            f"dma-buf may work, unknown ({facts})",
            "install kvx[gpu] (CuPy) so kvx doctor can ask CUDA, or load nvidia_peermem (modprobe nvidia-peermem)",
        )
    else:
        status = WARN
        section.add(
            status,
            f"GPU memory cannot be registered with a NIC ({facts}): "
            + ("kvx stages it through host memory" if has_rdma else "no RDMA device anyway"),
            "dma-buf needs a kernel >= 5.12 and NVIDIA's open kernel modules (driver >= 515); "
            "or load nvidia_peermem (modprobe nvidia-peermem)",
        )
    return section


# --- memlock ---------------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


MEMLOCK_FIX = (
    "raise it where kvx starts: `ulimit -l unlimited` (needs the hard limit, or root; "
    "/etc/security/limits.conf: `* - memlock unlimited`); systemd: LimitMEMLOCK=infinity; "
    "docker: --ulimit memlock=-1; Kubernetes: the container runtime's default (LimitMEMLOCK=infinity "
    "in containerd's or CRI-O's unit) or the IPC_LOCK capability"
)


def check_memlock(has_rdma: bool, limits: tuple[int, int] | None = None) -> Section:
    section = Section("memlock")
    soft, hard = limits or resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        section.add(OK, "memlock limit (ulimit -l): unlimited")
        return section
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else _size(hard)
    text = f"memlock limit (ulimit -l): {_size(soft)} (hard {hard_text})"
    if soft >= MEMLOCK_MIN_BYTES:
        section.add(WARN, f"{text}: registering more host memory than that with a NIC fails", MEMLOCK_FIX)
    elif has_rdma:
        section.add(FAIL, f"{text}: too low to register a KV cache's host memory with a NIC", MEMLOCK_FIX)
    else:
        section.add(
            WARN, f"{text}: too low for rdma (no RDMA device here, so nothing uses it now)", MEMLOCK_FIX
        )
    return section


# --- libfabric -------------------------------------------------------------------------------


def _bounded(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()`` in a daemon thread; raises builtins.TimeoutError past ``timeout_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="kvx-doctor-probe")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def describe_providers(providers: list[Any]) -> str:
    """Each provider once, with its domains (``tcp;ofi_rxm on lo, eth0; ...``),
    from fabric.Info rows (one per domain and address family, so names repeat)."""
    domains: dict[str, list[str]] = {}
    for info in providers:
        name = str(getattr(info, "provider", info))
        domain = str(getattr(info, "domain", "") or "")
        seen = domains.setdefault(name, [])
        if domain and domain not in seen:
            seen.append(domain)
    return "; ".join(f"{name} on {', '.join(d)}" if d else name for name, d in domains.items())


def check_libfabric(timeout_s: float = 10.0) -> Section:
    section = Section("libfabric")
    try:
        fabric = importlib.import_module("kvx.backends.rdma.fabric")
    except ImportError as exc:
        section.add(
            WARN,
            f"kvx was built without libfabric ({exc}): no rdma through libfabric (EFA, its tcp provider)",
            "install libfabric's headers (Debian: libfabric-dev) and rebuild kvx (pip install kvx[rdma])",
        )
        return section
    lister = getattr(fabric, "providers", None) or getattr(fabric, "rma_providers", None)
    if not callable(lister):
        section.add(OK, "kvx was built with libfabric (this build cannot list its providers)")
        return section
    try:
        providers = list(_bounded(lister, timeout_s))[:64]
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        section.add(
            WARN, f"libfabric did not list its providers: {exc}", "check FI_PROVIDER and fi_info -c FI_RMA"
        )
        return section
    if providers:
        section.add(OK, f"libfabric RMA providers: {describe_providers(providers)}")
    else:
        section.add(WARN, "libfabric sees no RMA provider", "check FI_PROVIDER and `fi_info -c FI_RMA`")
    return section


# --- cuda ------------------------------------------------------------------------------------

# Run in a child: importing CuPy or torch, or initialising CUDA, can take long or hang on a
# broken driver; the child is killed at the deadline.
_CUDA_PROBE = r"""
import ctypes, json
out = {}
try:
    import cupy
    out["cupy"] = cupy.__version__
    try:
        out["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        out["cupy_error"] = str(exc)[:300]
except Exception as exc:
    out["cupy_missing"] = str(exc)[:300]
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as exc:
    out["torch_missing"] = str(exc)[:300]
try:
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) == 0:
        count = ctypes.c_int(0)
        cuda.cuDeviceGetCount(ctypes.byref(count))
        flags = []
        for i in range(count.value):
            dev, value = ctypes.c_int(0), ctypes.c_int(0)
            cuda.cuDeviceGet(ctypes.byref(dev), i)
            # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
            if cuda.cuDeviceGetAttribute(ctypes.byref(value), 124, dev) == 0:
                flags.append(bool(value.value))
        out["driver_devices"] = count.value
        out["dma_buf"] = all(flags) if flags else None
    else:
        out["driver_error"] = "cuInit failed"
except OSError as exc:
    out["driver_missing"] = str(exc)[:300]
print(json.dumps(out))
"""


def probe_cuda(timeout_s: float = CUDA_PROBE_TIMEOUT_S) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CUDA_PROBE],
            capture_output=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": timeout_s}
    try:
        answer = json.loads(done.stdout[-MAX_ANSWER_BYTES:].decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {
            "error": done.stderr[-300:].decode(errors="replace").strip() or f"exit status {done.returncode}"
        }
    return answer if isinstance(answer, dict) else {"error": "the probe printed no object"}


def check_cuda(cuda: dict[str, Any], sysfs_gpus: int) -> Section:
    section = Section("cuda")
    if "timeout" in cuda:
        section.add(
            FAIL, f"initialising CUDA took longer than {cuda['timeout']:g} s", "check nvidia-smi and dmesg"
        )
        return section
    if "error" in cuda:
        section.add(WARN, f"the CUDA probe failed: {cuda['error']}")
    if "cupy" in cuda:
        devices = cuda.get("cupy_devices")
        text = f"CuPy {cuda['cupy']}: " + (
            f"{devices} device(s)" if devices is not None else cuda.get("cupy_error", "?")
        )
        section.add(OK if devices else WARN, text)
    else:
        section.add(
            OK if not sysfs_gpus else WARN,
            "CuPy not installed",
            "GPU memory needs it: pip install 'kvx[gpu]'",
        )
    if "torch" in cuda:
        section.add(OK, f"torch {cuda['torch']}: {cuda.get('torch_devices', 0)} CUDA device(s)")
    seen = max(int(cuda.get(k) or 0) for k in ("cupy_devices", "torch_devices", "driver_devices"))
    if sysfs_gpus and not seen:
        section.add(
            FAIL,
            f"{sysfs_gpus} NVIDIA GPU(s) on the PCI bus, none visible to CUDA",
            "check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and, in a container, the NVIDIA runtime",
        )
    elif not seen:
        section.add(
            WARN,
            "no CUDA device: kvx moves host memory only",
            "for GPU memory: an NVIDIA GPU, its driver and pip install 'kvx[gpu]'",
        )
    else:
        section.add(OK, f"{seen} CUDA device(s) visible")
    return section


# --- shm -------------------------------------------------------------------------------------

_SHM_CHILD = (
    "import ctypes, sys\n"
    "b = ctypes.create_string_buffer(b'kvx-doctor-probe', 16)\n"
    "print(ctypes.addressof(b), flush=True)\n"
    "sys.stdin.read()\n"
)


def probe_cma(timeout_s: float = SHM_PROBE_TIMEOUT_S) -> str | None:
    """None when process_vm_readv on a child works; else why not."""
    import numpy as np

    from kvx._datapath import io as _io
    from kvx.backends.shm import explain

    child = subprocess.Popen(
        [sys.executable, "-c", _SHM_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], timeout_s)
        if not ready:
            return f"the probe child did not start within {timeout_s:g} s"
        line = child.stdout.readline(64)
        try:
            address = int(line)
        except ValueError:
            return "the probe child printed no address"
        local = np.zeros(16, dtype=np.uint8)
        try:
            _io.vm_readv(
                child.pid,
                np.array([local.ctypes.data], np.uint64),
                np.array([16], np.uint64),
                np.array([address], np.uint64),
                np.array([16], np.uint64),
            )
        except OSError as exc:
            return explain(exc, child.pid)
        if local.tobytes() != b"kvx-doctor-probe":
            return "process_vm_readv read other bytes than the child holds"
        return None
    finally:
        child.kill()
        child.wait(timeout=timeout_s)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


def check_shm(root: str, cma: Callable[[], str | None] = probe_cma) -> Section:
    section = Section("shm")
    scope_text = _read(root, "proc", "sys", "kernel", "yama", "ptrace_scope")
    scope = int(scope_text) if scope_text.isdigit() else None
    if scope is None:
        section.add(OK, "no Yama LSM (kernel.yama.ptrace_scope absent): same-user agents may attach")
    elif scope == 0:
        section.add(OK, "kernel.yama.ptrace_scope is 0: same-user agents may attach (process_vm_readv)")
    else:
        allows = {1: "only to descendants", 2: "only with CAP_SYS_PTRACE"}.get(scope, "never")
        section.add(
            WARN,
            f"kernel.yama.ptrace_scope is {scope}: cross-memory attach is allowed {allows}; agents on this "
            "host use shared segments where offered, else tcp",
            "sysctl kernel.yama.ptrace_scope=0, or give the agents CAP_SYS_PTRACE (docker: --cap-add SYS_PTRACE)"
            if scope < 3
            else "ptrace_scope 3 cannot be lowered without a reboot",
        )
    try:
        problem = cma()
    except OSError as exc:
        problem = f"the probe could not run: {exc}"
    if problem is None:
        section.add(OK, "process_vm_readv on a child process works")
    else:
        section.add(WARN, f"process_vm_readv on a child process failed: {problem}")
    return section


# --- metadata --------------------------------------------------------------------------------


def check_metadata(target: str, token: str | None, admin: str | None, timeout_s: float) -> Section:
    section = Section("metadata")
    import grpc

    from kvx.metadata.client import MetadataClient, MetadataOptions, translate
    from kvx.v1 import metadata_pb2

    client = MetadataClient(target, MetadataOptions(token=token, timeout_s=timeout_s))
    try:
        start = time.monotonic()
        response = client.stub.ListAgents(
            metadata_pb2.ListAgentsRequest(page_size=1), timeout=timeout_s, metadata=client.call_metadata
        )
        took_ms = (time.monotonic() - start) * 1000
        more = "+" if response.next_page_token else ""
        section.add(OK, f"{target} answers ({took_ms:.0f} ms; {len(response.records)}{more} agent(s) listed)")
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            fix = "pass the service's token: --metadata-token-file FILE"
        else:
            fix = "check the address, that kvx metadata runs there, and firewalls"
        section.add(FAIL, str(translate(exc, target)), fix)
    finally:
        client.close()
    if admin:
        section.add(*_admin_version(admin, timeout_s))
    return section


def _admin_version(url: str, timeout_s: float) -> tuple[str, str, str]:
    import urllib.request

    from kvx import __version__
    from kvx._status import check_admin_url

    try:
        base = check_admin_url(url, "--metadata-admin")
    except ConfigError as exc:
        return FAIL, str(exc), "give the admin API's URL, e.g. http://HOST:8081"
    # No proxy from the environment: the admin API is inside the cluster.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{base}/openapi.json", timeout=timeout_s) as answer:
            document = json.loads(answer.read(MAX_ANSWER_BYTES))
        version = str(document.get("info", {}).get("version", "?"))[:64]
    except (OSError, ValueError, AttributeError) as exc:
        return (
            FAIL,
            f"the admin API at {base} did not answer: {exc}",
            "check --metadata-admin and --admin-listen",
        )
    if version != __version__:
        return WARN, f"the metadata service runs kvx {version}, this is kvx {__version__}", "upgrade one side"
    return OK, f"the metadata service runs kvx {version}, as this kvx", ""


# --- the whole report ------------------------------------------------------------------------


def collect(
    root: str = "/",
    env: Mapping[str, str] | None = None,
    *,
    metadata: str | None = None,
    metadata_token: str | None = None,
    metadata_admin: str | None = None,
    timeout_s: float = 5.0,
    cuda: Callable[[], dict[str, Any]] = probe_cuda,
    cma: Callable[[], str | None] = probe_cma,
    memlock: tuple[int, int] | None = None,
) -> dict[str, Any]:
    env = os.environ if env is None else env
    rdma, devices = check_rdma(root, env)
    sysfs_gpus = len(topology.gpus(root))
    cuda_answer = cuda()
    sections = [
        rdma,
        check_affinity(root, env, devices),
        check_gpudirect(root, cuda_answer, sysfs_gpus > 0, bool(devices)),
        check_memlock(bool(devices), memlock),
        check_libfabric(timeout_s),
        check_cuda(cuda_answer, sysfs_gpus),
        check_shm(root, cma),
    ]
    if metadata:
        sections.append(check_metadata(metadata, metadata_token, metadata_admin, timeout_s))
    ok = not any(line.status == FAIL for s in sections for line in s.lines)
    return {
        "ok": ok,
        "sysfs_root": root,
        "sections": [
            {"name": s.name, "lines": [dataclasses.asdict(line) for line in s.lines], "table": s.table}
            for s in sections
        ],
    }


def render(report: dict[str, Any]) -> str:
    from kvx._status import show

    out: list[str] = []
    for section in report["sections"]:
        out.append(f"{section['name']}:")
        for line in section["lines"]:
            out.append(f"  {line['status']:<4}  {show(line['text'], 400)}")
            if line["fix"] and line["status"] != OK:
                out.append(f"        fix: {show(line['fix'], 600)}")
        if section["table"]:
            from kvx._status import render_table

            rows = [
                [str(r["gpu"]), r["pci"], str(r["numa"]), ",".join(r["nics"]), r["level"]]
                for r in section["table"]
            ]
            table = render_table(["GPU", "PCI", "NUMA", "NICs", "distance"], rows)
            out.extend("    " + row for row in table.splitlines())
    failed = sum(line["status"] == FAIL for s in report["sections"] for line in s["lines"])
    warned = sum(line["status"] == WARN for s in report["sections"] for line in s["lines"])
    out.append(f"{failed} FAIL, {warned} WARN" + ("" if failed else ": nothing kvx would use is broken"))
    return "\n".join(out)


def sysfs_root(option: str | None, env: Mapping[str, str]) -> str:
    root = option or env.get(SYSFS_ROOT_ENV) or "/"
    if not os.path.isdir(root):
        raise ConfigError(f"the sysfs root {root!r} is not a directory")
    return root
