"""Which RDMA NIC each GPU uses, read from sysfs.

Pure Python, no dependency: every function takes the root of the file system
it reads (``"/"`` on a host; a directory tree in tests), so a whole machine's
topology can be built in a temporary directory with real symlinks.

What is read:

- RDMA devices: ``/sys/class/infiniband/<dev>``, whose ``device`` link
  resolves to the PCI function under ``/sys/devices/pci<domain>:<bus>/...``;
  ``device/numa_node``; ``device/net/*`` (the netdevs); and per port
  ``ports/<n>/{state,phys_state,link_layer,rate,lid}`` and the GID table
  ``ports/<n>/gids/<i>`` with ``gid_attrs/types/<i>`` and
  ``gid_attrs/ndevs/<i>``.
- GPUs: ``/sys/bus/pci/devices/*`` of vendor 0x10de and class 0x0302xx (3D
  controller: H100, A100) or 0x0300xx (VGA), in PCI bus order, which is
  CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. NVSwitches (class
  0x0680) are not GPUs.

How a GPU picks its NICs (``affinity``): among the usable NICs (PCI physical
functions with an ACTIVE port; all of them if none is active), the nearest by

1. ``pcie-switch``: GPU and NIC share a bridge below the root port, that is
   the same PCIe switch (``nvidia-smi topo -m``: PIX or PXB); a deeper shared
   bridge is nearer;
2. ``root-complex``: the same ``pci<domain>:<bus>`` root (PHB);
3. ``numa``: the same NUMA node (NODE);
4. ``system``: any other (SYS).

A GPU uses every NIC behind its own PCIe switch (usually one: its rail).
Farther than that it uses one NIC, and GPUs that tie (the same nearest set)
take those NICs in turn, in rail order, so that two GPUs of one NUMA node
with two NICs there use one each. The rail of a GPU is its index in PCI bus
order; peers pair NICs by rail (``peer_rail``).

``KVX_RDMA_DEVICES`` (``mlx5_0,mlx5_3`` or ``mlx5_0:1``) overrides the
choice: every GPU then uses exactly those ports, in that order.
``KVX_RDMA_GID_INDEX`` overrides the RoCE GID index ``pick_gid`` finds.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence

from kvx.errors import ConfigError

DEVICES_ENV = "KVX_RDMA_DEVICES"
GID_INDEX_ENV = "KVX_RDMA_GID_INDEX"

# Bounds on what is read: a host has tens of RDMA devices (SR-IOV functions
# included) and a RoCE port at most a few hundred GIDs (mlx5: 255).
MAX_DEVICES = 512
MAX_PORTS = 16
MAX_GIDS = 1024
MAX_PCI_DEVICES = 4096
MAX_FILE_BYTES = 4096

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")

# The distance levels, nearest first.
LEVELS = ("pcie-switch", "root-complex", "numa", "system")

ROCE_V2 = "RoCE v2"
ROCE_V1 = "IB/RoCE v1"
INFINIBAND = "InfiniBand"
ETHERNET = "Ethernet"

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclasses.dataclass(frozen=True)
class Gid:
    """One entry of a port's GID table."""

    index: int
    gid: str  # as sysfs writes it: eight groups of four hex digits
    type: str  # "IB/RoCE v1", "RoCE v2", or "" where sysfs has none
    ndev: str  # the netdev a RoCE GID belongs to; "" on InfiniBand

    @property
    def zero(self) -> bool:
        return self.gid == _ZERO_GID

    @property
    def address(self) -> ipaddress.IPv6Address | None:
        try:
            return ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None


