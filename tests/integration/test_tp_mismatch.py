"""Prefill and decode with different tensor parallelism, at agent level.

Agents stand in for ranks; each "rank" holds a paged cache shaped like
vLLM's CPU cache with the head-major layout ([blocks, K/V, heads, tokens,
head_dim]) filled with values that encode (layer, plane, global head, block,
token, dim). Decode ranks read with the plans of
``kvx.connectors.kvcache.plan_read`` and every byte of every destination
block is checked against what the global head it should hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvx.connectors.kvcache import (
    LayerGeometry,
    RankCache,
    contiguous_runs,
    head_owner,
    layer_geometry,
    plan_read,
    rank_heads,
)

LAYERS, BLOCKS, TOKENS, DIM = 2, 16, 4, 8
TOTAL_HEADS = 4


def make_rank_cache(agent, rank: int, tp: int, fill: bool, mla: bool = False):
    heads = 1 if mla else len(rank_heads(rank, tp, TOTAL_HEADS))
    planes = 1 if mla else 2
    # One storage for all layers, as vLLM allocates it; per layer [B, planes, H, N, D] int32.
    storage = np.zeros((LAYERS, BLOCKS, planes, heads, TOKENS, DIM), dtype=np.int32)
    if fill:
        glob = [0] if mla else rank_heads(rank, tp, TOTAL_HEADS)
        layer, b, p, h, n, d = np.indices(storage.shape)
        g = np.asarray(glob)[h]
        storage[...] = ((((layer * 2 + p) * 16 + g) * 64 + b) * 16 + n) * 16 + d + 1
    region = agent.register(storage)
    layers = []
    for layer in range(LAYERS):
        view = storage[layer]
        layers.append(
            layer_geometry(
                view.shape,
                [s // 4 for s in view.strides],
                4,
                view.ctypes.data - storage.ctypes.data,
                region.id,
                BLOCKS,
                heads,
                TOKENS * DIM,
                head_axis=None if mla else 2,  # [B, planes, H, N, D]: said, not guessed
            )
        )
    return storage, RankCache(tuple(layers), BLOCKS, heads, planes)


def expected(layer: int, plane: int, g: int, block: int) -> np.ndarray:
    n, d = np.indices((TOKENS, DIM))
    return ((((layer * 2 + plane) * 16 + g) * 64 + block) * 16 + n) * 16 + d + 1


@pytest.mark.parametrize(
    "prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (8, 2)]
)
def test_decode_ranks_read_exactly_their_heads(make_agent, prefill_tp: int, decode_tp: int) -> None:
    prefill = []
    for r in range(prefill_tp):
        agent = make_agent(f"p{r}")
        storage, cache = make_rank_cache(agent, r, prefill_tp, fill=True)
        prefill.append((agent, storage, cache))
    remote_blocks = [3, 9, 4, 15, 0]
    local_blocks = [1, 2, 7, 8, 12]
    for d in range(decode_tp):
        agent = make_agent(f"d{d}")
        storage, cache = make_rank_cache(agent, d, decode_tp, fill=False)
        peers = {r: agent.add_peer(p[0].metadata()) for r, p in enumerate(prefill)}
        plans = plan_read(
            cache, d, decode_tp, prefill[0][2], prefill_tp, TOTAL_HEADS, local_blocks, remote_blocks
        )
        for rank, (local, remote) in plans.items():
            peers[rank].read(local, remote).wait(10)
        for layer in range(LAYERS):
            for plane in range(2):
                for h, g in enumerate(rank_heads(d, decode_tp, TOTAL_HEADS)):
                    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
                        assert np.array_equal(storage[layer, lb, plane, h], expected(layer, plane, g, rb)), (
                            layer,
                            plane,
                            g,
                            lb,
                            rb,
                        )
        untouched = [b for b in range(BLOCKS) if b not in local_blocks]
        assert not storage[:, untouched].any(), "a block outside the request was written"


def test_replicated_mla_cache_is_read_from_one_rank(make_agent) -> None:
    prefill = []
    for r in range(2):
        agent = make_agent(f"p{r}")
        storage, cache = make_rank_cache(agent, r, 2, fill=True, mla=True)
        prefill.append((agent, storage, cache))
    agent = make_agent("d0")
    storage, cache = make_rank_cache(agent, 0, 1, fill=False, mla=True)
    plans = plan_read(cache, 0, 1, prefill[0][2], 2, TOTAL_HEADS, [5], [6], replicated=True)
    assert list(plans) == [0]
    local, remote = plans[0]
    agent.add_peer(prefill[0][0].metadata()).read(local, remote).wait(10)
    assert np.array_equal(storage[:, 5], prefill[0][1][:, 6])


def test_head_ownership() -> None:
    assert [head_owner(g, 2, 4) for g in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [head_owner(g, 8, 4) for g in range(4)] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert [rank_heads(r, 8, 4) for r in range(8)] == [[0], [0], [1], [1], [2], [2], [3], [3]]


def test_geometry_of_vllm_cpu_cache() -> None:
    # vLLM 0.32's CPU cache for 2 KV heads, block 128, head 64: [blocks, 2, 128, 128] bf16.
    # Each head keeps its K (the first 8,192 elements) and V together: plane-major units are
    # K of head 0, K of head 1, V of head 0, V of head 1.
    g = layer_geometry((5988, 2, 128, 128), (32768, 16384, 128, 1), 2, 0, 7, 5988, 2, 128 * 64)
    assert g.block_stride == 65536 and g.unit_bytes == 16384 and g.heads_known
    assert g.unit_offsets == (0, 32768, 16384, 49152)
    # K and V outermost (flash-attention style): [2, blocks, heads, tokens, dim].
    g = layer_geometry((2, 10, 2, 16, 8), (2560, 256, 128, 8, 1), 2, 0, 1, 10, 2, 128)
    assert g.block_stride == 512 and g.unit_offsets == (0, 256, 5120, 5376)


def test_contiguous_runs() -> None:
    assert contiguous_runs((2, 3), (3, 1)) == [(0, 6)]
    assert contiguous_runs((2, 3), (10, 1)) == [(0, 3), (10, 3)]


def test_bad_geometry_is_refused() -> None:
    from kvx.errors import ConfigError

    with pytest.raises(ConfigError, match="num_blocks"):
        layer_geometry((4, 2, 8), (16, 8, 1), 2, 0, 1, 5, 1, 8)
    with pytest.raises(ConfigError, match="units"):
        layer_geometry((5, 2, 6), (12, 6, 1), 2, 0, 1, 5, 1, 8)


def test_units_of_a_cpu_shaped_cache_hold_the_heads_they_claim() -> None:
    """vLLM's CPU cache per layer is [blocks, heads, tokens, 2 x head_size] (each head's K then
    V): read through the geometry, unit (plane p, head h) holds exactly that plane of that head."""
    blocks, heads, tokens, dim = 6, 4, 8, 16
    cache = np.zeros((blocks, heads, tokens * 2, dim), np.int32)
    b, h, row, _ = np.indices(cache.shape)
    cache[...] = (b * 100 + h) * 10 + row // tokens  # block, head, plane (K rows, then V rows)
    cache = cache.reshape(blocks, heads, tokens, 2 * dim)
    g = layer_geometry(cache.shape, [s // 4 for s in cache.strides], 4, 0, 1, blocks, heads, tokens * dim)
    raw = cache.reshape(-1).view(np.uint8)
    for block in range(blocks):
        for unit, offset in enumerate(g.unit_offsets):
            plane, head = divmod(unit, heads)
            at = block * g.block_stride + offset
            got = raw[at : at + g.unit_bytes].view(np.int32)
            assert (got == (block * 100 + head) * 10 + plane).all(), (block, unit)


def test_a_cache_whose_heads_cannot_be_told_from_its_planes_serves_equal_tp_only() -> None:
    from kvx.errors import ConfigError

    # [B, 2, 2, N, D]: a K/V axis and a head axis of two entries each, both inside the block.
    g = layer_geometry((6, 2, 2, 8, 16), (512, 256, 128, 16, 1), 4, 0, 1, 6, 2, 128)
    assert not g.heads_known and g.unit_offsets == (0, 512, 1024, 1536)  # memory order
    said = layer_geometry((6, 2, 2, 8, 16), (512, 256, 128, 16, 1), 4, 0, 1, 6, 2, 128, head_axis=2)
    assert said.heads_known and said.unit_offsets == (0, 512, 1024, 1536)
    unknown = RankCache((g,), 6, 2, 2)
    half = RankCache((layer_geometry((6, 2, 8, 16), (256, 128, 16, 1), 4, 0, 1, 6, 1, 128),), 6, 1, 2)
    assert len(plan_read(unknown, 0, 1, unknown, 1, 2, [1, 2], [3, 4])) == 1  # equal TP: all units
    with pytest.raises(ConfigError, match="same tensor parallelism"):
        plan_read(unknown, 0, 1, half, 2, 2, [1], [3])
    # Round trip through the handshake document.
    assert LayerGeometry.from_json(g.to_json()) == g
    assert LayerGeometry.from_json(
        {k: v for k, v in said.to_json().items() if k != "heads_known"}
    ).heads_known


def test_a_token_major_block_is_never_taken_for_head_major() -> None:
    """A block laid out tokens-then-heads ([B, N, H, C]) seen through a [B, H, N, C] view: with
    as many tokens per block as heads, its token axis looks like a head axis from its size
    and stride alone. A unit there spans several heads, so the heads are marked unknown."""
    heads = tokens = 4
    dim = 8
    # The view's H axis has stride 2 * dim (heads innermost), its N axis stride heads * 2 * dim.
    shape = (6, heads, tokens, 2 * dim)
    strides = (tokens * heads * 2 * dim, 2 * dim, heads * 2 * dim, 1)
    assert not layer_geometry(shape, strides, 2, 0, 1, 6, heads, tokens * dim).heads_known
    # Head-major with as many tokens as heads: also unknown (safe: equal TP only).
    shape = (6, heads, tokens, 2 * dim)
    strides = (heads * tokens * 2 * dim, tokens * 2 * dim, 2 * dim, 1)
    assert not layer_geometry(shape, strides, 2, 0, 1, 6, heads, tokens * dim).heads_known
