"""Registered memory: regions, and the table that guards every access.

Every byte a peer touches goes through ``RegionTable.resolve`` (or a C call
that does its checks): it checks each descriptor against the registered
bounds and access rights (vectorised), and pins the regions it names until
the access is released, so that ``deregister`` can wait until no transfer
that might touch a region is left.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvx._datapath import gpu, shared
from kvx._datapath import io as _io
from kvx.descs import DESC_DTYPE, Descs
from kvx.errors import AccessError, ConfigError, RegionBusyError, RegionError

logger = logging.getLogger(__name__)

# Region ids are never reused within an epoch, and index dense arrays.
MAX_REGION_ID = 1 << 20

# Per-region flag bits in RegionTable._flags.
VALID = 1
REMOTE_READ = 2
REMOTE_WRITE = 4
LOCAL_WRITE = 8
DEVICE = 16  # CUDA memory: bytes move through kvx._datapath.gpu, never through a host pointer
REMOTE_IPC = 32  # a peer's CUDA region that it offers through CUDA IPC


class MemoryKind(enum.Enum):
    HOST = "host"
    CUDA = "cuda"


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """A registered local memory range."""

    id: int
    address: int
    size_bytes: int
    memory_kind: MemoryKind
    device: int
    remote_read: bool
    remote_write: bool
    writable: bool
    owner: Any = dataclasses.field(repr=False, default=None)  # keeps the memory alive
    # CUDA IPC handle of the allocation holding a CUDA region (b"": none), and
    # the region's offset in that allocation.
    ipc_handle: bytes = dataclasses.field(repr=False, default=b"")
    ipc_offset: int = 0
    # Host memory from kvx.alloc_shared: its segment's descriptor (-1: none)
    # and the region's offset in it.
    segment_fd: int = -1
    segment_offset: int = 0

    def descs(self, offsets: Any, lengths: Any) -> Descs:
        return Descs.build(self.id, offsets, lengths)


@dataclasses.dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered region, as its metadata describes it."""

    id: int
    size_bytes: int
    memory_kind: MemoryKind
    device: int
    address: int
    remote_read: bool
    remote_write: bool

    def descs(self, offsets: Any, lengths: Any) -> Descs:
        return Descs.build(self.id, offsets, lengths)


def describe_memory(obj: Any, device: int | None = None) -> tuple[int, int, bool, Any] | gpu.CudaMemory:
    """(address, size_bytes, writable, keep-alive object) of host memory
    ``obj``; for CUDA memory (or a raw range with ``device``), its
    kvx._datapath.gpu.CudaMemory."""
    if isinstance(obj, tuple):
        if len(obj) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in obj):
            raise ConfigError("raw memory is registered as an (address, size_bytes) tuple of ints")
        address, size = obj
        if address <= 0 or size <= 0 or address + size >= 1 << 64:
            raise ConfigError(f"invalid raw memory range: address={address:#x} size={size}")
        if device is not None:
            if not isinstance(device, int) or isinstance(device, bool) or device < 0:
                raise ConfigError(f"device must be a CUDA device index (0, 1, ...), not {device!r}")
            return gpu.describe(obj, device)
        return address, size, True, None
    if gpu.is_cuda(obj):
        return gpu.describe(obj, device)
    if device is not None:
        raise ConfigError(f"device={device} is for CUDA memory; {type(obj).__name__} is host memory")
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise ConfigError("register a contiguous tensor (tensor.contiguous())")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), True, obj
    if isinstance(obj, np.ndarray):
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise ConfigError("register a contiguous array (np.ascontiguousarray)")
        return int(obj.ctypes.data), int(obj.nbytes), bool(obj.flags.writeable), obj
    try:
        view = memoryview(obj)
    except TypeError:
        raise ConfigError(
            f"cannot register {type(obj).__name__}: pass a numpy array, bytearray, memoryview, "
            "mmap, torch CPU tensor or (address, size_bytes)"
        ) from None
    if not view.contiguous:
        raise ConfigError("register a contiguous buffer")
    arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.zeros(0, np.uint8)
    return int(arr.ctypes.data), int(view.nbytes), not view.readonly, arr


