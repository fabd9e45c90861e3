"""GPU memory between two processes: staged over tcp, and through CUDA IPC,
with the bad-input and peer-death cases of the host backends."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import kvx
from kvx import Descs
from tests.conftest import SECRET
from tests.gpu.conftest import needs_gpu

pytestmark = [needs_gpu, pytest.mark.slow]

BLOCK = 32 * 1024
BLOCKS = 1000
POOL = 2 * BLOCK * BLOCKS


@pytest.fixture(params=["tcp", "cuda_ipc"])
def backend(request):
    return request.param


@pytest.fixture
def gpu_worker(make_worker):
    return make_worker(pool_bytes=POOL, auth_secret=SECRET, memory="cuda")


def _blocks(rng):
    return rng.permutation(2 * BLOCKS)[:BLOCKS]


def test_read_and_write_1000_scattered_blocks_gpu_to_gpu(cp, make_agent, gpu_worker, backend):
    agent = make_agent(auth_secret=SECRET, backend=backend)
    pool = cp.zeros(POOL, cp.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(gpu_worker.metadata)
    assert peer.backend == backend
    if backend == "cuda_ipc":
        assert "CUDA IPC" in peer.backend_reason
    else:
        assert "pinned host buffers" in peer.backend_reason
    rng = np.random.default_rng(5)
    remote_ids, local_ids = _blocks(rng), _blocks(rng)
    local = Descs.from_blocks(region, local_ids, BLOCK)
    remote = Descs.from_blocks(peer.regions[0], remote_ids, BLOCK)
    peer.read(local, remote).wait(60)
    expected = gpu_worker.expected(0, POOL).reshape(-1, BLOCK)
    got = cp.asnumpy(pool).reshape(-1, BLOCK)
    assert np.array_equal(got[local_ids], expected[remote_ids])
    untouched = np.setdiff1d(np.arange(2 * BLOCKS), local_ids)
    assert not got[untouched].any()
    # Write other bytes back into other blocks, with a notification after them.
    pool[:] = 7
    peer.write(local[:10], Descs.from_blocks(peer.regions[0], np.arange(10), BLOCK), notify=b"landed").wait(
        60
    )
    assert gpu_worker.call("peek", 0, 10 * BLOCK) == bytes([7]) * (10 * BLOCK)
    assert gpu_worker.call("notifications", 5.0) == [(agent.name, b"landed")]


def test_host_memory_with_gpu_memory_is_staged(cp, make_agent, gpu_worker, backend):
    agent = make_agent(auth_secret=SECRET, backend=backend)
    host = np.zeros(64 * BLOCK, np.uint8)
    region = agent.register(host)
    peer = agent.add_peer(gpu_worker.metadata)
    ids = np.arange(64)[::-1]
    peer.read(
        Descs.from_blocks(region, np.arange(64), BLOCK), Descs.from_blocks(peer.regions[0], ids, BLOCK)
    ).wait(60)
    assert np.array_equal(host.reshape(-1, BLOCK), gpu_worker.expected(0, POOL).reshape(-1, BLOCK)[ids])


def test_bad_descriptors_are_refused_and_the_peer_serves_on(cp, make_agent, gpu_worker, backend):
    agent = make_agent(auth_secret=SECRET, backend=backend)
    pool = cp.zeros(POOL, cp.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(gpu_worker.metadata)
    with pytest.raises(kvx.AccessError):
        peer.read(region.descs(0, BLOCK), peer.regions[0].descs(POOL - 10, BLOCK))
    mixed = agent.register(np.zeros(BLOCK, np.uint8))
    with pytest.raises(kvx.ConfigError, match="CUDA device 0 and host memory"):
        peer.read(Descs.concat([region.descs(0, 16), mixed.descs(0, 16)]), peer.regions[0].descs(0, 32))
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(BLOCK, BLOCK)).wait(30)
    assert cp.asnumpy(pool[:BLOCK]).tobytes() == gpu_worker.expected(BLOCK, BLOCK).tobytes()


def test_a_peer_killed_mid_stream_fails_transfers_quickly(cp, make_agent, gpu_worker, backend):
    agent = make_agent(auth_secret=SECRET, backend=backend, timeouts=kvx.Timeouts(io_s=5))
    pool = cp.zeros(POOL, cp.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(gpu_worker.metadata)
    local = Descs.from_blocks(region, np.arange(BLOCKS), BLOCK)
    remote = Descs.from_blocks(peer.regions[0], np.arange(BLOCKS), BLOCK)
    transfers = [peer.read(local, remote) for _ in range(20)]
    gpu_worker.kill()
    start = time.monotonic()
    errors = []
    for t in transfers:
        try:
            t.wait(30)
        except kvx.KvxError as exc:
            errors.append(exc)
    assert time.monotonic() - start < 10
    with pytest.raises((kvx.PeerLostError, kvx.ClosedError)):
        peer.read(local, remote).wait(10)
    assert all(isinstance(e, (kvx.PeerLostError, kvx.TransferError, kvx.TimeoutError)) for e in errors)


def test_deregister_revokes_the_ipc_lease_and_closes_the_mapping(cp, make_agent, gpu_worker):
    """The target's deregister waits for the initiator's lease; the initiator
    closes its CUDA IPC mapping of that allocation before it lets go, so the
    target may free the memory; the region is then refused, and the peer
    serves on."""
    from kvx._datapath import gpu

    agent = make_agent(auth_secret=SECRET, backend="cuda_ipc")
    pool = cp.zeros(POOL, cp.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(gpu_worker.metadata)
    assert peer.backend == "cuda_ipc"
    opened_before = set(gpu._opened)
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(BLOCK, BLOCK)).wait(30)
    peer.read(region.descs(BLOCK, BLOCK), peer.regions[0].descs(0, BLOCK)).wait(30)  # through the lease
    mine = set(gpu._opened) - opened_before
    assert len(mine) == 1  # the worker's pool, opened once for both copies
    assert cp.asnumpy(pool[: 2 * BLOCK]).tobytes() == (
        gpu_worker.expected(BLOCK, BLOCK).tobytes() + gpu_worker.expected(0, BLOCK).tobytes()
    )
    gpu_worker.call("deregister", 0)  # returns once the lease was given back
    assert not mine & set(gpu._opened)
    with pytest.raises(kvx.KvxError):
        peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK)).wait(30)
    # The peer serves on: a region registered after the revoke is reachable.
    rid = gpu_worker.call("register", BLOCK, True)
    gpu_worker.call("fill_region", rid, 9)
    host = np.zeros(BLOCK, np.uint8)
    peer2 = agent.add_peer(gpu_worker.call("metadata"))
    peer2.read(agent.register(host).descs(0, BLOCK), peer2.region(rid).descs(0, BLOCK)).wait(30)
    assert (host == 9).all()


@pytest.mark.parametrize("args", [["--backend", "cuda_ipc"], ["--backend", "tcp"]])
def test_kvx_bench_with_gpu_memory(args):
    out = subprocess.run(
        [sys.executable, "-m", "kvx", "bench", "--memory", "cuda", "--iters", "5", "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["verified"] and result["memory"] == "cuda" and result["backend"] == args[1]
    assert result["limit"] == ("cudaMemcpy device to device" if args[1] == "cuda_ipc" else "raw socket")
