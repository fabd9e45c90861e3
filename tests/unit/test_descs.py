import numpy as np
import pytest

import kvx
from kvx import Descs, KVLayout
from kvx.descs import DESC_DTYPE


def test_build_broadcasts_scalars():
    d = Descs.build(3, [0, 100, 200], 50)
    assert d.region.tolist() == [3, 3, 3]
    assert d.offset.tolist() == [0, 100, 200]
    assert d.length.tolist() == [50, 50, 50]
    assert d.total_bytes == 150


@pytest.mark.parametrize(
    "offset, length", [(0, 0), (4096, 16384), ((1 << 63) - 1, 1), (1 << 63, 1), (5, (1 << 64) - 1)]
)
def test_one_descriptor_from_plain_ints_is_the_array_paths(offset, length):
    """Plain ints take a shorter path (ints of 2**63 and more do not); numpy
    ints, the array path: the same list either way."""
    short = Descs.build(9, offset, length)
    full = Descs.build(np.uint32(9), np.uint64(offset), np.uint64(length))
    assert short.array.dtype == full.array.dtype == DESC_DTYPE
    assert short.array.tobytes() == full.array.tobytes()
    assert short.array.tolist() == [(9, offset, length)]


@pytest.mark.parametrize("offset, length", [(-1, 10), (0, -1), (True, 10), (0, 1 << 64)])
def test_plain_ints_out_of_range_are_refused_as_before(offset, length):
    with pytest.raises(kvx.ConfigError):
        Descs.build(1, offset, length)


def test_from_blocks_uses_stride_and_base():
    d = Descs.from_blocks(1, [0, 2, 5], 10, block_stride_bytes=16, base_offset_bytes=4)
    assert d.offset.tolist() == [4, 36, 84]
    assert d.length.tolist() == [10, 10, 10]


def test_coalesce_merges_only_adjacent_runs_in_one_region():
    d = Descs.concat([Descs.from_blocks(1, [0, 1, 2, 5, 6, 9], 10), Descs.build(2, 100, 10)])
    c = d.coalesce()
    assert c.array.tolist() == [(1, 0, 30), (1, 50, 20), (1, 90, 10), (2, 100, 10)]
    assert c.total_bytes == d.total_bytes


def test_coalesce_keeps_order_and_does_not_merge_across_regions():
    d = Descs(np.array([(1, 0, 10), (2, 10, 10), (1, 10, 10)], dtype=DESC_DTYPE))
    assert len(d.coalesce()) == 3


def test_split_at_cuts_inside_descriptors():
    d = Descs.from_blocks(3, [0, 1, 2, 5, 6, 9], 10)
    cut, idx = d.split_at(np.array([0, 15, 35, 60]))
    assert cut.array.tolist() == [
        (3, 0, 10),
        (3, 10, 5),
        (3, 15, 5),
        (3, 20, 10),
        (3, 50, 5),
        (3, 55, 5),
        (3, 60, 10),
        (3, 90, 10),
    ]
    assert idx.tolist() == [0, 2, 5, 8]
    assert cut.total_bytes == d.total_bytes


def test_packed_structured_arrays_are_accepted():
    packed = np.array([(1, 8, 16)], dtype=[("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
    d = Descs(packed)
    assert d.array.dtype == DESC_DTYPE
    assert d.array.tolist() == [(1, 8, 16)]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Descs.build(1, [-1], 10),
        lambda: Descs.build(1, [0.5], 10),
        lambda: Descs.build(1, [0, 1], [1, 2, 3]),
        lambda: Descs.build(-1, 0, 1),
        lambda: Descs(np.zeros(3, np.uint64)),
        lambda: Descs.from_blocks(1, [0], 0),
    ],
)
def test_bad_input_is_a_config_error(bad):
    with pytest.raises(kvx.ConfigError):
        bad()


def test_padding_bytes_are_zero_on_the_wire():
    d = Descs.from_blocks(7, np.arange(100), 4096)
    raw = d.array.view(np.uint8).reshape(len(d), DESC_DTYPE.itemsize)
    assert not raw[:, 4:8].any()


def test_layout_packed_orders_layer_plane_block():
    layout = KVLayout.packed(1, num_layers=2, num_blocks=8, block_size_bytes=16)
    d = layout.descs([1, 2])
    # layer stride = 2 planes * 8 blocks * 16 bytes = 256; plane stride = 128
    assert d.offset.tolist() == [16, 32, 144, 160, 272, 288, 400, 416]
    assert set(d.region.tolist()) == {1}
    assert layout.region_size_bytes == 512
    assert layout.bytes_per_block == 64


def test_layout_per_layer_regions_and_layer_subset():
    layout = KVLayout.per_layer([4, 5, 6], num_blocks=8, block_size_bytes=16)
    d = layout.descs([7], layers=[2, 0])
    assert d.array.tolist() == [(6, 112, 16), (6, 240, 16), (4, 112, 16), (4, 240, 16)]
    assert layout.region_size_bytes == 256


def test_layout_matches_a_per_block_loop():
    layout = KVLayout(
        num_layers=3,
        num_blocks=10,
        block_size_bytes=8,
        regions=(2,),
        kv_planes=2,
        block_stride_bytes=12,
        base_offset_bytes=5,
    )
    ids = [9, 0, 4]
    expected = [
        5 + layer * layout.layer_stride_bytes + plane * layout.kv_stride_bytes + b * 12
        for layer in range(3)
        for plane in range(2)
        for b in ids
    ]
    assert layout.descs(ids).offset.tolist() == expected


def test_layout_refuses_out_of_range_blocks_and_overlap():
    layout = KVLayout.packed(1, 2, 8, 16)
    with pytest.raises(kvx.ConfigError, match="out of range"):
        layout.descs([8])
    with pytest.raises(kvx.ConfigError, match="out of range"):
        layout.descs([0], layers=[2])
    with pytest.raises(kvx.ConfigError, match="overlap"):
        KVLayout(1, 4, 16, (1,), block_stride_bytes=8)
