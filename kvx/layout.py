"""KV-cache layouts: turn an engine's block ids into descriptor lists.

First version: ``num_layers`` layers, each with ``kv_planes`` planes (K and V;
1 for MLA caches), each plane ``num_blocks`` blocks of ``block_size_bytes``
spaced ``block_stride_bytes`` apart. A layer lives either in its own region
(one tensor per layer, as vLLM allocates) or at ``layer_stride_bytes`` steps
inside one shared region.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvx.descs import DESC_DTYPE, Descs, _as_u64, _region_id
from kvx.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size_bytes: int
    regions: tuple[int, ...]
    kv_planes: int = 2
    block_stride_bytes: int = 0
    kv_stride_bytes: int = 0
    layer_stride_bytes: int = 0
    base_offset_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size_bytes", "kv_planes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"KVLayout.{name} must be positive")
        if len(self.regions) not in (1, self.num_layers):
            raise ConfigError("KVLayout.regions must hold one region, or one per layer")
        # Zero strides mean "packed": blocks back to back, planes back to back.
        if not self.block_stride_bytes:
            object.__setattr__(self, "block_stride_bytes", self.block_size_bytes)
        if not self.kv_stride_bytes:
            object.__setattr__(self, "kv_stride_bytes", self.num_blocks * self.block_stride_bytes)
        if not self.layer_stride_bytes and len(self.regions) == 1:
            object.__setattr__(self, "layer_stride_bytes", self.kv_planes * self.kv_stride_bytes)
        if self.block_stride_bytes < self.block_size_bytes:
            raise ConfigError("KVLayout.block_stride_bytes is smaller than a block: blocks would overlap")

    @classmethod
    def packed(
        cls, region: Any, num_layers: int, num_blocks: int, block_size_bytes: int, *, kv_planes: int = 2
    ) -> KVLayout:
        """One region holding [layer][K/V][block] back to back."""
        return cls(num_layers, num_blocks, block_size_bytes, (int(_region_id(region)),), kv_planes)

    @classmethod
    def per_layer(
        cls, regions: Sequence[Any], num_blocks: int, block_size_bytes: int, *, kv_planes: int = 2
    ) -> KVLayout:
        """One region per layer, each holding [K/V][block] back to back."""
        ids = tuple(int(_region_id(r)) for r in regions)
        return cls(len(ids), num_blocks, block_size_bytes, ids, kv_planes)

    @property
    def region_size_bytes(self) -> int:
        """Bytes each region must have for this layout."""
        layers_in_region = self.num_layers if len(self.regions) == 1 else 1
        last_block = (
            self.base_offset_bytes
            + (layers_in_region - 1) * self.layer_stride_bytes
            + (self.kv_planes - 1) * self.kv_stride_bytes
            + (self.num_blocks - 1) * self.block_stride_bytes
        )
        return last_block + self.block_size_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for across all layers and planes."""
        return self.num_layers * self.kv_planes * self.block_size_bytes

    def descs(self, block_ids: Any, *, layers: Any = None) -> Descs:
        """Descriptors for the given blocks, ordered (layer, plane, block).

        ``layers`` restricts to some layers (layer-by-layer push).
        """
        ids = _as_u64(block_ids, "block_ids")
        if ids.size and int(ids.max()) >= self.num_blocks:
            raise ConfigError(f"block id {int(ids.max())} out of range (num_blocks={self.num_blocks})")
        layer_ids = (
            np.arange(self.num_layers, dtype=np.uint64) if layers is None else _as_u64(layers, "layers")
        )
        if layer_ids.size and int(layer_ids.max()) >= self.num_layers:
            raise ConfigError(f"layer {int(layer_ids.max())} out of range (num_layers={self.num_layers})")
        nl, nk, nb = layer_ids.size, self.kv_planes, ids.size
        in_plane = ids * np.uint64(self.block_stride_bytes) + np.uint64(self.base_offset_bytes)
        plane = np.arange(nk, dtype=np.uint64) * np.uint64(self.kv_stride_bytes)
        if len(self.regions) == 1:
            layer_off = layer_ids * np.uint64(self.layer_stride_bytes)
            # One region for every descriptor: a scalar that broadcasts into out["region"].
            region: np.uint64 | np.ndarray = np.uint64(self.regions[0])
        else:
            layer_off = np.zeros(nl, dtype=np.uint64)
            region = np.repeat(np.asarray(self.regions, dtype=np.uint64)[layer_ids.astype(np.intp)], nk * nb)
        out = np.zeros(nl * nk * nb, dtype=DESC_DTYPE)
        offsets = out["offset"].reshape(nl, nk, nb)
        np.add(layer_off[:, None, None] + plane[None, :, None], in_plane[None, None, :], out=offsets)
        out["region"] = region
        out["length"] = self.block_size_bytes
        return Descs(out)