class RegionTable:
    """Thread-safe table of registered regions, indexed by region id."""

    def __init__(self, max_regions: int) -> None:
        self._max_regions = max_regions
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # deregister waits on it
        self._regions: dict[int, Region] = {}
        self._base = np.zeros(64, dtype=np.uint64)
        self._size = np.zeros(64, dtype=np.uint64)
        self._flags = np.zeros(64, dtype=np.uint8)
        self._device = np.full(64, -1, dtype=np.int32)
        # The four arrays as one tuple, replaced whole when they grow: what
        # pin_table hands out without the lock is always one generation.
        self._tables = (self._base, self._size, self._flags, self._device)
        self._cuda = 0  # CUDA regions registered
        self._next_id = 1  # id 0 never names a region: a zeroed descriptor is caught
        # Pins: token -> None (the whole table: a pin_table without ids, which a
        # deregistration that started after it need not wait for), the one
        # region a lease holds (a same-host peer's pin that outlives transfers),
        # or the regions a pin names (a frozenset from pin_regions, a tuple from
        # resolve or pin_table(ids): a deregistration waits for it only if it
        # names the region). pin_table and release change it without the lock
        # (each a single dict operation, atomic under the GIL): read it whole
        # (.copy()).
        self._active: dict[int, int | frozenset[int] | tuple[int, ...] | None] = {}
        # Called with a region id when its deregistration starts (outside the
        # lock): the listener revokes the leases on it (Listener.revoke).
        self.on_remove: Callable[[int], None] | None = None
        self._removing: set[int] = set()
        self._tokens = itertools.count(1)
        self._waiters = 0
        # Region id -> the key under which a NIC lets peers touch it (the rdma
        # backend sets it once the region is registered with its endpoint).
        self._remote_keys: dict[int, bytes] = {}
        # Regions whose keys went out in a pin's answer (a peer may hold them).
        self._keys_out: set[int] = set()

    def __len__(self) -> int:
        return len(self._regions)

    def regions(self) -> list[Region]:
        with self._cond:
            return list(self._regions.values())

    @property
    def has_cuda(self) -> bool:
        """Some registered region is CUDA memory."""
        return bool(self._cuda)

    def get(self, region_id: int) -> Region | None:
        return self._regions.get(region_id)

    def add(self, obj: Any, *, remote_access: bool, device: int | None = None) -> Region:
        described = describe_memory(obj, device)
        if isinstance(described, gpu.CudaMemory):
            address, size, writable, owner = (
                described.address,
                described.size,
                described.writable,
                described.owner,
            )
            kind, device, ipc = (
                MemoryKind.CUDA,
                described.device,
                (described.ipc_handle, described.ipc_offset),
            )
        else:
            address, size, writable, owner = described
            kind, device, ipc = MemoryKind.HOST, -1, (b"", 0)
        segment = shared.find(address, size) if kind is MemoryKind.HOST else None
        if size <= 0:
            raise RegionError("cannot register an empty buffer")
        with self._cond:
            if len(self._regions) >= self._max_regions:
                raise RegionError(f"too many registered regions (Limits.max_regions={self._max_regions})")
            rid = self._next_id
            if rid >= MAX_REGION_ID:
                raise RegionError(
                    f"{MAX_REGION_ID} registrations in this epoch: region ids exhausted "
                    "(they are never reused); restart the agent"
                )
            self._next_id += 1
            region = Region(
                rid,
                address,
                size,
                kind,
                device,
                remote_access,
                remote_access and writable,
                writable,
                owner,
                *ipc,
                *(segment or (-1, 0)),
            )
            if rid >= len(self._flags):
                grow = max(rid + 1, 2 * len(self._flags))
                self._base = np.resize(self._base, grow)
                self._size = np.resize(self._size, grow)
                self._flags = np.concatenate([self._flags, np.zeros(grow - len(self._flags), np.uint8)])
                self._device = np.concatenate([self._device, np.full(grow - len(self._device), -1, np.int32)])
                self._tables = (self._base, self._size, self._flags, self._device)
            self._base[rid] = address
            self._size[rid] = size
            self._device[rid] = device
            self._cuda += kind is MemoryKind.CUDA
            self._flags[rid] = (
                VALID
                | (REMOTE_READ if region.remote_read else 0)
                | (REMOTE_WRITE if region.remote_write else 0)
                | (LOCAL_WRITE if writable else 0)
                | (DEVICE if kind is MemoryKind.CUDA else 0)
            )
            self._regions[rid] = region
            return region

    def remove(self, region: Region | int, timeout_s: float) -> Region:
        """Deregister; waits for accesses that started before, and for the
        leases peers hold on it (revoked through ``on_remove``), up to
        timeout_s. Returns the region that was removed, still holding its
        memory: the caller lets go of it (``let_go``) once nothing else can
        reach the memory."""
        rid = region.id if isinstance(region, Region) else int(region)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if rid not in self._regions:
                raise RegionError(f"region {rid} is not registered")
            if rid in self._removing:
                raise RegionBusyError(f"region {rid} is being deregistered by another thread")
            self._removing.add(rid)
            saved = self._flags[rid]
            self._flags[rid] = 0  # no new access can resolve against it from here on
            try:
                # Whole, and in C (dict.copy runs no Python code, so no other
                # thread runs meanwhile): pins come and go without the lock.
                pins = self._active.copy()
            except BaseException:
                self._flags[rid] = saved
                self._removing.discard(rid)
                raise
            before = {t for t, held in pins.items() if held is None}
            leased = any(held == rid for held in pins.values())
        if leased and self.on_remove is not None:
            try:
                self.on_remove(rid)  # the holders give their leases back (release)
            except Exception:  # the wait below still guards the memory
                logger.exception("revoking the leases on region %d failed", rid)
        with self._cond:
            self._waiters += 1
            try:
                while any(
                    held == rid
                    or (held is None and token in before)
                    or (isinstance(held, (frozenset, tuple)) and rid in held)
                    for token, held in self._active.copy().items()
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._flags[rid] = saved
                        raise RegionBusyError(
                            f"region {rid} still has transfers in flight, or a peer that has not given "
                            f"back its lease on it, after {timeout_s}s; wait for them (Transfer.wait) "
                            "and deregister again"
                        )
                    self._cond.wait(left)
            finally:
                self._waiters -= 1
                self._removing.discard(rid)
            removed = self._regions.pop(rid)
            self._remote_keys.pop(rid, None)
            self._base[rid] = 0
            self._size[rid] = 0
            self._device[rid] = -1
            self._cuda -= removed.memory_kind is MemoryKind.CUDA
        return removed

    @staticmethod
    def let_go(region: Region) -> None:
        """Drop the reference that kept a removed region's memory alive (a
        handle the caller keeps must not pin it). Only once nothing can reach
        the memory any more: after the backends closed what let a peer touch
        it (a NIC's registration)."""
        object.__setattr__(region, "owner", None)

    def set_remote_keys(self, region_id: int, keys: list[int]) -> None:
        """The keys peers name the region by on the NICs, one per rail (the
        rdma backend's memory registrations); handed out only with a pin
        (``remote_keys``)."""
        packed = np.array(keys, "<u8").tobytes()
        with self._lock:
            if region_id in self._regions:
                self._remote_keys[region_id] = packed
                self._keys_out.discard(region_id)

    def take_keys_out(self, region_id: int) -> bool:
        """Whether the region's keys ever went out in a pin's answer (so a peer
        may still hold them); forgets it. The rdma backend asks on deregister."""
        with self._lock:
            if region_id in self._keys_out:
                self._keys_out.discard(region_id)
                return True
            return False

    def remote_keys(self, ids: np.ndarray, who: str) -> bytes:
        """Per region its NIC keys (uint64, one per rail). Call with the regions pinned."""
        with self._lock:
            keys = [self._remote_keys.get(rid) for rid in ids.tolist()]
            self._keys_out.update(rid for rid, k in zip(ids.tolist(), keys, strict=True) if k is not None)
        if None in keys:
            rid = ids.tolist()[keys.index(None)]
            raise AccessError(
                f"{who}: region {rid} is not registered with this agent's rdma endpoint (its "
                "registration failed, see the agent's log, or the agent offers no rdma)"
            )
        return b"".join(k for k in keys if k is not None)

    def resolve(self, descs: np.ndarray, need: int, who: str) -> tuple[Any, Any, int, int]:
        """Check descriptors and pin their regions: (addresses, lengths, total bytes, token).

        ``need`` is the flag bits every region must carry; ``who`` names the
        side in error messages ("remote read", "local destination", ...).
        Addresses and lengths are uint64 buffers (numpy arrays, or
        ``array.array("Q")`` for short lists, which are cheaper to build).
        Call ``release(token)`` when the bytes have moved. The pin holds back
        the deregistration of these regions only: a transfer that lasts (a
        peer trickling a WRITE's data) stalls no other region's.
        """
        with self._lock:
            if len(descs) <= SMALL_LIST:
                rows = descs.tolist()
                if _small_ok(rows, self._flags, self._size, need | VALID):
                    base = self._base
                    small_addrs = array.array("Q", [int(base[r]) + o for r, o, _ in rows])
                    small_lens = array.array("Q", [n for _, _, n in rows])
                    return small_addrs, small_lens, sum(small_lens), self._pin({r for r, _, _ in rows})
            check_descs(descs, self._flags, self._size, need, who)
            ids = descs["region"]
            addrs = self._base[ids] + descs["offset"]
            lens = np.ascontiguousarray(descs["length"])
            return addrs, lens, int(lens.sum(dtype=np.uint64)), self._pin(np.unique(ids).tolist())

    def device_of(self, descs: np.ndarray, who: str) -> int:
        """The CUDA device every descriptor's region is on, or -1 for host
        memory; call with the table pinned (after ``resolve``). A list that
        mixes host and device memory, or two devices, is refused."""
        if not self._cuda:
            return -1
        return one_device(self._device[descs["region"]], who)

    def ipc_export(self, ids: np.ndarray, who: str) -> bytes:
        """Per region: its offset in its CUDA allocation (uint64) and the
        allocation's IPC handle (64 bytes). Call with the regions pinned."""
        out = []
        for rid in ids.tolist():
            region = self._regions.get(rid)
            if region is None or not region.ipc_handle:
                raise AccessError(
                    f"{who}: region {rid} cannot be opened through CUDA IPC (it is host memory, "
                    "or CUDA memory that cannot be shared: cudaMallocAsync pools, VMM allocations)"
                )
            out.append(region.ipc_offset.to_bytes(8, "little") + region.ipc_handle.ljust(64, b"\0")[:64])
        return b"".join(out)

    def pin_regions(self, ids: np.ndarray, need: int, who: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Check that each region exists and carries the ``need`` flags, and pin
        the table: (base addresses, sizes, token); ``release(token)`` after.

        For a peer that moves the bytes itself (shm) and checks its
        descriptors against these sizes: a region's size never changes while
        its id lives, and ids are never reused within an epoch. The pin holds
        back the deregistration of these regions only: a peer that keeps it
        cannot stall that of any other region.
        """
        with self._lock:
            if len(ids) and int(ids.max()) >= len(self._flags):
                raise AccessError(f"{who}: unknown region {int(ids.max())}")
            bad = (self._flags[ids] & (need | VALID)) != (need | VALID)
            if bad.any():
                rid = int(ids[int(np.argmax(bad))])
                flags = int(self._flags[rid])
                if not flags & VALID:
                    raise AccessError(f"{who}: unknown region {rid}")
                raise AccessError(
                    f"{who}: region {rid} does not allow this access ({_describe_flags(flags)})"
                )
            token = next(self._tokens)
            self._active[token] = frozenset(ids.tolist())
            return self._base[ids].copy(), self._size[ids].copy(), token

    def lease(self, ids: list[int], need: int, who: str) -> list[tuple[int, int, int]]:
        """Like ``pin_regions``, with one pin per region that outlives
        transfers (a lease): (base, size, token) per region. ``remove``
        revokes it (``on_remove``) and waits for its ``release``."""
        with self._lock:
            out: list[tuple[int, int, int]] = []
            for rid in ids:
                flags = int(self._flags[rid]) if rid < len(self._flags) else 0
                if flags & (need | VALID) != need | VALID:
                    for token in (t for _, _, t in out):
                        self._active.pop(token, None)
                    if not flags & VALID:
                        raise AccessError(f"{who}: unknown region {rid}")
                    raise AccessError(
                        f"{who}: region {rid} does not allow this access ({_describe_flags(flags)})"
                    )
                token = next(self._tokens)
                self._active[token] = rid
                out.append((int(self._base[rid]), int(self._size[rid]), token))
            return out

    def pin_table(
        self, ids: Iterable[int] | None = None
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pin the table as ``resolve`` does, without checking anything:
        (token, bases, sizes, flags, devices) for a caller that checks and
        resolves the descriptors itself (kvx._datapath leased_post,
        leased_triples, serve_read and serve_write) and reads only the
        regions whose flags carry VALID; ``release(token)`` after. With
        ``ids``, the regions the caller's descriptors name (any of them may
        be unknown: the caller's checks refuse those), only their
        deregistration waits for the pin; without, every one's.

        Taken without the lock (the latency path's two lock round trips were
        0.3 us of a 7 us copy), and sound: the pin is in ``_active`` before
        the caller reads a flag, and ``remove`` clears a region's flags
        before it takes the set of pins to wait for, so a pin taken before
        that is waited for, and one taken after sees the cleared flags. The
        arrays are one generation (``_tables``): a region added later is
        absent from them (they grew since) or refused until ``add`` sets its
        flags, last. All of this leans on the GIL (atomic dict operations
        and token counter, ordered reads), as kvx's C extensions do.
        """
        token = next(self._tokens)
        self._active[token] = None if ids is None else tuple(ids)
        return (token, *self._tables)

    def _pin(self, ids: Iterable[int] | None = None) -> int:
        token = next(self._tokens)
        self._active[token] = None if ids is None else tuple(ids)
        return token

    def release(self, token: int) -> None:
        # Without the lock, as pin_table: a remove() counts itself in
        # _waiters before it looks at _active, so it either sees this pin
        # gone or is woken here (notify takes the lock: no wake-up is lost).
        self._active.pop(token, None)
        if self._waiters:
            with self._lock:
                self._cond.notify_all()


def one_device(devices: np.ndarray, who: str) -> int:
    """The one device of ``devices`` (-1: host memory), or ConfigError."""
    first = int(devices[0])
    if len(devices) > 1 and not (devices == first).all():
        kinds = sorted({"host memory" if d < 0 else f"CUDA device {d}" for d in np.unique(devices).tolist()})
        raise ConfigError(
            f"{who}: one transfer's descriptors span {' and '.join(kinds)}; post one transfer per "
            "memory (host, or one GPU)"
        )
    return first


# Below this many descriptors plain Python beats a dozen numpy calls.
SMALL_LIST = 16


def _small_ok(rows: list, flags: np.ndarray, sizes: np.ndarray, need: int) -> bool:
    """True when every (region, offset, length) row is valid; False sends the
    caller down the vectorised path, which finds and names the bad one."""
    nflags = len(flags)
    for region, offset, length in rows:
        if region >= nflags or (int(flags[region]) & need) != need:
            return False
        size = int(sizes[region])
        if offset > size or length > size - offset:
            return False
    return True


def check_descs(
    descs: np.ndarray, flags: np.ndarray, sizes: np.ndarray, need: int, who: str | Callable[[], str]
) -> None:
    """Raise AccessError unless every descriptor lies inside a valid region
    (flag VALID) that carries the ``need`` flags; vectorised.

    ``flags`` and ``sizes`` are indexed by region id. ``who`` names the side
    in error messages; a callable is only called when there is an error.
    """
    if len(descs) <= SMALL_LIST:
        if _small_ok(descs.tolist(), flags, sizes, need | VALID):
            return
    elif (
        descs.dtype == DESC_DTYPE
        and descs.flags.c_contiguous
        and _io.descs_bad(descs, flags, sizes, need | VALID) < 0
    ):
        return  # one pass in C; below, numpy finds the bad one and says why
    if callable(who):
        who = who()
    ids = descs["region"]
    if not len(ids):
        return
    if int(ids.max()) >= len(flags):
        i = int(np.argmax(ids >= len(flags)))
        raise AccessError(f"{who}: descriptor {i} names unknown region {int(ids[i])}")
    region_flags = flags[ids]
    bad = (region_flags & (need | VALID)) != (need | VALID)
    if bad.any():
        i = int(np.argmax(bad))
        if not region_flags[i] & VALID:
            raise AccessError(f"{who}: descriptor {i} names unknown region {int(ids[i])}")
        raise AccessError(
            f"{who}: region {int(ids[i])} does not allow this access "
            f"({_describe_flags(int(region_flags[i]))})"
        )
    region_sizes = sizes[ids]
    offsets, lengths = descs["offset"], descs["length"]
    outside = (offsets > region_sizes) | (lengths > region_sizes - np.minimum(offsets, region_sizes))
    if outside.any():
        i = int(np.argmax(outside))
        raise AccessError(
            f"{who}: descriptor {i} (region {int(ids[i])}, offset {int(offsets[i])}, "
            f"length {int(lengths[i])}) is outside the region's {int(region_sizes[i])} bytes"
        )


def _describe_flags(flags: int) -> str:
    if not flags & (REMOTE_READ | REMOTE_WRITE):
        return "registered without remote access"
    allowed = [
        name
        for bit, name in (
            (REMOTE_READ, "remote read"),
            (REMOTE_WRITE, "remote write"),
            (LOCAL_WRITE, "local write"),
        )
        if flags & bit
    ]
    return "it allows " + ", ".join(allowed) + " only"
