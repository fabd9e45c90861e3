"""A stand-in for CuPy that runs on the CPU, so that kvx's GPU plumbing
(kvx/_datapath/gpu.py, the staging pipeline in the tcp backend on both sides, the
cuda_ipc pin and copy) runs end to end where there is no GPU.

"Device memory" is host memory; streams are queues that run only when an
event recorded on them is waited for (as a GPU runs behind the host, only
more so: a missing wait shows up as missing bytes); the kernel is
csrc/kvx_copy.cu itself, compiled for the CPU through tests/unit/cuda_cpu/.
What it cannot stand in for (the CUDA API's own behaviour, IPC between
processes, real concurrency on a device) is tested in tests/gpu/.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "cuda_cpu"
DEVICE_MEMORY = 2


def build_kernel(directory: Path):
    """csrc/kvx_copy.cu for the CPU: kvx_copy_launch(grid, threads, src, dst, len, n); None without g++."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    out = directory / "kvx_copy_cpu.so"
    subprocess.run(
        [
            cxx,
            "-O1",
            "-shared",
            "-fPIC",
            "-o",
            str(out),
            "-I",
            str(SHIM),
            "-x",
            "c++",
            "-include",
            str(SHIM / "shim.h"),
            str(ROOT / "csrc" / "kvx_copy.cu"),
            str(SHIM / "driver.cc"),
        ],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.kvx_copy_launch.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p] * 3 + [ctypes.c_uint]
    return lib


class DeviceArray:
    """A "CUDA" byte array: host memory behind __cuda_array_interface__."""

    def __init__(self, data: np.ndarray) -> None:
        self.host = np.ascontiguousarray(data, dtype=np.uint8)
        self.__cuda_array_interface__ = {
            "data": (self.host.ctypes.data, False),
            "shape": self.host.shape,
            "typestr": "|u1",
            "strides": None,
            "version": 3,
        }


def make(kernel_lib) -> types.ModuleType:
    """A module object to install as sys.modules["cupy"]."""
    allocations: list[np.ndarray] = []  # keeps every "device" and pinned buffer alive
    state = {"launches": 0}
    local = threading.local()  # the current stream is per thread, as in CuPy

    class Stream:
        def __init__(self, null=False, non_blocking=False):
            self.queue: list = []
            self.done = 0
            self.ptr = id(self)
            streams[self.ptr] = self

        def __enter__(self):
            self.saved, local.current = getattr(local, "current", None), self
            return self

        def __exit__(self, *exc):
            local.current = self.saved

        def run_to(self, position):
            while self.done < position:
                self.queue[self.done]()
                self.done += 1

        def synchronize(self):
            self.run_to(len(self.queue))

    streams: dict[int, Stream] = {}
    default = Stream()

    def current() -> Stream:
        return getattr(local, "current", None) or default

    class Event:
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.at = None

        def record(self, stream=None):
            self.at = (stream or current(), len((stream or current()).queue))

        def synchronize(self):
            if self.at is not None:
                stream, position = self.at
                stream.run_to(position)

        @property
        def done(self):  # work runs when it is waited for: a query finds it done
            self.synchronize()
            return True

    class Memory:
        def __init__(self, nbytes):
            buf = np.zeros(nbytes + 16, np.uint8)
            allocations.append(buf)
            self.ptr = (buf.ctypes.data + 15) // 16 * 16
            self.size = nbytes

    def memcpy_async(dst, src, size, kind, stream_ptr):
        streams[stream_ptr].queue.append(lambda: ctypes.memmove(dst, src, size))

    class Kernel:
        def __call__(self, grid, block, args):
            src, dst, lens, n = (int(a) for a in args)
            state["launches"] += 1
            current().queue.append(lambda: kernel_lib.kvx_copy_launch(grid[0], block[0], src, dst, lens, n))

    class RawModule:
        def __init__(self, code, options=()):
            assert "kvx_copy" in code

        def get_function(self, name):
            assert name == "kvx_copy"
            return Kernel()

    class Device:
        attributes = {"MultiProcessorCount": 4}

        def __init__(self, device=0):
            self.id = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    class Attributes:
        def __init__(self, ptr):
            self.type, self.device = DEVICE_MEMORY, 0

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        pointerGetAttributes=Attributes,
        ipcGetMemHandle=lambda ptr: int(ptr).to_bytes(8, "little") * 8,
        ipcOpenMemHandle=lambda handle, flags=1: int.from_bytes(handle[:8], "little"),
        ipcCloseMemHandle=lambda ptr: None,
        memcpyAsync=memcpy_async,
    )
    cuda = types.SimpleNamespace(
        runtime=runtime, Device=Device, Stream=Stream, Event=Event, alloc=Memory, alloc_pinned_memory=Memory
    )
    module = types.ModuleType("cupy")
    module.cuda = cuda
    module.RawModule = RawModule
    module.state = state
    return module


def allocation_of(arrays):
    """A stand-in for kvx._datapath.gpu._allocation (cuMemGetAddressRange): each
    registered DeviceArray is one allocation."""

    def find(address):
        for arr in arrays:
            base = arr.host.ctypes.data
            if base <= address < base + arr.host.nbytes:
                return base, arr.host.nbytes
        raise AssertionError(f"{address:#x} is in no fake allocation")

    return find
