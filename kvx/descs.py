"""Descriptor lists: which bytes of which registered region a transfer moves.

A ``Descs`` wraps a numpy structured array of ``DESC_DTYPE``
``(region, offset, length)``. It is built with array operations, never one
Python object per block, and its packed little-endian layout is also the wire
format of the tcp backend, so a list goes onto the socket without conversion.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvx.errors import ConfigError

# Aligned (24 bytes: 4 padding bytes after region): filling 8-byte fields at
# unaligned addresses is several times slower. Lists are made with np.zeros so
# the padding never carries stray memory onto the wire.
DESC_DTYPE = np.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")], align=True)


def total_bytes(descs: np.ndarray) -> int:
    """Bytes a descriptor array covers. Short lists (the latency path) are
    summed in Python: a numpy reduction costs more than the few additions."""
    if len(descs) <= 16:
        return sum(descs["length"].tolist())
    return int(descs["length"].sum(dtype=np.uint64))


def _region_id(region: Any) -> Any:
    """Accept an int id, anything with an ``id`` (Region, RemoteRegion), or an id array."""
    rid = getattr(region, "id", region)
    if isinstance(rid, (int, np.integer)):
        if not 0 <= int(rid) < 1 << 32:
            raise ConfigError(f"region id out of range: {rid}")
        return int(rid)
    return _as_u64(rid, "region", limit=1 << 32)


def _as_u64(values: Any, what: str, limit: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise ConfigError(f"{what} must not be negative")
    if limit is not None and arr.size and int(arr.max()) >= limit:
        raise ConfigError(f"{what} out of range (at most {limit - 1})")
    return arr.astype(np.uint64, copy=False).ravel()


class Descs:
    """A list of (region, offset, length) descriptors.

    Build one with ``Descs.build``, ``Descs.from_blocks`` or ``KVLayout.descs``;
    wrap an existing structured array with ``Descs(array)``.
    """

    __slots__ = ("array",)
    array: np.ndarray

    def __init__(self, array: np.ndarray | Descs) -> None:
        if isinstance(array, Descs):
            array = array.array
        if not isinstance(array, np.ndarray) or array.dtype.names != DESC_DTYPE.names:
            raise ConfigError(
                "Descs needs a numpy structured array with fields (region, offset, length); "
                "use Descs.build(region, offsets, lengths) to make one"
            )
        if array.dtype != DESC_DTYPE:
            converted = np.zeros(array.shape, DESC_DTYPE)
            for name in ("region", "offset", "length"):
                converted[name] = array[name]
            array = converted
        self.array = array.ravel()

    @classmethod
    def build(cls, region: Any, offsets: Any, lengths: Any) -> Descs:
        """Descriptors from a region (id, Region or array of ids) and offset/length arrays.

        Scalars broadcast: ``Descs.build(r, offsets, 32768)``.
        """
        rid = _region_id(region)
        if (
            type(offsets) is int
            and type(lengths) is int
            and type(rid) is int
            and 0 <= offsets < 1 << 63
            and 0 <= lengths < 1 << 63
        ):
            # One descriptor from plain ints (the latency path, ``region.descs(off, n)``):
            # a tenth of the cost of the array path below, which gives the same list.
            one = np.zeros(1, dtype=DESC_DTYPE)
            one[0] = (rid, offsets, lengths)
            return cls(one)
        off = _as_u64(offsets, "offsets")
        length = _as_u64(lengths, "lengths")
        n = max(off.size, length.size, 1 if np.ndim(rid) == 0 else np.size(rid))
        out = np.zeros(n, dtype=DESC_DTYPE)
        try:
            out["region"] = rid
            out["offset"] = off
            out["length"] = length
        except ValueError as exc:
            raise ConfigError(f"region, offsets and lengths do not broadcast: {exc}") from None
        return cls(out)

    @classmethod
    def from_blocks(
        cls,
        region: Any,
        block_ids: Any,
        block_size_bytes: int,
        *,
        block_stride_bytes: int | None = None,
        base_offset_bytes: int = 0,
    ) -> Descs:
        """One descriptor per block: offset = base + id * stride, length = block size."""
        if block_size_bytes <= 0:
            raise ConfigError("block_size_bytes must be positive")
        stride = block_size_bytes if block_stride_bytes is None else block_stride_bytes
        ids = _as_u64(block_ids, "block_ids")
        out = np.zeros(ids.size, dtype=DESC_DTYPE)
        out["region"] = _region_id(region)
        np.multiply(ids, np.uint64(stride), out=out["offset"])
        if base_offset_bytes:
            out["offset"] += np.uint64(base_offset_bytes)
        out["length"] = block_size_bytes
        return cls(out)

    @classmethod
    def concat(cls, parts: list[Descs]) -> Descs:
        return cls(np.concatenate([Descs(p).array for p in parts]) if parts else np.zeros(0, DESC_DTYPE))

    @property
    def region(self) -> np.ndarray:
        return self.array["region"]

    @property
    def offset(self) -> np.ndarray:
        return self.array["offset"]

    @property
    def length(self) -> np.ndarray:
        return self.array["length"]

    @property
    def total_bytes(self) -> int:
        return total_bytes(self.array)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: Any) -> Descs:
        return Descs(np.atleast_1d(self.array[index]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Descs):
            return NotImplemented
        return bool(np.array_equal(self.array, other.array))

    def __repr__(self) -> str:
        return f"Descs({len(self)} descriptors, {self.total_bytes} bytes)"

    def coalesce(self) -> Descs:
        """Merge runs of descriptors that are adjacent in the same region.

        Order is kept: descriptor i+1 joins i only when it starts where i ends.
        """
        a = self.array
        if len(a) < 2:
            return self
        joins = (a["region"][1:] == a["region"][:-1]) & (
            a["offset"][1:] == a["offset"][:-1] + a["length"][:-1]
        )
        if not joins.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        out = np.zeros(len(starts), dtype=DESC_DTYPE)
        out["region"] = a["region"][starts]
        out["offset"] = a["offset"][starts]
        out["length"] = np.add.reduceat(a["length"], starts)
        return Descs(out)

    def split_at(self, positions: np.ndarray) -> tuple[Descs, np.ndarray]:
        """Cut the descriptors at byte positions of their concatenated stream.

        Returns the cut list and, for each position, the index of the first
        descriptor at or after it, so that ``cut[idx[k]:idx[k+1]]`` covers
        bytes ``positions[k]..positions[k+1]``.
        """
        a = self.array
        ends = np.cumsum(a["length"], dtype=np.uint64)
        starts = ends - a["length"]
        positions = np.asarray(positions, dtype=np.uint64)
        points = np.union1d(starts[a["length"] > 0], positions)
        total = ends[-1] if len(ends) else np.uint64(0)
        points = points[points < total]
        owner = np.searchsorted(ends, points, side="right")
        out = np.zeros(len(points), dtype=DESC_DTYPE)
        out["region"] = a["region"][owner]
        out["offset"] = a["offset"][owner] + (points - starts[owner])
        out["length"] = np.diff(np.append(points, total))
        return Descs(out), np.searchsorted(points, positions, side="left")
