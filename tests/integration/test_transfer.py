"""READ, WRITE and notifications between agents in separate processes."""

import asyncio
import threading

import numpy as np
import pytest

import kvx
from kvx import Descs, KVLayout
from tests import conftest
from tests.conftest import SECRET, backend_setting

BLOCK = 4096


@pytest.fixture(params=["tcp", "shm", "shm-segments", "rdma", "procmem"], autouse=True)
def backend(request, monkeypatch):
    """Every test here runs over tcp, over shm, over shm with cross-memory
    attach refused and the workers' pools in shared segments (the initiator's
    setting; targets offer all), over rdma through libfabric's tcp provider,
    and over procmem, the test-only backend registered in tests/conftest.py
    that shows what adding a backend takes."""
    if request.param == "procmem" and conftest.NATIVE == "0":
        pytest.skip(
            "procmem moves bytes with pread/pwrite, not the data path KVX_NATIVE picks: "
            "it runs in the KVX_NATIVE=1 pass"
        )
    return backend_setting(request.param, monkeypatch)


def _pool(agent, nbytes=1 << 20):
    pool = kvx.alloc_shared(nbytes) if conftest.SHARED_POOLS else np.zeros(nbytes, np.uint8)
    return pool, agent.register(pool)


def test_read_lands_exactly_the_requested_bytes(make_worker, make_agent, backend):
    worker = make_worker(auth_secret=SECRET)
    agent = make_agent(auth_secret=SECRET)
    pool, region = _pool(agent)
    peer = agent.add_peer(worker.metadata)
    assert peer.name == "target" and peer.backend == backend and peer.alive
    remote_ids, local_ids = np.array([3, 7, 8, 100, 42]), np.array([0, 2, 4, 6, 8])
    t = peer.read(
        Descs.from_blocks(region, local_ids, BLOCK), Descs.from_blocks(peer.regions[0], remote_ids, BLOCK)
    )
    t.wait(10)
    assert t.state is kvx.TransferState.DONE and t.done() and t.bytes == 5 * BLOCK
    assert t.duration_s > 0 and t.throughput_gbps > 0
    expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)
    got = pool.reshape(-1, BLOCK)
    assert np.array_equal(got[local_ids], expected[remote_ids])
    untouched = np.setdiff1d(np.arange(len(got)), local_ids)
    assert not got[untouched].any()


