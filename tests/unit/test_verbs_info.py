"""kvx.backends.rdma.verbs_info on sysfs trees laid out like a RoCE and an IB host."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvx.backends.rdma import verbs, verbs_info
from kvx.errors import ConfigError
from tests.unit import sysfs_trees

LINK_LOCAL = "fe80:0000:0000:0000:0211:22ff:fe33:4455"
V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"
EMPTY = "0000:0000:0000:0000:0000:0000:0000:0000"


def make_port(root: Path, device: str, port: int, link: str, gids: list[tuple[str, str]]) -> None:
    base = root / device / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    (base / "state").write_text("4: ACTIVE\n")
    (base / "link_layer").write_text(link + "\n")
    (base / "rate").write_text("400 Gb/sec (4X NDR)\n")
    for index, (gid, kind) in enumerate(gids + [(EMPTY, "")]):
        (base / "gids" / str(index)).write_text(gid + "\n")
        (base / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")


def test_roce_v2_ipv4_gid_is_picked(tmp_path):
    make_port(
        tmp_path,
        "mlx5_0",
        1,
        "Ethernet",
        [(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2"), (V4, "IB/RoCE v1"), (V4, "RoCE v2")],
    )
    (port,) = verbs_info.ports(root=tmp_path)
    assert (port.device, port.port, port.state, port.link_layer) == ("mlx5_0", 1, "ACTIVE", "Ethernet")
    assert [g.index for g in port.gids] == [0, 1, 2, 3] and port.gids[3].kind == "RoCE v2"


def test_the_verbs_provider_takes_the_gid_topology_picks(tmp_path, monkeypatch):
    """One choice of GID for the endpoint and for kvx doctor: the topology's,
    with KVX_RDMA_GID_INDEX honoured; a device sysfs does not list is left
    to kvx._verbs."""
    sysfs_trees.roce_host(tmp_path)
    monkeypatch.delenv("KVX_RDMA_GID_INDEX", raising=False)
    assert verbs.gid_for("mlx5_0", 1, str(tmp_path)) == 3
    assert verbs.gid_for("mlx5_0", 1, str(tmp_path), env={"KVX_RDMA_GID_INDEX": "1"}) == 1
    with pytest.raises(ConfigError, match="in use"):
        verbs.gid_for("mlx5_0", 1, str(tmp_path), env={"KVX_RDMA_GID_INDEX": "9"})
    assert verbs.gid_for("fake_roce0", 1, str(tmp_path)) is None


def test_no_devices(tmp_path):
    assert verbs_info.ports(root=tmp_path / "absent") == []
