"""kvx.backends.rdma.verbs_info on sysfs trees laid out like a RoCE and an IB host."""

from __future__ import annotations

from pathlib import Path

from kvx.backends.rdma import verbs_info

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
    assert verbs_info.pick_gid_index("mlx5_0", 1, root=tmp_path) == 3
    assert verbs_info.pick_gid_index("mlx5_1", 1, root=tmp_path) is None
    (port,) = verbs_info.ports(root=tmp_path)
    assert (port.device, port.port, port.state, port.link_layer) == ("mlx5_0", 1, "ACTIVE", "Ethernet")
    assert [g.index for g in port.gids] == [0, 1, 2, 3] and port.gids[3].kind == "RoCE v2"


def test_infiniband_leaves_the_choice_to_the_provider(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", [(LINK_LOCAL, "IB/RoCE v1")])
    assert verbs_info.pick_gid_index("mlx5_0", 1, root=tmp_path) is None


def test_no_devices(tmp_path):
    assert verbs_info.ports(root=tmp_path / "absent") == []
