"""Paged KV caches as kvx sees them: block geometry and tensor-parallel plans.

An engine rank holds, per attention layer, a paged cache of ``num_blocks``
blocks. kvx describes one block of one layer as ``planes x heads`` *units*
(planes: K and V, or 1 for MLA; heads: this rank's KV heads), each unit
``unit_bytes`` long at a fixed offset from the block's start. With a
head-major block interior (vLLM's ``LBHNC``/HND) a unit is one head's tokens
of one plane, so a decode rank whose tensor-parallel size differs from
prefill's reads exactly its own heads from the prefill rank that holds them.

Everything here is plain numbers and numpy: the connectors fill it in from
their engine's tensors, and the tests check the plans byte for byte with
agents standing in for ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvx.descs import DESC_DTYPE, Descs
from kvx.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """Where one layer's blocks live inside a registered region."""

    region: int  # region id (the owner's)
    base_offset: int  # bytes from the region start to block 0
    block_stride: int  # bytes from one block to the next
    unit_offsets: tuple[int, ...]  # bytes from a block's start to each unit, plane-major
    unit_bytes: int
    # False when the tensor's shape did not say which unit holds which head (a K/V axis and
    # a head axis of the same size): the units are then in memory order, and only a peer of
    # the same tensor parallelism, which reads them all, may use them.
    heads_known: bool = True

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"unit_offsets": list(self.unit_offsets)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerGeometry:
        try:
            heads_known = d.get("heads_known", True)
            if not isinstance(heads_known, bool):
                raise TypeError(f"heads_known is {heads_known!r}")
            return cls(
                int(d["region"]),
                int(d["base_offset"]),
                int(d["block_stride"]),
                tuple(int(x) for x in d["unit_offsets"]),
                int(d["unit_bytes"]),
                heads_known,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed layer geometry {d!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class RankCache:
    """One rank's whole cache: its layers (in model order), heads and planes."""

    layers: tuple[LayerGeometry, ...]
    num_blocks: int
    num_heads: int  # KV heads on this rank
    planes: int  # 2 (K and V) or 1 (MLA)

    def __post_init__(self) -> None:
        for layer in self.layers:
            if len(layer.unit_offsets) != self.planes * self.num_heads:
                raise ConfigError(
                    f"a layer has {len(layer.unit_offsets)} units, expected "
                    f"{self.planes} planes x {self.num_heads} heads"
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": [g.to_json() for g in self.layers],
            "num_blocks": self.num_blocks,
            "num_heads": self.num_heads,
            "planes": self.planes,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankCache:
        try:
            return cls(
                tuple(LayerGeometry.from_json(g) for g in d["layers"]),
                int(d["num_blocks"]),
                int(d["num_heads"]),
                int(d["planes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed cache description: {exc}") from None


def contiguous_runs(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) runs, in elements and memory order, that cover a strided view."""
    dims = sorted(((s, st) for s, st in zip(shape, strides, strict=True) if s != 1), key=lambda d: -d[1])
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if not dims:
        return [(0, run)]
    outer = [range(0, s * st, st) for s, st in dims]
    return sorted((sum(offs), run) for offs in itertools.product(*outer))


def layer_geometry(
    shape: Sequence[int],
    strides: Sequence[int],
    elem_bytes: int,
    offset_bytes: int,
    region: int,
    num_blocks: int,
    num_heads: int,
    unit_elems: int,
    head_axis: int | None = None,
) -> LayerGeometry:
    """The geometry of one layer tensor (shape and strides in elements).

    The block dimension is the one of size ``num_blocks`` with the largest
    stride; the rest of the tensor, one block's worth, is cut into units of
    ``unit_elems`` elements (block_size x head_size), listed plane-major
    (all heads' K, then all heads' V). Which unit holds which head comes
    from the head axis: ``head_axis`` when given, else the one dimension of
    ``num_heads`` entries that lies outside a unit and inside a block (vLLM's
    CPU cache ``[blocks, heads, tokens, 2 x head_size]`` keeps each head's K
    and V together; flash-attention's ``[2, blocks, heads, tokens,
    head_size]`` keeps all K apart from all V).
    """
    candidates = [i for i, s in enumerate(shape) if s == num_blocks]
    if not candidates:
        raise ConfigError(f"no dimension of the KV cache {tuple(shape)} has num_blocks={num_blocks} entries")
    bdim = max(candidates, key=lambda i: strides[i])
    rest_shape = [s for i, s in enumerate(shape) if i != bdim]
    rest_strides = [st for i, st in enumerate(strides) if i != bdim]
    runs = contiguous_runs(rest_shape, rest_strides)
    units: list[int] = []
    for off, length in runs:
        if length % unit_elems:
            raise ConfigError(
                f"KV cache {tuple(shape)} strides {tuple(strides)}: a contiguous run of "
                f"{length} elements is not a whole number of {unit_elems}-element units"
            )
        units.extend(off + k * unit_elems for k in range(length // unit_elems))
    if len(units) % num_heads:
        raise ConfigError(
            f"KV cache {tuple(shape)}: {len(units)} units per block do not split into {num_heads} heads"
        )
    ordered, heads_known = _plane_major(units, shape, strides, bdim, num_heads, unit_elems, head_axis)
    return LayerGeometry(
        region,
        offset_bytes,
        strides[bdim] * elem_bytes,
        tuple(u * elem_bytes for u in ordered),
        unit_elems * elem_bytes,
        heads_known,
    )


def _plane_major(
    units: list[int],
    shape: Sequence[int],
    strides: Sequence[int],
    bdim: int,
    num_heads: int,
    unit_elems: int,
    head_axis: int | None,
) -> tuple[list[int], bool]:
    """``units`` (memory order) as plane-major (plane, head) order, and whether
    the head of each unit was known."""
    if num_heads == 1 or len(units) == num_heads:
        return units, True  # one head, or one plane: memory order is that order
    if head_axis is None:
        block_stride = strides[bdim]
        sized = [
            (i, stride)
            for i, (size, stride) in enumerate(zip(shape, strides, strict=True))
            if i != bdim and size == num_heads and stride < block_stride
        ]
        candidates = [i for i, stride in sized if stride >= unit_elems]
        # Exactly one axis of num_heads entries between a unit and a block; and none inside a
        # unit, where a token-major block (heads innermost) would put it and where a unit then
        # spans several heads (with as many tokens per block as heads, its token axis would
        # pass for the head axis).
        if len(candidates) != 1 or len(sized) != 1:
            return units, False
        head_axis = candidates[0]
    stride = strides[head_axis]
    # A unit's head from its offset; its plane is its rank among the units of that head.
    seen: dict[int, int] = {}
    keyed = []
    for u in units:
        head = (u // stride) % num_heads
        plane = seen.get(head, 0)
        seen[head] = plane + 1
        keyed.append(((plane, head), u))
    if len(set(seen.values())) != 1:
        return units, False
    return [u for _, u in sorted(keyed)], True


def head_owner(global_head: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """(rank, local head index) of the first rank holding ``global_head``.

    vLLM shards KV heads evenly; with more ranks than heads each head is
    replicated over ``tp_size // total_heads`` consecutive ranks.
    """
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return global_head // per_rank, global_head % per_rank
    return global_head * (tp_size // total_heads), 0


def rank_heads(rank: int, tp_size: int, total_heads: int) -> list[int]:
    """The global KV heads rank ``rank`` holds."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank * total_heads // tp_size]


def plan_read(
    local: RankCache,
    local_rank: int,
    local_tp: int,
    remote: RankCache,
    remote_tp: int,
    total_heads: int,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    *,
    replicated: bool = False,
) -> dict[int, tuple[Descs, Descs]]:
    """Descriptor pairs, per remote rank, that fill ``local_blocks`` of this
    rank from ``remote_blocks`` of the remote ranks.

    ``replicated`` caches (MLA) hold the same bytes on every rank: read the
    whole blocks from one remote rank (spread over ranks by ``local_rank``).
    """
    if len(local_blocks) != len(remote_blocks):
        raise ConfigError(f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote blocks")
    if len(local.layers) != len(remote.layers) or local.planes != remote.planes:
        raise ConfigError(
            f"caches differ: {len(local.layers)} layers x {local.planes} planes here, "
            f"{len(remote.layers)} x {remote.planes} remote"
        )
    if (
        not replicated
        and local_tp != remote_tp
        and not all(g.heads_known for g in (*local.layers, *remote.layers))
    ):
        raise ConfigError(
            "the KV cache's shape does not say which head each unit holds (its K/V axis and head "
            "axis have the same size), so a peer of another tensor parallelism cannot read its "
            f"heads: run both engines at the same tensor parallelism (here {local_tp} and {remote_tp})"
        )
    if local.layers and remote.layers and local.layers[0].unit_bytes != remote.layers[0].unit_bytes:
        raise ConfigError(
            f"cache units differ: {local.layers[0].unit_bytes} bytes here, "
            f"{remote.layers[0].unit_bytes} remote (block size or head size differ)"
        )
    lb = np.asarray(local_blocks, dtype=np.uint64)
    rb = np.asarray(remote_blocks, dtype=np.uint64)
    # (remote rank) -> list of (local unit index, remote unit index)
    pairs: dict[int, list[tuple[int, int]]] = {}
    if replicated:
        num_units = local.planes * local.num_heads
        pairs[local_rank % remote_tp] = [(u, u) for u in range(num_units)]
    else:
        for local_head, g in enumerate(rank_heads(local_rank, local_tp, total_heads)):
            rank, remote_head = head_owner(g, remote_tp, total_heads)
            for p in range(local.planes):
                pairs.setdefault(rank, []).append(
                    (p * local.num_heads + local_head, p * remote.num_heads + remote_head)
                )
    out: dict[int, tuple[Descs, Descs]] = {}
    for rank, units in sorted(pairs.items()):
        out[rank] = (_descs(local, lb, [u for u, _ in units]), _descs(remote, rb, [u for _, u in units]))
    return out


def _descs(cache: RankCache, blocks: np.ndarray, units: list[int]) -> Descs:
    """Descriptors ordered (layer, unit, block); both sides use the same order."""
    n = len(cache.layers) * len(units) * blocks.size
    out = np.zeros(n, dtype=DESC_DTYPE)
    if n == 0:
        return Descs(out)
    per_layer = len(units) * blocks.size
    for i, g in enumerate(cache.layers):
        unit_off = np.asarray([g.unit_offsets[u] for u in units], dtype=np.uint64)
        block_off = blocks * np.uint64(g.block_stride) + np.uint64(g.base_offset)
        sl = slice(i * per_layer, (i + 1) * per_layer)
        out["offset"][sl] = (unit_off[:, None] + block_off[None, :]).reshape(-1)
        out["region"][sl] = g.region
        out["length"][sl] = g.unit_bytes
    return Descs(out)