def test_write_lands_in_remote_memory_only_where_asked(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent()
    pool, region = _pool(agent)
    pool[:] = np.arange(len(pool)) % 251
    peer = agent.add_peer(worker.metadata)
    t = peer.write(
        Descs.from_blocks(region, [1, 2], BLOCK), Descs.from_blocks(peer.regions[0], [10, 20], BLOCK)
    )
    t.wait(10)
    assert worker.call("peek", 10 * BLOCK, BLOCK) == pool[BLOCK : 2 * BLOCK].tobytes()
    assert worker.call("peek", 20 * BLOCK, BLOCK) == pool[2 * BLOCK : 3 * BLOCK].tobytes()
    # The neighbours keep the worker's original bytes.
    assert worker.call("peek", 11 * BLOCK, BLOCK) == worker.expected(11 * BLOCK, BLOCK).tobytes()
    assert worker.call("peek", 9 * BLOCK, BLOCK) == worker.expected(9 * BLOCK, BLOCK).tobytes()


@pytest.mark.parametrize("op", ["read", "write"])
def test_notification_arrives_after_the_data(make_worker, make_agent, op):
    worker = make_worker()
    agent = make_agent()
    _, region = _pool(agent)
    peer = agent.add_peer(worker.metadata)
    post = peer.read if op == "read" else peer.write
    t = post(region.descs(0, 64 * BLOCK), peer.regions[0].descs(0, 64 * BLOCK), notify=b"req-1 done")
    t.wait(10)
    # wait() returning means the notification was delivered, not merely sent.
    assert worker.call("notifications", 0.0) == [("initiator", b"req-1 done")]


def test_notification_without_data_and_size_limit(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent()
    peer = agent.add_peer(worker.metadata)
    peer.notify(b"hello").wait(10)
    assert worker.call("notifications", 5.0) == [("initiator", b"hello")]
    with pytest.raises(kvx.LimitError):
        peer.notify(b"x" * (agent.limits.max_notify_bytes + 1))


def test_many_transfers_in_flight(make_worker, make_agent):
    worker = make_worker(pool_bytes=4 << 20)
    agent = make_agent(limits=kvx.Limits(max_inflight_per_peer=16))
    pool, region = _pool(agent, 4 << 20)
    peer = agent.add_peer(worker.metadata)
    rng = np.random.default_rng(0)
    remote_ids = rng.permutation(1024)[:200]
    transfers = [
        peer.read(
            Descs.from_blocks(region, [i], BLOCK),
            Descs.from_blocks(peer.regions[0], [r], BLOCK),
            notify=f"n{i}".encode() if i % 50 == 0 else None,
        )
        for i, r in enumerate(remote_ids)
    ]  # more than the 16 slots: posting waits for one
    for t in transfers:
        t.wait(30)
    expected = worker.expected(0, 4 << 20).reshape(-1, BLOCK)
    assert np.array_equal(pool.reshape(-1, BLOCK)[:200], expected[remote_ids])
    notes = sorted(d for _, d in worker.call("notifications", 5.0))
    assert notes == [b"n0", b"n100", b"n150", b"n50"]


def test_large_transfer_split_across_streams_and_messages(make_worker, make_agent):
    # The target accepts at most 1 MiB and 100 descriptors per message, so a
    # 12 MiB transfer of 3,000 descriptors is cut into many requests, over 4 streams.
    size = 32 << 20
    worker = make_worker(pool_bytes=size, limits={"max_message_bytes": 1 << 20, "max_descs_per_message": 100})
    agent = make_agent(streams=4)
    pool, region = _pool(agent, size)
    peer = agent.add_peer(worker.metadata)
    ids = np.arange(0, 6000, 2)  # 3,000 non-adjacent 4 KiB blocks
    local = Descs.from_blocks(region, np.arange(3000), BLOCK)
    remote = Descs.from_blocks(peer.regions[0], ids, BLOCK)
    t = peer.read(local, remote, notify=b"big")
    t.wait(30)
    expected = worker.expected(0, size).reshape(-1, BLOCK)
    assert np.array_equal(pool.reshape(-1, BLOCK)[:3000], expected[ids])
    assert worker.call("notifications", 5.0) == [("initiator", b"big")]
    # And back: write the same bytes one block further on.
    peer.write(local, Descs.from_blocks(peer.regions[0], ids + 1, BLOCK)).wait(30)
    for k in (0, 1234, 2999):
        assert worker.call("peek", int(ids[k] + 1) * BLOCK, BLOCK) == expected[ids[k]].tobytes()


def test_kv_layout_transfer_between_processes(make_worker, make_agent):
    layers, blocks, block_size = 4, 64, 2048
    nbytes = layers * 2 * blocks * block_size
    worker = make_worker(pool_bytes=nbytes)
    agent = make_agent()
    pool, region = _pool(agent, nbytes)
    peer = agent.add_peer(worker.metadata)
    src = KVLayout.packed(peer.regions[0], layers, blocks, block_size)
    dst = KVLayout.packed(region, layers, blocks, block_size)
    peer.read(dst.descs([5, 6, 7]), src.descs([40, 41, 42])).wait(10)
    expected = worker.expected(0, nbytes).reshape(layers, 2, blocks, block_size)
    got = pool.reshape(layers, 2, blocks, block_size)
    assert np.array_equal(got[:, :, 5:8], expected[:, :, 40:43])


def test_the_other_process_can_initiate(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent()
    pool, region = _pool(agent)
    pool[:BLOCK] = 0x5A
    worker.call("read_from", agent.metadata(), 0, region.id, 0, BLOCK)
    assert worker.call("peek", 0, BLOCK) == b"\x5a" * BLOCK


def test_transfer_is_awaitable(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent()
    pool, region = _pool(agent)
    peer = agent.add_peer(worker.metadata)

    async def main():
        await asyncio.gather(
            *(
                peer.read(region.descs(i * BLOCK, BLOCK), peer.regions[0].descs(i * BLOCK, BLOCK))
                for i in range(8)
            )
        )
        with pytest.raises(kvx.AccessError):
            await peer.read(region.descs(0, BLOCK), peer.regions[0].descs(1 << 20, BLOCK))

    asyncio.run(main())
    assert np.array_equal(pool[: 8 * BLOCK], worker.expected(0, 8 * BLOCK))


def test_on_notify_callback_and_done_callbacks(make_agent):
    got = []
    seen = threading.Event()
    target = make_agent("cb-target", on_notify=lambda n: (got.append(n), seen.set()))
    _, remote_region = _pool(target)
    agent = make_agent()
    _, region = _pool(agent)
    peer = agent.add_peer(target.metadata())
    done = []
    t = peer.write(region.descs(0, BLOCK), remote_region.descs(0, BLOCK), notify=b"cb")
    t.add_done_callback(done.append)
    t.wait(10)
    assert seen.wait(5) and got == [kvx.Notification("initiator", b"cb")]
    assert done == [t]
    late = []
    t.add_done_callback(late.append)  # already finished: called at once
    assert late == [t]
    assert target.notifications() == []  # the callback took it, nothing queued


def test_wait_timeout_leaves_the_transfer_running(make_worker, make_agent):

    worker = make_worker()
    agent = make_agent()
    _, region = _pool(agent)
    peer = agent.add_peer(worker.metadata)
    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        with pytest.raises(kvx.TimeoutError):
            t.wait(0.2)
        assert t.state is kvx.TransferState.PENDING
    finally:
        worker.thaw()
    t.wait(10)
    assert t.state is kvx.TransferState.DONE
