"""Registering GPU memory, and the engine that copies it (one process)."""

import ctypes

import numpy as np
import pytest

import kvx
from kvx._datapath import gpu
from kvx._datapath import io as _io
from kvx.agent import parse_metadata
from kvx.memory import MemoryKind
from kvx.v1 import agent_pb2
from tests.gpu.conftest import needs_gpu

pytestmark = needs_gpu


def test_cupy_arrays_and_raw_pointers_register_as_cuda_regions(cp):
    with kvx.Agent("gpu-a") as agent:
        arr = cp.arange(1 << 20, dtype=cp.uint8)
        region = agent.register(arr)
        assert region.memory_kind is MemoryKind.CUDA and region.device == 0
        assert region.address == arr.data.ptr and region.size_bytes == arr.nbytes
        assert len(region.ipc_handle) == 64
        raw = agent.register((arr.data.ptr + 4096, 8192), device=0)
        assert raw.memory_kind is MemoryKind.CUDA and raw.ipc_offset - region.ipc_offset == 4096
        md = parse_metadata(agent.metadata())
        # A handle opens the whole allocation: only a region that is all of it is offered.
        assert [(r.memory_kind, r.device, r.cuda_ipc) for r in md.regions] == [
            (agent_pb2.MEMORY_KIND_CUDA, 0, True),
            (agent_pb2.MEMORY_KIND_CUDA, 0, False),
        ]
        with pytest.raises(kvx.ConfigError, match="past the end of their CUDA allocation"):
            agent.register((arr.data.ptr, arr.nbytes + (64 << 20)), device=0)
        with pytest.raises(kvx.ConfigError, match="contiguous"):
            agent.register(cp.zeros((64, 64), cp.uint8)[:, ::2])
        with pytest.raises(kvx.ConfigError, match="not CUDA"):
            agent.register((np.zeros(64, np.uint8).ctypes.data, 64), device=0)


def test_torch_cuda_tensors_register_in_bfloat16_too():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    with kvx.Agent("gpu-t") as agent:
        t = torch.zeros(4, 1024, dtype=torch.bfloat16, device="cuda:0")
        region = agent.register(t)
        assert region.memory_kind is MemoryKind.CUDA and region.size_bytes == t.numel() * 2
        assert region.address == t.data_ptr()


def expect_launch(engine: gpu.Engine, launch: str) -> None:
    """The engine launches as asked: through the driver from C wherever the
    native data path is built, else through CuPy."""
    if launch == "driver" and _io.IMPL == "native" and engine.method == "kernel":
        assert engine.driver is not None
    else:
        assert engine.driver is None


