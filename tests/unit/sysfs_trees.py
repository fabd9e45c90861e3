"""sysfs trees of real machines, built in a directory with real symlinks, for
kvx.backends.rdma.topology and kvx doctor.

The layouts, and what each follows:

- ``dgx_h100``: a DGX H100. Bus numbers and device names follow the DGX H100
  user guide's port table and the `mlxconfig -d <bus>:00.0` lines of NVIDIA's
  BasePOD deployment guide: the eight ConnectX-7 compute NICs (400 Gb/s NDR
  InfiniBand, single port, OSFP) at buses 18, 40, 4f, 5e, 9a, c0, ce, dc are
  mlx5_0, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_9, mlx5_10, mlx5_11 (netdevs
  ibp24s0 ... ibp220s0), the two dual-port storage NICs at buses 29 and aa
  are mlx5_1/mlx5_2 and mlx5_7/mlx5_8; the eight H100 SXM5 GPUs (device
  0x2330, class 0x0302) at buses 1b, 43, 52, 61, 9d, c3, d1, df each sit
  behind one PCIe switch with their rail NIC (`nvidia-smi topo -m` shows PIX
  for GPUn/NICn), the first four on NUMA node 0, the rest on node 1; the four
  NVSwitches are NVIDIA functions of class 0x0680 (bridges, not GPUs). The
  grouping of switches under root complexes (two GPU+NIC switches per
  ``pci0000:xx`` root, storage on a root of its own per socket) and the
  bridges' own addresses are simplified.
- ``four_gpu_two_nic``: a two-socket AMD EPYC server (four PCIe GPUs, one
  ConnectX-6 200 Gb/s HDR NIC per socket): GPUs and the NIC hang off sibling
  root ports of one root complex (``pci0000:40``, ``pci0000:c0``), with no
  PCIe switch, so two GPUs share each NIC by root complex (PHB).
- ``roce_host``: one dual-port ConnectX-6 Dx on Ethernet (RoCE), the GID
  table as mlx5 fills it and `show_gids` prints it: per netdev address a
  RoCE v1 and a RoCE v2 GID, first the link-local fe80 ones, then the
  IPv4-mapped ones, the rest of the table zeros with no type.
- ``no_rdma``: a host with PCI devices and no /sys/class/infiniband.
"""

from __future__ import annotations