@dataclasses.dataclass(frozen=True)
class Port:
    number: int
    state: str  # "ACTIVE", "DOWN", "INIT", "ARMED", ... ("4: ACTIVE" in sysfs)
    phys_state: str  # "LinkUp", "Disabled", "Polling", ...
    link_layer: str  # "InfiniBand" or "Ethernet"
    rate: str  # "400 Gb/sec (4X NDR)"
    lid: int
    gids: tuple[Gid, ...]

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def rate_gbps(self) -> float | None:
        match = _RATE.match(self.rate)
        return float(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class PciPlace:
    """Where a PCI function sits: its address, the chain from the root
    (``pci0000:15``) through the bridges to it, and its NUMA node (-1: none)."""

    address: str
    path: tuple[str, ...]
    numa_node: int

    @property
    def root(self) -> str:
        return self.path[0] if self.path else ""

    @property
    def bridges(self) -> tuple[str, ...]:
        return self.path[1:-1]


@dataclasses.dataclass(frozen=True)
class RdmaDevice:
    name: str
    place: PciPlace | None  # None: not a PCI function (rxe, siw)
    virtual_function: bool  # an SR-IOV VF (has a physfn link)
    ports: tuple[Port, ...]
    netdevs: tuple[str, ...]

    @property
    def active(self) -> bool:
        return any(p.active for p in self.ports)


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int  # in PCI bus order
    device_id: str  # "0x2330": H100 SXM5
    place: PciPlace


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One port of one RDMA device: what a GPU sends through."""

    device: str
    port: int

    def __str__(self) -> str:
        return f"{self.device}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Affinity:
    """The NIC ports one GPU uses, how near they are, and why."""

    gpu: Gpu
    endpoints: tuple[Endpoint, ...]
    level: str  # one of LEVELS, or "pinned"
    reason: str


def _read(path: str) -> str:
    """A small sysfs file, stripped; "" when absent or unreadable (unused GID
    entries answer EINVAL)."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_FILE_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _int(text: str, default: int) -> int:
    try:
        return int(text, 0)
    except ValueError:
        return default


def _listdir(path: str, limit: int) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(names)[:limit]


def _sys(root: str, *parts: str) -> str:
    return os.path.join(root, "sys", *parts)


def pci_place(root: str, device_dir: str) -> PciPlace | None:
    """The place of the PCI function ``device_dir`` (a link into
    ``/sys/devices/pci...``); None when it is not a PCI function."""
    real = os.path.realpath(device_dir)
    devices = os.path.realpath(_sys(root, "devices"))
    if not real.startswith(devices + os.sep):
        return None
    parts = real[len(devices) + 1 :].split(os.sep)
    if not parts or not _ROOT.match(parts[0]):
        return None
    chain = [parts[0]]
    for part in parts[1:]:
        if not _BDF.match(part):
            break
        chain.append(part)
    if len(chain) < 2:
        return None
    return PciPlace(chain[-1], tuple(chain), _int(_read(os.path.join(real, "numa_node")), -1))


def _state(text: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE"."""
    return text.partition(":")[2].strip() if ":" in text else text


def _port(port_dir: str, number: int) -> Port:
    gids = []
    for name in _listdir(os.path.join(port_dir, "gids"), MAX_GIDS):
        index = _int(name, -1)
        if index < 0:
            continue
        gids.append(
            Gid(
                index,
                _read(os.path.join(port_dir, "gids", name)).lower(),
                _read(os.path.join(port_dir, "gid_attrs", "types", name)),
                _read(os.path.join(port_dir, "gid_attrs", "ndevs", name)),
            )
        )
    gids.sort(key=lambda g: g.index)
    return Port(
        number,
        _state(_read(os.path.join(port_dir, "state"))),
        _state(_read(os.path.join(port_dir, "phys_state"))),
        _read(os.path.join(port_dir, "link_layer")),
        _read(os.path.join(port_dir, "rate")),
        _int(_read(os.path.join(port_dir, "lid")), 0),
        tuple(gids),
    )


def rdma_devices(root: str = "/") -> list[RdmaDevice]:
    """The RDMA devices of ``/sys/class/infiniband``, by name."""
    found = []
    base = _sys(root, "class", "infiniband")
    for name in _listdir(base, MAX_DEVICES):
        if not _NAME.match(name):
            continue
        dev_dir = os.path.join(base, name)
        device = os.path.join(dev_dir, "device")
        ports = []
        for port in _listdir(os.path.join(dev_dir, "ports"), MAX_PORTS):
            number = _int(port, -1)
            if number > 0:
                ports.append(_port(os.path.join(dev_dir, "ports", port), number))
        ports.sort(key=lambda p: p.number)
        found.append(
            RdmaDevice(
                name,
                pci_place(root, device),
                os.path.exists(os.path.join(device, "physfn")),
                tuple(ports),
                tuple(_listdir(os.path.join(device, "net"), 64)),
            )
        )
    return found


def _bdf_key(address: str) -> tuple[int, ...]:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16)


def gpus(root: str = "/") -> list[Gpu]:
    """NVIDIA GPUs in PCI bus order (CUDA's PCI_BUS_ID order)."""
    base = _sys(root, "bus", "pci", "devices")
    found = []
    for name in _listdir(base, MAX_PCI_DEVICES):
        if not _BDF.match(name):
            continue
        dev = os.path.join(base, name)
        if _read(os.path.join(dev, "vendor")).lower() != NVIDIA_VENDOR:
            continue
        if not _read(os.path.join(dev, "class")).lower().startswith(GPU_CLASSES):
            continue
        place = pci_place(root, dev)
        if place is not None:
            found.append((place, _read(os.path.join(dev, "device")).lower()))
    found.sort(key=lambda item: _bdf_key(item[0].address))
    return [Gpu(i, device_id, place) for i, (place, device_id) in enumerate(found)]


def distance(a: PciPlace, b: PciPlace | None) -> tuple[int, int]:
    """(level, -depth): the index into LEVELS, and minus the number of shared
    bridges below the root port; smaller is nearer."""
    if b is None:
        return LEVELS.index("system"), 0
    if a.root == b.root:
        shared = 0
        for x, y in zip(a.bridges, b.bridges, strict=False):
            if x != y:
                break
            shared += 1
        # The first bridge is the root port; sharing one below it is sharing a switch.
        if shared >= 2:
            return LEVELS.index("pcie-switch"), -shared
        return LEVELS.index("root-complex"), -shared
    if a.numa_node >= 0 and a.numa_node == b.numa_node:
        return LEVELS.index("numa"), 0
    return LEVELS.index("system"), 0


def usable(devices: Sequence[RdmaDevice]) -> list[RdmaDevice]:
    """The NICs a GPU may be given: physical functions with a port, those with
    an ACTIVE port when there is any (a down NIC is never nearer than an up one)."""
    candidates = [d for d in devices if d.ports and not d.virtual_function]
    active = [d for d in candidates if d.active]
    return active or candidates


def _endpoint(device: RdmaDevice) -> Endpoint:
    port = next((p for p in device.ports if p.active), device.ports[0])
    return Endpoint(device.name, port.number)


def parse_pinned(text: str, devices: Sequence[RdmaDevice]) -> tuple[Endpoint, ...]:
    """``KVX_RDMA_DEVICES``: ``mlx5_0,mlx5_3`` or ``mlx5_0:1,mlx5_3:1``."""
    by_name = {d.name: d for d in devices}
    exists = ", ".join(f"{d.name} (ports {','.join(str(p.number) for p in d.ports)})" for d in devices)
    exists = exists or "none (no /sys/class/infiniband device)"
    endpoints: list[Endpoint] = []
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(
            f"{DEVICES_ENV} is empty; name RDMA devices, e.g. mlx5_0,mlx5_1; these exist: {exists}"
        )
    for item in items[:MAX_DEVICES]:
        name, _, port_text = item.partition(":")
        device = by_name.get(name)
        if device is None or not device.ports:
            raise ConfigError(
                f"{DEVICES_ENV} names {item!r}, which is not an RDMA device here; these exist: {exists}"
            )
        if port_text:
            number = _int(port_text, -1)
            if number not in {p.number for p in device.ports}:
                raise ConfigError(
                    f"{DEVICES_ENV} names {item!r}: {name} has no port {port_text}; these exist: {exists}"
                )
            endpoint = Endpoint(name, number)
        else:
            endpoint = _endpoint(device)
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    return tuple(endpoints)


def affinity(root: str = "/", env: Mapping[str, str] | None = None) -> list[Affinity]:
    """The NIC ports each GPU uses, in GPU (rail) order; [] when the host has
    no GPU or no RDMA device. Raises ConfigError on a bad ``KVX_RDMA_DEVICES``."""
    env = os.environ if env is None else env
    devices = rdma_devices(root)
    found = gpus(root)
    pinned_text = env.get(DEVICES_ENV, "")
    if pinned_text:
        pinned = parse_pinned(pinned_text, devices)
        return [Affinity(g, pinned, "pinned", f"{DEVICES_ENV}={pinned_text}") for g in found]
    nics = usable(devices)
    if not nics or not found:
        return []
    result: list[Affinity] = []
    turns: dict[tuple[str, ...], int] = {}
    for gpu in found:
        keyed = sorted(((distance(gpu.place, d.place), i) for i, d in enumerate(nics)))
        best = keyed[0][0]
        nearest = [nics[i] for key, i in keyed if key == best]
        level = LEVELS[best[0]]
        if level == "pcie-switch":
            chosen = nearest
            reason = f"behind the same PCIe switch as GPU {gpu.index}"
        else:
            names = tuple(d.name for d in nearest)
            turn = turns.get(names, 0)
            turns[names] = turn + 1
            chosen = [nearest[turn % len(nearest)]]
            where = {"root-complex": "the same PCIe root complex", "numa": "the same NUMA node"}
            reason = f"no NIC behind GPU {gpu.index}'s PCIe switch; nearest: {where.get(level, 'another NUMA node')}"
            if len(nearest) > 1:
                reason += f", taken in turn among {', '.join(names)}"
        result.append(Affinity(gpu, tuple(_endpoint(d) for d in chosen), level, reason))
    return result


def for_gpu(pci_address: str, root: str = "/", env: Mapping[str, str] | None = None) -> Affinity:
    """The affinity of the GPU at ``pci_address`` (``0000:1b:00.0``; CUDA's
    ``cudaDeviceGetPCIBusId`` gives it), which holds whatever
    ``CUDA_VISIBLE_DEVICES`` renumbered."""
    address = pci_address.lower()
    if len(address.split(":")) == 3 and len(address.split(":")[0]) == 8:
        address = address[4:]  # CUDA writes the domain with 8 digits: 00000000:1B:00.0
    for item in affinity(root, env):
        if item.gpu.place.address == address:
            return item
    raise ConfigError(
        f"no GPU at PCI address {pci_address} with an RDMA NIC in {_sys(root, 'bus', 'pci', 'devices')}"
    )


def peer_rail(local_rail: int, remote_rails: int) -> int:
    """The remote rail a local rail pairs with: the same index, wrapping
    when the peer has fewer (a 4-NIC decode host reading from an 8-NIC one)."""
    if remote_rails <= 0:
        raise ConfigError("the peer offers no RDMA rail")
    return local_rail % remote_rails


def _gid_rank(gid: Gid) -> tuple[int, int]:
    address = gid.address
    if address is not None and address.ipv4_mapped is not None:
        return 0, gid.index  # ::ffff:a.b.c.d: routable, the one RoCE v2 peers use
    if address is not None and not address.is_link_local:
        return 1, gid.index
    return 2, gid.index  # fe80::: one L2 segment only


def _netdev_up(root: str, ndev: str) -> bool:
    if not _NAME.match(ndev):
        return False
    state = _read(_sys(root, "class", "net", ndev, "operstate"))
    # "unknown" is what some drivers (and bonds over them) report while passing traffic.
    return state in ("up", "unknown")


def find_port(device: RdmaDevice, number: int) -> Port:
    for port in device.ports:
        if port.number == number:
            return port
    raise ConfigError(f"{device.name} has no port {number}")


def pick_gid(port: Port, root: str = "/", env: Mapping[str, str] | None = None) -> tuple[Gid, str]:
    """The GID a queue pair on ``port`` is addressed by, and why that one.

    InfiniBand: GID 0 (the port GUID; peers address it by LID). RoCE: a
    RoCE v2 GID of a netdev that is up, preferring an IPv4-mapped address
    over a global IPv6 one over link-local; ``KVX_RDMA_GID_INDEX`` overrides.
    Raises ConfigError with the fix when there is none."""
    env = os.environ if env is None else env
    by_index = {g.index: g for g in port.gids}
    override = env.get(GID_INDEX_ENV, "").strip()
    if override:
        index = _int(override, -1)
        gid = by_index.get(index)
        if gid is None or gid.zero:
            valid = ", ".join(str(g.index) for g in port.gids if not g.zero) or "none"
            raise ConfigError(
                f"{GID_INDEX_ENV}={override} is not a GID in use on port {port.number}; in use: {valid} "
                "(show them with `show_gids` or `ibv_devinfo -v`)"
            )
        return gid, f"{GID_INDEX_ENV}={override}"
    if port.link_layer != ETHERNET:
        gid = by_index.get(0)
        if gid is None or gid.zero:
            raise ConfigError(
                f"port {port.number} has no GID 0: is the port up and the subnet manager running?"
            )
        return gid, "InfiniBand: GID 0, addressed by LID"
    v2 = [g for g in port.gids if g.type == ROCE_V2 and not g.zero]
    up = [g for g in v2 if _netdev_up(root, g.ndev)]
    if up:
        best = min(up, key=_gid_rank)
        kind = ("IPv4-mapped", "global IPv6", "link-local")[_gid_rank(best)[0]]
        return best, f"RoCE v2, {kind}, netdev {best.ndev} up"
    if v2:
        downs = sorted({g.ndev for g in v2})
        raise ConfigError(
            f"port {port.number}'s RoCE v2 GIDs belong to netdevs that are not up ({', '.join(downs)}): "
            f"bring them up (ip link set {downs[0]} up) or set {GID_INDEX_ENV}"
        )
    raise ConfigError(
        f"port {port.number} has no RoCE v2 GID: give its netdev an IP address (a RoCE v2 GID is made "
        f"from it), or set {GID_INDEX_ENV} to a RoCE v1 GID if the fabric runs v1"
    )