@pytest.mark.parametrize("launch", gpu.LAUNCH_METHODS)
@pytest.mark.parametrize("method", gpu.COPY_METHODS)
@pytest.mark.parametrize("align", [16, 4, 1])
def test_the_engine_copies_scattered_triples(cp, monkeypatch, method, align, launch):
    monkeypatch.setenv("KVX_CUDA_COPY", method)
    monkeypatch.setenv("KVX_CUDA_LAUNCH", launch)
    engine = gpu.Engine(0)
    expect_launch(engine, launch)
    rng = np.random.default_rng(align)
    src = cp.asarray(rng.integers(0, 256, 8 << 20, dtype=np.uint8))
    dst = cp.zeros(8 << 20, cp.uint8)
    count = 500
    lens = (rng.integers(1, 20000, count) // align * align + align).astype(np.uint64)
    lens[0] = 300_000  # long: cut into pieces
    src_at = np.cumsum(np.concatenate(([0], lens[:-1] + align))).astype(np.uint64)
    order = rng.permutation(count)
    dst_at = np.zeros(count, np.uint64)
    dst_at[order] = np.cumsum(np.concatenate(([0], lens[order][:-1] + align))).astype(np.uint64)
    engine.copy(dst.data.ptr + dst_at, src.data.ptr + src_at, lens).synchronize()
    host_src, expected = cp.asnumpy(src), np.zeros(8 << 20, np.uint8)
    for s, d, n in zip(src_at.tolist(), dst_at.tolist(), lens.tolist(), strict=True):
        expected[d : d + n] = host_src[s : s + n]
    assert np.array_equal(cp.asnumpy(dst), expected)


@pytest.mark.parametrize("launch", gpu.LAUNCH_METHODS)
def test_copy_packed_launches_and_waits_for_a_leased_copy(cp, monkeypatch, launch):
    """The leased path: the triples packed straight into the engine's pinned
    buffer, one launch, the slot's event recorded again for each copy."""
    monkeypatch.setenv("KVX_CUDA_LAUNCH", launch)
    engine = gpu.Engine(0)
    expect_launch(engine, launch)
    rng = np.random.default_rng(7)
    src = cp.asarray(rng.integers(0, 256, 8 << 20, dtype=np.uint8))
    dst = cp.zeros(8 << 20, cp.uint8)
    n, block = 256, 16384
    srcs = (src.data.ptr + rng.permutation(512)[:n] * block).astype(np.uint64)
    dsts = (dst.data.ptr + rng.permutation(512)[:n] * block).astype(np.uint64)
    lens = np.full(n, block, np.uint64)

    def pack(out: int, words: int) -> int | tuple[int, int]:
        if words < 3 * n:
            return (3, n)
        packed = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * n)).from_address(out))
        packed[:n], packed[n : 2 * n], packed[2 * n :] = srcs, dsts, lens
        return n

    host_src = cp.asnumpy(src)
    for _ in range(3):
        dst.fill(0)
        engine.wait(engine.copy_packed(pack))
        got = cp.asnumpy(dst)
        for s, d in zip((srcs - src.data.ptr).tolist(), (dsts - dst.data.ptr).tolist(), strict=True):
            assert np.array_equal(got[d : d + block], host_src[s : s + block])
        assert int(np.count_nonzero(got)) <= n * block
    # What pack refuses comes back as it is; nothing is launched.
    assert engine.copy_packed(lambda out, words: (1, 7)) == (1, 7)


@pytest.mark.parametrize("launch", gpu.LAUNCH_METHODS)
def test_the_engine_stages_through_pinned_buffers(cp, monkeypatch, launch):
    monkeypatch.setenv("KVX_CUDA_LAUNCH", launch)
    engine = gpu.Engine(0)
    expect_launch(engine, launch)
    src = cp.asarray(np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8))
    dst = cp.zeros(1 << 20, cp.uint8)
    addrs = (src.data.ptr + np.arange(0, 1 << 20, 8192)).astype(np.uint64)
    lens = np.full(len(addrs), 4096, np.uint64)  # every other 4 KiB
    total = int(lens.sum())
    engine.stage_out(0, addrs, lens, total).synchronize()
    staged = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * total).from_address(engine.buffer(0)))
    assert np.array_equal(staged, cp.asnumpy(src).reshape(-1, 8192)[:, :4096].ravel())
    back = (dst.data.ptr + np.arange(0, 1 << 20, 8192)).astype(np.uint64)
    engine.stage_in(0, back, lens, total).synchronize()
    assert np.array_equal(
        cp.asnumpy(dst).reshape(-1, 8192)[:, :4096], cp.asnumpy(src).reshape(-1, 8192)[:, :4096]
    )
    assert not cp.asnumpy(dst).reshape(-1, 8192)[:, 4096:].any()


def test_agents_in_one_process_copy_gpu_memory_directly(cp):
    with kvx.Agent("one-a") as a, kvx.Agent("one-b") as b:
        src = cp.asarray(np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8))
        dst = cp.zeros(1 << 20, cp.uint8)
        theirs = b.register(src)
        mine = a.register(dst)
        peer = a.add_peer(b.metadata())
        assert peer.backend == "cuda_ipc"
        ids = np.arange(0, 64, 2)
        peer.read(
            kvx.Descs.from_blocks(mine, ids, 16384), kvx.Descs.from_blocks(theirs, ids[::-1], 16384)
        ).wait(30)
        got = cp.asnumpy(dst).reshape(-1, 16384)[ids]
        assert np.array_equal(got, cp.asnumpy(src).reshape(-1, 16384)[ids[::-1]])
