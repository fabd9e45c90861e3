"""GPU -> NIC topology read from sysfs trees of real machines (built with real
symlinks in tests/unit/sysfs_trees.py, whose docstring says which layout
each follows): a DGX H100 (8 H100, 8 ConnectX-7 compute NICs each behind the
GPU's PCIe switch, 4 storage functions, 4 NVSwitches), a 4-GPU/2-NIC AMD
EPYC server (NIC shared by root complex), a RoCE host and a host without
RDMA devices."""

from __future__ import annotations

import pytest

from kvx.backends.rdma import topology
from kvx.errors import ConfigError
from tests.unit import sysfs_trees
from tests.unit.sysfs_trees import DGX_H100_RAILS, DGX_H100_STORAGE


@pytest.fixture
def dgx(tmp_path):
    sysfs_trees.dgx_h100(tmp_path)
    return tmp_path


def test_dgx_h100_devices_ports_and_pci_paths(dgx):
    devices = {d.name: d for d in topology.rdma_devices(str(dgx))}
    assert sorted(devices) == sorted([r[0] for r in DGX_H100_RAILS] + DGX_H100_STORAGE)
    nic = devices["mlx5_0"]
    assert nic.place is not None
    assert nic.place.address == "0000:18:00.0"
    # The `device` link resolved through /sys/devices: root, root port, switch up and down ports.
    assert nic.place.path == ("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    assert nic.place.numa_node == 0
    assert nic.netdevs == ("ibp24s0",)
    (port,) = nic.ports
    assert (port.state, port.phys_state, port.link_layer) == ("ACTIVE", "LinkUp", "InfiniBand")
    assert port.rate_gbps == 400.0 and port.lid == 1
    assert port.gids[0].gid == "fe80:0000:0000:0000:a088:c203:0000:1000"
    assert port.gids[0].type == "IB/RoCE v1" and port.gids[1].zero
    assert devices["mlx5_11"].place.numa_node == 1
    assert devices["mlx5_7"].ports[0].link_layer == "Ethernet"


def test_dgx_h100_gpus_in_pci_bus_order_without_nvswitches(dgx):
    found = topology.gpus(str(dgx))
    assert [g.place.address for g in found] == [f"0000:{r[2]}:00.0" for r in DGX_H100_RAILS]
    assert [g.index for g in found] == list(range(8))
    assert [g.place.numa_node for g in found] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.device_id for g in found} == {"0x2330"}


def test_dgx_h100_each_gpu_takes_the_nic_behind_its_switch(dgx):
    table = topology.affinity(str(dgx), env={})
    assert [(a.gpu.index, [str(e) for e in a.endpoints], a.level) for a in table] == [
        (i, [f"{name}:1"], "pcie-switch") for i, (name, *_rest) in enumerate(DGX_H100_RAILS)
    ]
    chosen = {e.device for a in table for e in a.endpoints}
    assert not chosen & set(DGX_H100_STORAGE)


def test_dgx_h100_a_down_rail_nic_moves_its_gpu_to_the_next_nearest_not_storage(dgx):
    tree = sysfs_trees.SysfsTree(dgx)
    tree.set_port_state("mlx5_0", 1, "1: DOWN", "3: Disabled")
    table = topology.affinity(str(dgx), env={})
    # GPU 0's root complex (pci0000:15) also holds mlx5_3; the storage NIC is on another root.
    assert [str(e) for e in table[0].endpoints] == ["mlx5_3:1"]
    assert table[0].level == "root-complex"
    assert [str(e) for e in table[1].endpoints] == ["mlx5_3:1"]


def test_pinning_overrides_the_choice_and_names_what_exists(dgx):
    env = {"KVX_RDMA_DEVICES": "mlx5_3:1, mlx5_0"}
    table = topology.affinity(str(dgx), env=env)
    assert all([str(e) for e in a.endpoints] == ["mlx5_3:1", "mlx5_0:1"] for a in table)
    assert {a.level for a in table} == {"pinned"}
    with pytest.raises(ConfigError, match=r"'mlx5_99'.*these exist: mlx5_0 \(ports 1\), mlx5_1"):
        topology.affinity(str(dgx), env={"KVX_RDMA_DEVICES": "mlx5_0,mlx5_99"})
    with pytest.raises(ConfigError, match="mlx5_0 has no port 2"):
        topology.affinity(str(dgx), env={"KVX_RDMA_DEVICES": "mlx5_0:2"})
    with pytest.raises(ConfigError, match="is empty"):
        topology.affinity(str(dgx), env={"KVX_RDMA_DEVICES": " , "})


def test_for_gpu_takes_cudas_bus_id_format(dgx):
    item = topology.for_gpu("00000000:9D:00.0", str(dgx), env={})
    assert item.gpu.index == 4 and [str(e) for e in item.endpoints] == ["mlx5_6:1"]
    with pytest.raises(ConfigError, match="no GPU at PCI address 0000:aa:00.0"):
        topology.for_gpu("0000:aa:00.0", str(dgx), env={})


