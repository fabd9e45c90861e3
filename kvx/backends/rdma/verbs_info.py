"""RDMA devices, ports and GIDs, for ``kvx doctor`` and for picking a RoCE GID.

Listing is not a hot path, so it is Python: pyverbs (rdma-core's Python
bindings) when importable, else the kernel's sysfs tree
(``/sys/class/infiniband``), which carries the same facts and needs nothing
installed. pyverbs is not on PyPI; Debian's ``python3-pyverbs`` installs it
into ``/usr/lib/python3/dist-packages``. To expose it to a virtual
environment built on the same Python minor version, either create the venv
with ``python3 -m venv --system-site-packages``, or drop a ``.pth`` file into
the venv::

    echo /usr/lib/python3/dist-packages > "$VIRTUAL_ENV/lib/python3.11/site-packages/pyverbs.pth"

(the .pth route exposes every Debian Python package; a venv on another
Python minor version cannot load pyverbs' compiled modules at all).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SYSFS = Path("/sys/class/infiniband")
GIDS_MAX = 256


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str  # "fe80:0000:...", as sysfs writes it
    kind: str  # "IB", "RoCE v1" or "RoCE v2" ("" when unknown)


@dataclass(frozen=True)
class Port:
    device: str
    port: int
    state: str  # "ACTIVE", "DOWN"...
    link_layer: str  # "InfiniBand" or "Ethernet"
    rate: str = ""
    gids: list[Gid] = field(default_factory=list)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _sysfs_ports(root: Path) -> list[Port]:
    ports = []
    for device in sorted(p for p in root.iterdir()) if root.is_dir() else []:
        for port_dir in sorted((device / "ports").glob("*"), key=lambda p: int(p.name)):
            gids = []
            for index in range(GIDS_MAX):
                gid = _read(port_dir / "gids" / str(index))
                if not gid:
                    break
                if gid.replace("0", "").replace(":", ""):
                    kind = _read(port_dir / "gid_attrs" / "types" / str(index))
                    gids.append(Gid(index, gid, kind))
            state = _read(port_dir / "state")  # "4: ACTIVE"
            ports.append(
                Port(
                    device=device.name,
                    port=int(port_dir.name),
                    state=state.split(":", 1)[-1].strip(),
                    link_layer=_read(port_dir / "link_layer"),
                    rate=_read(port_dir / "rate"),
                    gids=gids,
                )
            )
    return ports


def _pyverbs_ports() -> list[Port] | None:
    try:
        import pyverbs.device as pd
        import pyverbs.enums as e
    except ImportError:
        return None
    ports = []
    try:
        for dev in pd.get_device_list():
            name = dev.name.decode()
            with pd.Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    attr = ctx.query_port(port)
                    gids = []
                    for index in range(min(attr.gid_tbl_len, GIDS_MAX)):
                        try:
                            gid = str(ctx.query_gid(port, index))
                        except Exception:  # noqa: BLE001 - a hole in the table
                            continue
                        if gid.replace("0", "").replace(":", ""):
                            gids.append(Gid(index, gid, ""))
                    ether = attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
                    ports.append(
                        Port(
                            device=name,
                            port=port,
                            state="ACTIVE" if attr.state == e.IBV_PORT_ACTIVE else str(attr.state),
                            link_layer="Ethernet" if ether else "InfiniBand",
                            gids=gids,
                        )
                    )
    except Exception as error:  # noqa: BLE001 - pyverbs raises its own PyverbsRDMAError
        logger.warning("pyverbs could not list the RDMA devices (%s); reading sysfs", error)
        return None
    return ports


def ports(root: Path = SYSFS) -> list[Port]:
    """Every port of every RDMA device: from pyverbs when importable, else sysfs.

    sysfs adds each GID's RoCE version, which pyverbs 44 does not report; when
    both are there, the kinds are taken from sysfs.
    """
    found = _pyverbs_ports() if root == SYSFS else None
    from_sysfs = _sysfs_ports(root)
    if not found:
        return from_sysfs
    kinds = {(p.device, p.port, g.index): g.kind for p in from_sysfs for g in p.gids}
    return [
        Port(
            p.device,
            p.port,
            p.state,
            p.link_layer,
            p.rate,
            [Gid(g.index, g.gid, kinds.get((p.device, p.port, g.index), "")) for g in p.gids],
        )
        for p in found
    ]
