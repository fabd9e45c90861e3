"""GPU memory: CUDA regions, the copy kernel, CUDA IPC and staging engines.

CuPy (the ``kvx[gpu]`` extra) is imported here only, and only when GPU
memory is registered or moved: a host-only install never loads it, and
registering device memory without it fails with a message that names the
extra. torch is never imported: a torch CUDA tensor is recognised by its
type's module and described through its own attributes (``data_ptr``,
``device.index``), which also covers bfloat16, which
``__cuda_array_interface__`` cannot describe.

Threads and completion: every thread that moves GPU bytes (a connection's
reader or sender, a serving thread, an application thread that posts a
cuda_ipc transfer through a lease) has its own ``Engine`` per device: its own non-blocking stream, argument and staging buffers, so that
threads never share a stream or a lock. Work ends with a CUDA event recorded
on that stream and waited for by that thread (blocking-sync events: the
thread sleeps, CuPy releases the GIL). A thread that waits for its own
copy (``Engine.wait``: a cuda_ipc transfer through a lease) first polls the
event for a bounded time (``KVX_CUDA_SPIN_US``, 100 us by default), since
waking from a blocking-sync event costs more than a copy of a few MiB
takes. Nothing synchronises a device or another stream.

Launches: where the C extension kvx._datapath._cuda is built and the CUDA
driver (libcuda.so.1) opens, the copy kernel is launched through the driver
from C (a leased copy's arguments copied to the device in the same call),
and a thread's own copy is polled in C with the GIL released; else
(KVX_CUDA_LAUNCH=cupy, the pure-Python data path, a stand-in CUDA) through
CuPy from Python, where the poll holds the GIL between queries. Both launch
the same kernel with the same arguments on the same stream.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx._datapath import staging as _staging
from kvx._datapath.io import spin_us
from kvx.errors import ConfigError, RegionError, TransferError

logger = logging.getLogger(__name__)

EXTRA = "the kvx[gpu] extra: pip install 'kvx[gpu]' (CuPy for CUDA 12)"
# DLPack device types.
_DL_CUDA = 2
# cudaMemoryType.
_MEMORY_DEVICE = 2
_MEMORY_MANAGED = 3
# cudaIpcMemLazyEnablePeerAccess: a handle to another GPU's memory opens with peer access.
_IPC_LAZY_PEER_ACCESS = 1
_MEMCPY_DEFAULT = 4
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
# The kernel cuts copies into pieces of at most this size (see csrc/kvx_copy.cu).
PIECE_BYTES = 64 * 1024
THREADS = 256
# Triples per launch: the argument buffers of a thread's engine stay within
# 24 * 2 * MAX_LAUNCH_PIECES bytes, whatever a transfer's descriptor count.
MAX_LAUNCH_PIECES = 1 << 16
# How copies of many (src, dst, len) triples run: one kernel launch ("kernel"),
# or one cudaMemcpyAsync per triple ("memcpy"). KVX_CUDA_COPY overrides.
COPY_METHODS = ("kernel", "memcpy")
# What Engine.copy_packed answers, nothing launched, when this engine copies
# with one cudaMemcpyAsync per block (KVX_CUDA_COPY=memcpy): the caller then
# takes the path that copies block by block.
NOT_PACKED = (4, -1)
# How long a thread polls the event of its own copy before it sleeps on it, in
# microseconds (Engine.wait). KVX_CUDA_SPIN_US overrides; 0 never polls.
SPIN_US = 100
# How the copy kernel is launched: through the CUDA driver from C
# (kvx._datapath._cuda) or through CuPy from Python. KVX_CUDA_LAUNCH overrides;
# "driver" falls back to CuPy where the extension or the driver is missing.
LAUNCH_METHODS = ("driver", "cupy")

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kvx_copy.cu"


def kernel_source() -> str:
    """csrc/kvx_copy.cu: installed inside the package, or beside it in a checkout."""
    for path in (_SOURCE, Path(__file__).resolve().parents[2] / "csrc" / "kvx_copy.cu"):
        if path.exists():
            return path.read_text()
    raise TransferError(f"kvx's CUDA kernel source is missing ({_SOURCE}); reinstall kvx")


def cupy_module() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RegionError(f"GPU memory needs CuPy, which is not installed ({exc}); install {EXTRA}") from None
    return cupy


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def is_cuda(obj: Any) -> bool:
    """Does ``obj`` claim to be CUDA memory? Needs neither CuPy nor torch."""
    if is_torch(obj):
        return getattr(getattr(obj, "device", None), "type", "cpu") == "cuda"
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None and not isinstance(obj, np.ndarray):
        try:
            return int(dlpack_device()[0]) == _DL_CUDA
        except Exception:
            return False
    return False


def interface_extent(cai: dict) -> tuple[int, int, bool]:
    """(pointer, bytes, read-only) of a ``__cuda_array_interface__``, which
    must describe one contiguous range."""
    try:
        pointer, readonly = cai["data"]
        shape = tuple(int(n) for n in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"malformed __cuda_array_interface__: {exc}") from None
    if cai.get("mask") is not None:
        raise ConfigError("cannot register a masked CUDA array")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = cai.get("strides")
    if strides is not None and count > 1:
        strides = tuple(strides)
        if len(strides) != len(shape):
            raise ConfigError(
                f"malformed __cuda_array_interface__: {len(strides)} strides for {len(shape)} dimensions"
            )
        expected = itemsize
        for size, stride in zip(reversed(shape), reversed(strides), strict=True):
            if size != 1 and stride != expected:
                raise ConfigError("register a contiguous CUDA array (cupy.ascontiguousarray)")
            expected *= size
    return int(pointer or 0), count * itemsize, bool(readonly)


@dataclasses.dataclass(frozen=True)
class CudaMemory:
    address: int
    size: int
    device: int
    writable: bool
    owner: Any
    ipc_handle: bytes  # b"": this memory cannot be shared through CUDA IPC
    ipc_offset: int  # of address from the start of its allocation (what a handle opens)


def describe(obj: Any, device: int | None) -> CudaMemory:
    """Describe CUDA memory for registration: a CuPy array, a torch CUDA
    tensor, anything with ``__cuda_array_interface__`` or a CUDA DLPack
    capsule, or an ``(address, size_bytes)`` tuple on ``device``."""
    cp = cupy_module()
    writable = True
    if isinstance(obj, tuple):
        address, size = obj
        owner: Any = None
    elif is_torch(obj):
        if not obj.is_contiguous():
            raise ConfigError("register a contiguous tensor (tensor.contiguous())")
        address, size, owner = int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    elif hasattr(obj, "__cuda_array_interface__"):
        address, size, readonly = interface_extent(obj.__cuda_array_interface__)
        writable, owner = not readonly, obj
    else:
        try:
            view = cp.from_dlpack(obj)
        except Exception as exc:
            raise ConfigError(f"cannot register {type(obj).__name__} through DLPack: {exc}") from None
        address, size, readonly = interface_extent(view.__cuda_array_interface__)
        writable, owner = not readonly, (obj, view)
    if size <= 0:
        raise RegionError("cannot register an empty buffer")
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(address)
    except Exception as exc:
        raise ConfigError(f"address {address:#x} is not CUDA memory: {exc}") from None
    if attrs.type not in (_MEMORY_DEVICE, _MEMORY_MANAGED):
        raise ConfigError(
            f"address {address:#x} is not CUDA device memory (cudaMemoryType {attrs.type}); "
            "register host memory without device="
        )
    if device is not None and attrs.device != device:
        raise ConfigError(f"address {address:#x} is on CUDA device {attrs.device}, not {device}")
    device = int(attrs.device)
    with cp.cuda.Device(device):
        base, length = _allocation(address)
        if address + size > base + length:
            raise ConfigError(
                f"{size} bytes at {address:#x} run past the end of their CUDA allocation "
                f"({length} bytes at {base:#x})"
            )
        handle = b""
        # A handle opens the whole allocation, read-write, to whoever holds it:
        # hand one out only for a region that is all of its allocation and
        # writable, or a peer would reach memory never registered, or write
        # memory registered read-only. Others reach same-host peers staged
        # over tcp, where the target checks every descriptor.
        whole = address == base and size == length
        if attrs.type == _MEMORY_DEVICE and not (whole and writable):
            logger.info(
                "CUDA memory at %#x is not shared through CUDA IPC: %s; same-host peers reach it "
                "through staging over tcp (register the whole allocation, writable, for CUDA IPC)",
                address,
                f"it is {size} bytes of a {length}-byte allocation" if not whole else "it is read-only",
            )
        elif attrs.type == _MEMORY_DEVICE:
            try:
                handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
            except Exception as exc:  # cudaMallocAsync pools, VMM (expandable segments) memory...
                logger.info(
                    "CUDA memory at %#x cannot be shared through CUDA IPC (%s); same-host peers "
                    "reach it through staging over tcp",
                    address,
                    exc,
                )
    return CudaMemory(address, size, device, writable, owner, handle, address - base)


_libcuda: Any = None


def _allocation(address: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding ``address``."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if rc != 0:
        raise ConfigError(f"address {address:#x} is in no CUDA allocation (cuMemGetAddressRange: {rc})")
    return base.value, size.value


def copy_method() -> str:
    method = os.environ.get("KVX_CUDA_COPY", "kernel")
    if method not in COPY_METHODS:
        raise ConfigError(f"KVX_CUDA_COPY must be one of {', '.join(COPY_METHODS)}, not {method!r}")
    return method


def spin_seconds() -> float:
    """KVX_CUDA_SPIN_US, checked, in seconds."""
    return spin_us("KVX_CUDA_SPIN_US", SPIN_US) / 1e6


def launch_method() -> str:
    method = os.environ.get("KVX_CUDA_LAUNCH", "driver")
    if method not in LAUNCH_METHODS:
        raise ConfigError(f"KVX_CUDA_LAUNCH must be one of {', '.join(LAUNCH_METHODS)}, not {method!r}")
    return method


def _driver(kernel: Any) -> tuple[Any, int] | None:
    """(kvx._datapath._cuda, the kernel's CUfunction) when launches go through
    the driver from C; None when they go through CuPy."""
    if kernel is None or launch_method() != "driver" or _io.IMPL != "native":
        return None
    try:
        from kvx._datapath import _cuda
    except ImportError as exc:
        if os.environ.get("KVX_NATIVE") == "1":
            raise ConfigError(
                f"KVX_NATIVE=1 but the C extension kvx._datapath._cuda is not built ({exc}); "
                "reinstall kvx with a C compiler"
            ) from None
        logger.debug("the copy kernel is launched through CuPy: %s", exc)
        return None
    try:
        _cuda.load()
    except OSError as exc:  # no libcuda.so.1 beside CuPy: a stand-in CUDA
        logger.debug("the copy kernel is launched through CuPy: %s", exc)
        return None
    # CuPy's RawModule answers a RawKernel (its CUfunction at .kernel.ptr) or a
    # Function (at .ptr); anything else (a stand-in) launches through CuPy.
    handle = getattr(getattr(kernel, "kernel", kernel), "ptr", None)
    if not isinstance(handle, int) or handle == 0:
        return None
    return _cuda, handle


_modules: dict[int, Any] = {}
_modules_lock = threading.Lock()


def _kernel(cp: Any, device: int) -> Any:
    """kvx_copy, compiled once per device (NVRTC, through CuPy's RawModule)."""
    with _modules_lock:
        fn = _modules.get(device)
        if fn is None:
            module = cp.RawModule(code=kernel_source(), options=("-std=c++17",))
            fn = _modules[device] = module.get_function("kvx_copy")
        return fn


class _Slot:
    """Pinned and device buffers for one launch's triples, and its event."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.capacity = 0
        self.host: Any = None
        self.packed: np.ndarray = np.zeros(0, np.uint64)  # self.host, as 3 * capacity words
        self.dev: Any = None
        self.event: Any = None  # of the last work that used these buffers
        self.own_event: Any = None  # recorded again for each leased copy (driver launches)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def reserve(self, n: int) -> None:
        """Room for n triples (call with the slot idle: after ``wait``)."""
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity, 1024)
            self.host = self.cp.cuda.alloc_pinned_memory(24 * self.capacity)
            self.dev = self.cp.cuda.alloc(24 * self.capacity)
            self.packed = np.ctypeslib.as_array(
                (ctypes.c_uint64 * (3 * self.capacity)).from_address(self.host.ptr)
            )

    def send(self, n: int, stream: Any) -> int:
        """Copy the n triples packed in the pinned buffer to the device
        (async); the device address of [src | dst | len]."""
        self.cp.cuda.runtime.memcpyAsync(
            self.dev.ptr, self.host.ptr, 24 * n, _MEMCPY_HOST_TO_DEVICE, stream.ptr
        )
        return self.dev.ptr

    def load(self, dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray, stream: Any) -> int:
        """Copy the triples to the device (async); the device address of [src | dst | len]."""
        self.wait()
        n = len(lens)
        self.reserve(n)
        packed = self.packed
        packed[:n] = srcs
        packed[n : 2 * n] = dsts
        packed[2 * n : 3 * n] = lens
        return self.send(n, stream)


class Engine:
    """One thread's copies on one device (see the module's note on threads)."""

    def __init__(self, device: int) -> None:
        cp = self.cp = cupy_module()
        self.device = device
        self.method = copy_method()
        self.chunk_bytes = _staging.CHUNK_BYTES
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.kernel = _kernel(cp, device) if self.method == "kernel" else None
            self.grid_limit = 8 * cp.cuda.Device(device).attributes["MultiProcessorCount"]
            # (kvx._datapath._cuda, the CUfunction in this device's context), or None: CuPy.
            self.driver = _driver(self.kernel)
        self.spin_s = spin_seconds()
        self._slots = [_Slot(cp), _Slot(cp), _Slot(cp)]  # 0, 1: staging; 2: direct copies
        self._pinned: list[Any] = []
        self._staged: list[Any] = []

    def _event(self) -> Any:
        event = self.cp.cuda.Event(block=True, disable_timing=True)
        event.record(self.stream)
        return event

    def _kernel_launch(self, args: int, k: int) -> None:
        assert self.kernel is not None  # compiled in __init__ when the method is "kernel"
        if self.driver is not None:
            cuda, function = self.driver
            cuda.launch(function, self.stream.ptr, 0, args, 0, k, min(k, self.grid_limit), THREADS, 0)
            return
        with self.stream:  # launches on the current stream
            self.kernel(
                (min(k, self.grid_limit),),
                (THREADS,),
                (np.uint64(args), np.uint64(args + 8 * k), np.uint64(args + 16 * k), np.uint32(k)),
            )

    def _launch(self, slot: _Slot, dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> None:
        """Queue the copies of (dst, src, len) triples on the stream."""
        dsts, srcs, lens = _staging.pieces(
            np.asarray(dsts, np.uint64), np.asarray(srcs, np.uint64), np.asarray(lens, np.uint64), PIECE_BYTES
        )
        n = len(lens)
        if self.method == "memcpy":
            slot.wait()
            memcpy = self.cp.cuda.runtime.memcpyAsync
            for d, s, k in zip(dsts.tolist(), srcs.tolist(), lens.tolist(), strict=True):
                memcpy(d, s, k, _MEMCPY_DEFAULT, self.stream.ptr)
            return
        for at in range(0, n, MAX_LAUNCH_PIECES):
            if at:  # the next load waits until this launch has read its arguments
                slot.event = self._event()
            cut = slice(at, at + MAX_LAUNCH_PIECES)
            k = len(lens[cut])
            self._kernel_launch(slot.load(dsts[cut], srcs[cut], lens[cut], self.stream), k)

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> Any:
        """Start the copies (device or IPC-opened memory on both sides); an event."""
        with self.cp.cuda.Device(self.device):
            slot = self._slots[2]
            self._launch(slot, dsts, srcs, lens)
            slot.event = self._event()
            return slot.event

    def copy_packed(self, pack: Callable[[int, int], int | tuple[int, int]]) -> Any:
        """Start a copy whose triples ``pack(address, words)`` writes into
        this engine's argument buffer (srcs, dsts, lens: at most ``words``
        uint64 words at ``address``) and counts (kvx._datapath leased_triples);
        an event. What ``pack`` refused (a pair) comes back as it is,
        nothing launched; ``(3, n)`` (no room for n triples) grows the buffer
        and packs again, up to MAX_LAUNCH_PIECES triples (one launch); more
        come back as ``(3, n)``. NOT_PACKED when this engine does not copy
        with the kernel."""
        if self.method != "kernel":
            return NOT_PACKED
        with self.cp.cuda.Device(self.device):
            slot = self._slots[2]
            slot.wait()
            slot.reserve(1024)
            got = pack(slot.host.ptr, 3 * min(slot.capacity, MAX_LAUNCH_PIECES))
            if isinstance(got, tuple) and got[0] == 3 and got[1] <= MAX_LAUNCH_PIECES:
                slot.reserve(got[1])
                got = pack(slot.host.ptr, 3 * min(slot.capacity, MAX_LAUNCH_PIECES))
            if isinstance(got, tuple):
                return got
            if not 0 < got <= min(slot.capacity, MAX_LAUNCH_PIECES):
                raise TransferError(f"the copy's arguments: {got} triples packed, room for {slot.capacity}")
            if self.driver is not None:
                # One C call: the arguments to the device, the launch, the event (one per slot,
                # recorded again: the slot's last copy has ended, slot.wait above).
                if slot.own_event is None:
                    slot.own_event = self.cp.cuda.Event(block=True, disable_timing=True)
                cuda, function = self.driver
                cuda.launch(
                    function,
                    self.stream.ptr,
                    slot.host.ptr,
                    slot.dev.ptr,
                    24 * got,
                    got,
                    min(got, self.grid_limit),
                    THREADS,
                    slot.own_event.ptr,
                )
                slot.event = slot.own_event
                return slot.event
            self._kernel_launch(slot.send(got, self.stream), got)
            slot.event = self._event()
            return slot.event

    def wait(self, event: Any) -> None:
        """Wait for ``event`` of this engine's work: poll it for up to
        ``spin_s``, then sleep on it. Raises when the work failed (CuPy's
        error, or RuntimeError naming the driver call and the CUDA error).
        Returns or raises only once the work has ended: an exception raised
        into the poll (KeyboardInterrupt) waits for the copy first, since the
        caller then lets go of the memory it uses; the driver's poll runs in
        C, where nothing is raised into it."""
        if self.driver is not None:
            # In C, with the GIL released: nothing is raised into it.
            self.driver[0].wait(event.ptr, self.spin_s * 1e6)
            slot = self._slots[2]
            if slot.event is event:
                slot.event = None  # ended: the slot's next copy need not wait for it again
            return
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            try:
                while not event.done:
                    if time.perf_counter() >= deadline:
                        break
                else:
                    return
            except BaseException:
                event.synchronize()
                raise
        event.synchronize()

    # The staging engine (kvx/_datapath/staging.py).

    def _staging(self) -> None:
        if not self._pinned:
            for _ in range(2):
                self._pinned.append(self.cp.cuda.alloc_pinned_memory(self.chunk_bytes))
                self._staged.append(self.cp.cuda.alloc(self.chunk_bytes))

    def buffer(self, slot: int) -> int:
        with self.cp.cuda.Device(self.device):
            self._staging()
        return self._pinned[slot].ptr

    def stage_out(self, slot: int, addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> Any:
        with self.cp.cuda.Device(self.device):
            self._staging()
            staged = self._staged[slot].ptr
            self._launch(self._slots[slot], _staging.offsets(staged, lens), addrs, lens)
            self.cp.cuda.runtime.memcpyAsync(
                self._pinned[slot].ptr, staged, nbytes, _MEMCPY_DEVICE_TO_HOST, self.stream.ptr
            )
            self._slots[slot].event = self._event()
            return self._slots[slot].event

    def stage_in(self, slot: int, addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> Any:
        with self.cp.cuda.Device(self.device):
            self._staging()
            staged = self._staged[slot].ptr
            self._slots[slot].wait()
            self.cp.cuda.runtime.memcpyAsync(
                staged, self._pinned[slot].ptr, nbytes, _MEMCPY_HOST_TO_DEVICE, self.stream.ptr
            )
            self._launch(self._slots[slot], addrs, _staging.offsets(staged, lens), lens)
            self._slots[slot].event = self._event()
            return self._slots[slot].event


_local = threading.local()


def engine(device: int) -> Engine:
    """This thread's engine for ``device``."""
    engines = _local.__dict__.setdefault("engines", {})
    found = engines.get(device)
    if found is None:
        found = engines[device] = Engine(device)
    return found