def test_four_gpus_two_nics_share_by_root_complex(tmp_path):
    sysfs_trees.four_gpu_two_nic(tmp_path)
    table = topology.affinity(str(tmp_path), env={})
    assert [(a.gpu.place.address, [str(e) for e in a.endpoints], a.level) for a in table] == [
        ("0000:41:00.0", ["mlx5_0:1"], "root-complex"),
        ("0000:42:00.0", ["mlx5_0:1"], "root-complex"),
        ("0000:c1:00.0", ["mlx5_1:1"], "root-complex"),
        ("0000:c2:00.0", ["mlx5_1:1"], "root-complex"),
    ]


def test_gpus_tied_on_a_numa_node_take_its_nics_in_turn(tmp_path):
    tree = sysfs_trees.SysfsTree(tmp_path)
    for i in range(4):
        tree.gpu(["pci0000:00", f"0000:00:0{i + 1}.0", f"0000:0{i + 1}:00.0"], 0)
    for i, name in enumerate(["mlx5_0", "mlx5_1"]):
        tree.nic(name, ["pci0000:80", f"0000:80:0{i + 1}.0", f"0000:8{i + 1}:00.0"], 0,
                 [sysfs_trees.ib_port(f"0000:0000:0000:000{i}", "0x1")], [])  # fmt: skip
    table = topology.affinity(str(tmp_path), env={})
    assert [[str(e) for e in a.endpoints] for a in table] == [["mlx5_0:1"], ["mlx5_1:1"]] * 2
    assert {a.level for a in table} == {"numa"}
    assert "in turn among mlx5_0, mlx5_1" in table[0].reason


def test_virtual_functions_are_not_given_to_gpus(tmp_path):
    tree = sysfs_trees.SysfsTree(tmp_path)
    base = ["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"]
    tree.gpu([*base[:-1], "0000:02:01.0", "0000:03:00.0"], 0)
    tree.nic("mlx5_0", [*base, "0000:04:00.0"], 0, [sysfs_trees.ib_port("0:0:0:1", "0x1")], [])
    tree.nic("mlx5_1", [*base, "0000:04:00.1"], 0, [sysfs_trees.ib_port("0:0:0:2", "0x2")], [],
             physfn="0000:04:00.0")  # fmt: skip
    devices = {d.name: d for d in topology.rdma_devices(str(tmp_path))}
    assert devices["mlx5_1"].virtual_function and not devices["mlx5_0"].virtual_function
    (item,) = topology.affinity(str(tmp_path), env={})
    assert [str(e) for e in item.endpoints] == ["mlx5_0:1"]


def _port(root, name):
    (device,) = [d for d in topology.rdma_devices(str(root)) if d.name == name]
    return device.ports[0]


def test_roce_picks_the_ipv4_mapped_v2_gid_of_an_up_netdev(tmp_path):
    sysfs_trees.roce_host(tmp_path)
    gid, why = topology.pick_gid(_port(tmp_path, "mlx5_0"), str(tmp_path), env={})
    assert gid.index == 3 and gid.type == "RoCE v2" and gid.ndev == "ens1f0np0"
    assert str(gid.address.ipv4_mapped) == "192.168.1.10"
    assert "IPv4-mapped" in why
    # Only a link-local address on the second port: its v2 GID, not the v1 one.
    gid, why = topology.pick_gid(_port(tmp_path, "mlx5_1"), str(tmp_path), env={})
    assert gid.index == 1 and "link-local" in why


def test_roce_gid_override_and_its_errors(tmp_path):
    sysfs_trees.roce_host(tmp_path)
    port = _port(tmp_path, "mlx5_0")
    gid, why = topology.pick_gid(port, str(tmp_path), env={"KVX_RDMA_GID_INDEX": "1"})
    assert gid.index == 1 and why == "KVX_RDMA_GID_INDEX=1"
    for bad in ("5", "99", "x"):  # 5: an all-zero entry
        with pytest.raises(ConfigError, match=r"in use: 0, 1, 2, 3"):
            topology.pick_gid(port, str(tmp_path), env={"KVX_RDMA_GID_INDEX": bad})


def test_roce_with_its_netdev_down_says_how_to_fix(tmp_path):
    tree = sysfs_trees.roce_host(tmp_path)
    tree.set_netdev("ens1f0np0", "down")
    with pytest.raises(ConfigError, match="ip link set ens1f0np0 up"):
        topology.pick_gid(_port(tmp_path, "mlx5_0"), str(tmp_path), env={})


def test_infiniband_uses_gid_0(dgx):
    gid, why = topology.pick_gid(_port(dgx, "mlx5_4"), str(dgx), env={})
    assert gid.index == 0 and "LID" in why


def test_a_host_without_rdma_devices(tmp_path):
    sysfs_trees.no_rdma(tmp_path)
    assert topology.rdma_devices(str(tmp_path)) == []
    assert topology.gpus(str(tmp_path)) == []
    assert topology.affinity(str(tmp_path), env={}) == []
    with pytest.raises(ConfigError, match="these exist: none"):
        topology.affinity(str(tmp_path), env={"KVX_RDMA_DEVICES": "mlx5_0"})


def test_peers_pair_nics_by_rail():
    assert [topology.peer_rail(i, 8) for i in range(8)] == list(range(8))
    assert [topology.peer_rail(i, 4) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ConfigError):
        topology.peer_rail(0, 0)