import os
from pathlib import Path

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class SysfsTree:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys" / "devices").mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(target, link.parent))

    def pci(
        self, path: list[str], vendor: str, device: str, class_: str, numa: int, *, physfn: str | None = None
    ) -> Path:
        """The PCI function at the end of ``path`` (root, bridges, function),
        with every bridge on the way and the /sys/bus/pci/devices links."""
        here = self.root / "sys" / "devices" / path[0]
        for bdf in path[1:]:
            here = here / bdf
            here.mkdir(parents=True, exist_ok=True)
            self._link(self.root / "sys" / "bus" / "pci" / "devices" / bdf, here)
            if not (here / "vendor").exists():  # a bridge, unless written below
                self._write(here / "vendor", "0x1000")
                self._write(here / "class", "0x060400")
                self._write(here / "numa_node", str(numa))
        self._write(here / "vendor", vendor)
        self._write(here / "device", device)
        self._write(here / "class", class_)
        self._write(here / "numa_node", str(numa))
        if physfn:
            self._link(here / "physfn", here.parent / physfn)
        return here

    def gpu(self, path: list[str], numa: int, device: str = "0x2330") -> Path:
        return self.pci(path, "0x10de", device, "0x030200", numa)

    def nic(
        self,
        name: str,
        path: list[str],
        numa: int,
        ports: list[dict],
        netdevs: list[str],
        *,
        physfn: str | None = None,
    ) -> Path:
        """A Mellanox function with its RDMA device, ports, GID tables and netdevs.
        A port dict: state, phys_state, link_layer, rate, lid, gids [(gid, type, ndev)]."""
        func = self.pci(path, "0x15b3", "0x1021", "0x020700", numa, physfn=physfn)
        ib = func / "infiniband" / name
        self._link(ib / "device", func)
        self._link(self.root / "sys" / "class" / "infiniband" / name, ib)
        for number, port in enumerate(ports, start=1):
            pdir = ib / "ports" / str(number)
            self._write(pdir / "state", port.get("state", "4: ACTIVE"))
            self._write(pdir / "phys_state", port.get("phys_state", "5: LinkUp"))
            self._write(pdir / "link_layer", port["link_layer"])
            self._write(pdir / "rate", port["rate"])
            self._write(pdir / "lid", port.get("lid", "0x0"))
            for index, (gid, kind, ndev) in enumerate(port["gids"]):
                self._write(pdir / "gids" / str(index), gid)
                # Unused entries: reading their type or netdev fails (EINVAL); here, no file.
                if kind:
                    self._write(pdir / "gid_attrs" / "types" / str(index), kind)
                if ndev:
                    self._write(pdir / "gid_attrs" / "ndevs" / str(index), ndev)
        for netdev in netdevs:
            ndir = func / "net" / netdev
            self._write(ndir / "operstate", "up")
            self._link(self.root / "sys" / "class" / "net" / netdev, ndir)
        return func

    def set_port_state(self, name: str, port: int, state: str, phys: str) -> None:
        pdir = self.root / "sys" / "class" / "infiniband" / name / "ports" / str(port)
        self._write(pdir / "state", state)
        self._write(pdir / "phys_state", phys)

    def set_netdev(self, netdev: str, operstate: str) -> None:
        self._write(self.root / "sys" / "class" / "net" / netdev / "operstate", operstate)

    def kernel(self, release: str) -> None:
        self._write(self.root / "proc" / "sys" / "kernel" / "osrelease", release)

    def module(self, name: str) -> None:
        (self.root / "sys" / "module" / name).mkdir(parents=True, exist_ok=True)


def ib_port(guid: str, lid: str, rate: str = "400 Gb/sec (4X NDR)") -> dict:
    """An InfiniBand port: GID 0 is the subnet prefix and the port GUID."""
    return {
        "link_layer": "InfiniBand",
        "rate": rate,
        "lid": lid,
        "gids": [(f"fe80:0000:0000:0000:{guid}", "IB/RoCE v1", "")] + [(ZERO_GID, "", "")] * 3,
    }


# DGX H100: (compute NIC name, NIC bus, GPU bus, NUMA node, root complex).
DGX_H100_RAILS = [
    ("mlx5_0", "18", "1b", 0, "15"),
    ("mlx5_3", "40", "43", 0, "15"),
    ("mlx5_4", "4f", "52", 0, "4d"),
    ("mlx5_5", "5e", "61", 0, "4d"),
    ("mlx5_6", "9a", "9d", 1, "97"),
    ("mlx5_9", "c0", "c3", 1, "97"),
    ("mlx5_10", "ce", "d1", 1, "cb"),
    ("mlx5_11", "dc", "df", 1, "cb"),
]
DGX_H100_STORAGE = ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"]


