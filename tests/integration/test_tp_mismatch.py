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
    g = layer_geometry((5988, 2, 128, 128), (32768, 16384, 128, 1), 2, 0, 7, 5988, 2, 128 * 64)
    assert g.block_stride == 65536 and g.unit_bytes == 16384
    assert g.unit_offsets == (0, 16384, 32768, 49152)
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
