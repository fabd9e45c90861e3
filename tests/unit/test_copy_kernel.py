"""csrc/kvx_copy.cu, the copy kernel of the GPU paths, checked without a GPU.

It is compiled for the CPU through a shim (tests/unit/cuda_cpu/) that runs
every block and thread in turn, which is exact for a kernel without shared
memory or barriers, and compared byte for byte with numpy on aligned,
misaligned and long copies. When NVRTC is importable (the nvidia-cuda-nvrtc
wheel), the same source is also compiled for sm_90 as CuPy's RawModule will.
tests/gpu/ runs it on a real device.
"""

import ctypes
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvx._datapath import gpu
from kvx._datapath import staging as _staging

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "cuda_cpu"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the CPU shim (apt-get install g++); tests/gpu/ runs the kernel")
    out = tmp_path_factory.mktemp("kernel") / "kvx_copy_cpu.so"
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

    def launch(dsts, srcs, lens, grid, threads=gpu.THREADS):
        dsts, srcs, lens = (np.ascontiguousarray(x, np.uint64) for x in (dsts, srcs, lens))
        lib.kvx_copy_launch(grid, threads, srcs.ctypes.data, dsts.ctypes.data, lens.ctypes.data, len(lens))

    return launch


@pytest.mark.parametrize("align", [16, 8, 4, 1])
@pytest.mark.parametrize("grid", [1, 3, 64])
# 256 threads: most triples are shorter than one step; 7: many steps per triple.
@pytest.mark.parametrize("threads", [gpu.THREADS, 7])
def test_the_kernel_copies_every_triple_exactly(kernel, align, grid, threads):
    rng = np.random.default_rng(align * 100 + grid)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    count = 40
    lens = (rng.integers(1, 4000, count) // align * align + align).astype(np.uint64)
    # Source and destination ranges in different orders, aligned to ``align`` (16-byte aligned pools).
    src_at = np.cumsum(np.concatenate(([0], lens[:-1] + align))).astype(np.uint64)
    order = rng.permutation(count)
    dst_at = np.zeros(count, np.uint64)
    dst_at[order] = np.cumsum(np.concatenate(([0], lens[order][:-1] + 2 * align))).astype(np.uint64)
    base_src, base_dst = src.ctypes.data, dst.ctypes.data
    assert base_src % 16 == 0 and base_dst % 16 == 0
    kernel(base_dst + dst_at, base_src + src_at, lens, grid, threads)
    expected = np.zeros_like(dst)
    for s, d, n in zip(src_at.tolist(), dst_at.tolist(), lens.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


def test_long_copies_cut_into_pieces_land_whole(kernel):
    src = np.random.default_rng(0).integers(0, 256, 3 * gpu.PIECE_BYTES + 48, dtype=np.uint8)
    dst = np.zeros_like(src)
    dsts, srcs, lens = _staging.pieces(
        np.array([dst.ctypes.data], np.uint64),
        np.array([src.ctypes.data], np.uint64),
        np.array([src.nbytes], np.uint64),
        gpu.PIECE_BYTES,
    )
    assert len(lens) == 4
    kernel(dsts, srcs, lens, grid=2)
    assert np.array_equal(dst, src)


def _nvrtc():
    for site in sys.path:
        found = glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))
        if found:
            return ctypes.CDLL(sorted(found)[0])
    try:
        return ctypes.CDLL("libnvrtc.so.12")
    except OSError:
        return None


def test_the_kernel_compiles_with_nvrtc_for_hopper():
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip(
            "NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12); tests/gpu/ compiles it on a GPU"
        )
    prog = ctypes.c_void_p()
    assert (
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(prog), gpu.kernel_source().encode(), b"kvx_copy.cu", 0, None, None
        )
        == 0
    )
    opts = (ctypes.c_char_p * 2)(b"-arch=compute_90", b"-std=c++17")
    rc = nvrtc.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