def dgx_h100(root: Path) -> SysfsTree:
    tree = SysfsTree(root)
    for rail, (name, nic_bus, gpu_bus, numa, rc) in enumerate(DGX_H100_RAILS):
        # root port -> switch upstream port -> one downstream port each for NIC and GPU
        rp = f"0000:{rc}:{1 + 2 * (rail % 2):02x}.0"
        up = f"0000:{int(nic_bus, 16) - 2:02x}:00.0"
        down = f"0000:{int(nic_bus, 16) - 1:02x}"
        base = [f"pci0000:{rc}", rp, up]
        guid = f"a088:c203:00{rail:02x}:{0x1000 + rail:04x}"
        tree.nic(
            name,
            [*base, f"{down}:00.0", f"0000:{nic_bus}:00.0"],
            numa,
            [ib_port(guid, hex(rail + 1))],
            [f"ibp{int(nic_bus, 16)}s0"],
        )
        tree.gpu([*base, f"{down}:03.0", f"0000:{gpu_bus}:00.0"], numa)
    for (rc, bus, numa), names in zip(
        [("27", "29", 0), ("a8", "aa", 1)], [DGX_H100_STORAGE[:2], DGX_H100_STORAGE[2:]], strict=True
    ):
        for function, name in enumerate(names):
            netdev = f"enp{int(bus, 16)}s0f{function}np{function}"
            eth = {
                "link_layer": "Ethernet",
                "rate": "200 Gb/sec (4X HDR)",
                "gids": [
                    ("fe80:0000:0000:0000:5a00:00ff:fe00:0001", "IB/RoCE v1", netdev),
                    ("fe80:0000:0000:0000:5a00:00ff:fe00:0001", "RoCE v2", netdev),
                ],
            }
            tree.nic(
                name, [f"pci0000:{rc}", f"0000:{rc}:01.0", f"0000:{bus}:00.{function}"], numa, [eth], [netdev]
            )
    # The four NVSwitches: NVIDIA functions, class 0x0680, not GPUs.
    for i, bus in enumerate(["05", "06", "07", "08"]):
        tree.pci(["pci0000:00", "0000:00:01.0", f"0000:{bus}:00.0"], "0x10de", "0x22a3", "0x068000", i // 2)
    return tree


def four_gpu_two_nic(root: Path) -> SysfsTree:
    tree = SysfsTree(root)
    for numa, rc, nic in ((0, "40", "mlx5_0"), (1, "c0", "mlx5_1")):
        bus = int(rc, 16)
        for i in range(2):
            tree.gpu(
                [f"pci0000:{rc}", f"0000:{rc}:{1 + 2 * i:02x}.1", f"0000:{bus + 1 + i:02x}:00.0"],
                numa,
                device="0x20b5",
            )  # A100 PCIe 80GB
        tree.nic(
            nic,
            [f"pci0000:{rc}", f"0000:{rc}:05.1", f"0000:{bus + 3:02x}:00.0"],
            numa,
            [ib_port(f"0c42:a103:0000:{numa:04x}", hex(numa + 1), "200 Gb/sec (4X HDR)")],
            [f"ibp{bus + 3}s0"],
        )
    return tree


ROCE_GIDS = [
    ("fe80:0000:0000:0000:0ac0:ebff:fe4d:1f2e", "IB/RoCE v1"),
    ("fe80:0000:0000:0000:0ac0:ebff:fe4d:1f2e", "RoCE v2"),
    ("0000:0000:0000:0000:0000:ffff:c0a8:010a", "IB/RoCE v1"),  # ::ffff:192.168.1.10
    ("0000:0000:0000:0000:0000:ffff:c0a8:010a", "RoCE v2"),
]


def roce_host(root: Path) -> SysfsTree:
    tree = SysfsTree(root)
    for function, name in enumerate(["mlx5_0", "mlx5_1"]):
        netdev = f"ens1f{function}np{function}"
        # The second port's netdev has only a link-local address.
        in_use = ROCE_GIDS if function == 0 else ROCE_GIDS[:2]
        gids = [(gid, kind, netdev) for gid, kind in in_use] + [(ZERO_GID, "", "")] * 4
        port = {"link_layer": "Ethernet", "rate": "100 Gb/sec (2X HDR)", "gids": gids}
        tree.nic(name, ["pci0000:00", "0000:00:03.0", f"0000:01:00.{function}"], 0, [port], [netdev])
    return tree


def no_rdma(root: Path) -> SysfsTree:
    tree = SysfsTree(root)
    tree.pci(["pci0000:00", "0000:00:1f.6"], "0x8086", "0x15bb", "0x020000", 0)  # an Intel NIC, no RDMA
    return tree