# Allocations opened through CUDA IPC in this process, shared by every IpcMap:
# a handle opens once per process (CUDA refuses a second open of the same
# handle in one context), and closes when the last map holding it lets go.
# (device, handle) -> [address, length of the allocation, maps holding it]
_opened: dict[tuple[int, bytes], list[int]] = {}
_opened_lock = threading.Lock()


class IpcMap:
    """The allocations one peer connection opened through CUDA IPC: each once,
    closed when the lease that named it ends (``release``) or when the
    connection ends (``close``)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._held: dict[bytes, tuple[int, int]] = {}
        self._closed = False

    def open(self, handle: bytes) -> tuple[int, int]:
        """The local address of the allocation ``handle`` names, and its
        length as this process's driver knows it (what bounds a peer's
        offsets: the peer's own word is not taken for it)."""
        with self._lock:
            found = self._held.get(handle)
            if found is not None:
                return found
            if self._closed:
                raise TransferError("the connection to the peer was closed")
            key = (self.device, handle)
            with _opened_lock:
                entry = _opened.get(key)
                if entry is None:
                    cp = cupy_module()
                    with cp.cuda.Device(self.device):
                        try:
                            opened = int(cp.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))
                        except Exception as exc:
                            raise TransferError(
                                f"cannot open the peer's CUDA IPC handle: {exc} (the peer's GPU is not visible "
                                "to this process, or a container hides it)"
                            ) from None
                        try:
                            base, length = _allocation(opened)
                        except ConfigError as exc:
                            _close_ipc(cp, self.device, opened)
                            raise TransferError(f"a CUDA IPC mapping of the peer's: {exc}") from None
                    if base != opened:
                        _close_ipc(cp, self.device, opened)
                        raise TransferError("the driver mapped a CUDA IPC handle inside another allocation")
                    entry = _opened[key] = [opened, length, 0]
                entry[2] += 1
            self._held[handle] = (entry[0], entry[1])
            return entry[0], entry[1]

    def release(self, handle: bytes) -> None:
        """Close this map's mapping of ``handle`` (nothing if it has none):
        call when no copy can use it any more."""
        with self._lock:
            if self._held.pop(handle, None) is None:
                return
        self._drop(handle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held, self._held = list(self._held), {}
        for handle in held:
            self._drop(handle)

    def _drop(self, handle: bytes) -> None:
        key = (self.device, handle)
        with _opened_lock:
            entry = _opened[key]
            entry[2] -= 1
            if entry[2]:
                return
            del _opened[key]
        _close_ipc(cupy_module(), self.device, entry[0])


def _close_ipc(cp: Any, device: int, address: int) -> None:
    with cp.cuda.Device(device):
        try:
            cp.cuda.runtime.ipcCloseMemHandle(address)
        except Exception as exc:
            logger.warning("closing a CUDA IPC mapping failed: %s", exc)
