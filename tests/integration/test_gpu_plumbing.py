"""kvx's GPU paths end to end on the CPU: two agents, real sockets, GPU
memory played by tests/unit/fake_cuda.py (host memory behind
``__cuda_array_interface__``, streams that run only when waited for, and the
real copy kernel compiled for the CPU).

This checks the plumbing: which path a transfer takes, the staging pipeline
on the initiator and on the serving side, the cuda_ipc pin with its handles,
and that every byte lands where it should. The CUDA API itself, and CUDA IPC
between processes, are tested on a GPU in tests/gpu/.
"""

import sys
import threading
import time
import types

import numpy as np
import pytest

import kvx
from kvx import Descs
from kvx._datapath import gpu
from kvx._datapath import staging as _staging
from kvx.agent import parse_metadata
from tests.conftest import wait_until
from tests.integration.test_faults import _read_message, _session
from tests.unit import fake_cuda

BLOCK = 32 * 1024
BLOCKS = 200


@pytest.fixture(scope="module")
def kernel_lib(tmp_path_factory):
    lib = fake_cuda.build_kernel(tmp_path_factory.mktemp("fake-cuda"))
    if lib is None:
        pytest.skip("no C++ compiler for the CPU build of the copy kernel (apt-get install g++)")
    return lib


@pytest.fixture
def fake(monkeypatch, kernel_lib):
    cupy = fake_cuda.make(kernel_lib)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    arrays = []
    monkeypatch.setattr(gpu, "_allocation", fake_cuda.allocation_of(arrays))
    # Small chunks: a transfer takes many turns of the two-buffer pipeline.
    monkeypatch.setattr(_staging, "CHUNK_BYTES", 256 * 1024)
    gpu._local.__dict__.clear()  # no engine from another test's fake
    gpu._modules.clear()

    def device_array(data):
        arr = fake_cuda.DeviceArray(data)
        arrays.append(arr)
        return arr

    cupy.device_array = device_array
    yield cupy
    gpu._local.__dict__.clear()
    gpu._modules.clear()


def _pair(make_agent, backend):
    a = make_agent("gpu-initiator", backend=backend)
    b = make_agent("gpu-target", backend=backend)
    return a, b


@pytest.mark.parametrize("backend", ["tcp", "cuda_ipc"])
def test_gpu_to_gpu_read_and_write(fake, make_agent, backend):
    a, b = _pair(make_agent, backend)
    rng = np.random.default_rng(0)
    theirs = fake.device_array(rng.integers(0, 256, 2 * BLOCKS * BLOCK, dtype=np.uint8))
    mine = fake.device_array(np.zeros(2 * BLOCKS * BLOCK, np.uint8))
    remote_region = b.register(theirs)
    local_region = a.register(mine)
    assert local_region.memory_kind is kvx.MemoryKind.CUDA and len(local_region.ipc_handle) == 64
    peer = a.add_peer(b.metadata())
    assert peer.backend == backend
    assert ("CUDA IPC" if backend == "cuda_ipc" else "pinned host buffers") in peer.backend_reason
    local_ids, remote_ids = rng.permutation(2 * BLOCKS)[:BLOCKS], rng.permutation(2 * BLOCKS)[:BLOCKS]
    local = Descs.from_blocks(local_region, local_ids, BLOCK)
    remote = Descs.from_blocks(peer.region(remote_region.id), remote_ids, BLOCK)
    launches = fake.state["launches"]
    peer.read(local, remote).wait(30)
    assert fake.state["launches"] > launches  # the bytes went through the copy kernel
    got = mine.host.reshape(-1, BLOCK)
    assert np.array_equal(got[local_ids], theirs.host.reshape(-1, BLOCK)[remote_ids])
    assert not got[np.setdiff1d(np.arange(2 * BLOCKS), local_ids)].any()
    mine.host[:] = 9
    peer.write(
        local[:50], Descs.from_blocks(peer.region(remote_region.id), np.arange(50), BLOCK), notify=b"kv-ready"
    ).wait(30)
    assert (theirs.host[: 50 * BLOCK] == 9).all() and (theirs.host[50 * BLOCK :] != 9).any()
    assert [n.data for n in b.notifications(5)] == [b"kv-ready"]


@pytest.mark.parametrize("backend", ["tcp", "cuda_ipc"])
def test_host_memory_with_gpu_memory_goes_through_the_staging_buffers(fake, make_agent, backend):
    a, b = _pair(make_agent, backend)
    theirs = fake.device_array(np.arange(64 * BLOCK, dtype=np.uint32).view(np.uint8)[: 64 * BLOCK])
    host = np.zeros(64 * BLOCK, np.uint8)
    remote_region, local_region = b.register(theirs), a.register(host)
    peer = a.add_peer(b.metadata())
    ids = np.arange(64)[::-1]
    peer.read(
        Descs.from_blocks(local_region, np.arange(64), BLOCK),
        Descs.from_blocks(peer.region(remote_region.id), ids, BLOCK),
    ).wait(30)
    assert np.array_equal(host.reshape(-1, BLOCK), theirs.host.reshape(-1, BLOCK)[ids])
    # And the other way: GPU memory here, host memory there.
    there = np.zeros(64 * BLOCK, np.uint8)
    host_remote = b.register(there)
    peer = a.add_peer(b.metadata())
    gpu_local = a.register(fake.device_array(np.full(64 * BLOCK, 5, np.uint8)))
    peer.write(gpu_local.descs(0, 64 * BLOCK), peer.region(host_remote.id).descs(0, 64 * BLOCK)).wait(30)
    assert (there == 5).all()


def test_descriptors_must_not_mix_host_and_gpu_memory(fake, make_agent):
    a, b = _pair(make_agent, "auto")
    remote_region = b.register(fake.device_array(np.zeros(4 * BLOCK, np.uint8)))
    dev = a.register(fake.device_array(np.zeros(BLOCK, np.uint8)))
    host = a.register(np.zeros(BLOCK, np.uint8))
    peer = a.add_peer(b.metadata())
    with pytest.raises(kvx.ConfigError, match="CUDA device 0 and host memory"):
        peer.read(
            Descs.concat([dev.descs(0, 16), host.descs(0, 16)]), peer.region(remote_region.id).descs(0, 32)
        )
    with pytest.raises(kvx.AccessError):
        peer.read(dev.descs(0, BLOCK), peer.region(remote_region.id).descs(4 * BLOCK - 8, BLOCK))
    peer.read(dev.descs(0, BLOCK), peer.region(remote_region.id).descs(0, BLOCK)).wait(30)


def test_a_target_whose_memory_cannot_be_shared_refuses_the_ipc_pin(fake, make_agent):
    a, b = _pair(make_agent, "cuda_ipc")
    remote_region = b.register(fake.device_array(np.ones(BLOCK, np.uint8)))
    published = b.metadata()
    object.__setattr__(remote_region, "ipc_handle", b"")  # as for cudaMallocAsync or VMM memory
    local_region = a.register(fake.device_array(np.zeros(BLOCK, np.uint8)))
    peer = a.add_peer(published)
    # The metadata says cuda_ipc (it was published before); the target's own check refuses.
    with pytest.raises(kvx.AccessError, match="cannot be opened through CUDA IPC"):
        peer.read(local_region.descs(0, BLOCK), peer.region(remote_region.id).descs(0, BLOCK)).wait(30)
    # A peer that learns the region is not shareable stages it instead.
    peer = a.add_peer(b.metadata())
    assert not peer._table[1][remote_region.id] & 32
    peer.read(local_region.descs(0, BLOCK), peer.region(remote_region.id).descs(0, BLOCK)).wait(30)


def test_only_whole_writable_allocations_are_shared_through_cuda_ipc(fake, make_agent):
    """The attack: a handle opens the whole allocation read-write, so a peer
    that got one for part of an allocation, or for memory registered
    read-only, could reach memory never registered, or write memory it may
    only read. Such regions are not offered through CUDA IPC, an IPC pin on
    them is refused, and the bytes still move, staged over tcp."""
    from kvx.backends.control import wire as _wire
    from kvx.backends.control.wire import MsgType

    a, b = _pair(make_agent, "cuda_ipc")
    allocation = fake.device_array(np.arange(4 * BLOCK, dtype=np.uint32).view(np.uint8)[: 4 * BLOCK].copy())
    part = b.register((allocation.host.ctypes.data + BLOCK, 2 * BLOCK), device=0)
    frozen = fake.device_array(np.full(BLOCK, 7, np.uint8))
    frozen.__cuda_array_interface__["data"] = (frozen.host.ctypes.data, True)  # read-only
    read_only = b.register(frozen)
    whole = b.register(fake.device_array(np.zeros(BLOCK, np.uint8)))
    assert (part.ipc_handle, read_only.ipc_handle) == (b"", b"") and len(whole.ipc_handle) == 64
    md = parse_metadata(b.metadata())
    assert {r.id: r.cuda_ipc for r in md.regions} == {part.id: False, read_only.id: False, whole.id: True}
    assert not read_only.remote_write
    # A peer that asks for the handles anyway is refused by the target.
    sock, _ = _session(types.SimpleNamespace(metadata=b.metadata()))
    # Leases (PIN_KEEP) are held to the same rule as pins.
    asks = [(rid, keep) for rid in (part.id, read_only.id) for keep in (0, _wire.PIN_KEEP)]
    for request_id, (rid, keep) in enumerate(asks, 1):
        ids = np.array([rid], "<u4").tobytes()
        aux = _wire.PIN_READ | _wire.PIN_IPC | keep
        sock.sendall(_wire.pack(MsgType.SHM_PIN, request_id, payload_len=4, aux=aux) + ids)
        (msg_type, aux), text = _read_message(sock)
        assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"through CUDA IPC" in text
    sock.close()
    # The bytes move all the same, through the staging buffers.
    mine = fake.device_array(np.zeros(2 * BLOCK, np.uint8))
    local = a.register(mine)
    peer = a.add_peer(b.metadata())
    peer.read(local.descs(0, 2 * BLOCK), peer.region(part.id).descs(0, 2 * BLOCK)).wait(30)
    assert np.array_equal(mine.host, allocation.host[BLOCK : 3 * BLOCK])


def test_cuda_ipc_needs_no_cross_memory_attach(fake, make_agent, monkeypatch):
    from kvx.backends import shm

    monkeypatch.setattr(
        shm, "probe", lambda md: "cross-memory attach to pid 1 is not permitted (EPERM): test"
    )
    a, b = _pair(make_agent, "auto")
    theirs = fake.device_array(np.arange(8 * BLOCK, dtype=np.uint8) % 251)
    remote_region = b.register(theirs)
    host_remote = b.register(np.full(BLOCK, 4, np.uint8))
    mine = fake.device_array(np.zeros(8 * BLOCK, np.uint8))
    local_region = a.register(mine)
    host_local = a.register(np.zeros(BLOCK, np.uint8))
    peer = a.add_peer(b.metadata())
    assert peer.backend == "cuda_ipc" and "host memory over tcp" in peer.backend_reason
    assert not peer._channel.cma
    launches = fake.state["launches"]
    peer.read(local_region.descs(0, 8 * BLOCK), peer.region(remote_region.id).descs(0, 8 * BLOCK)).wait(30)
    assert np.array_equal(mine.host, theirs.host) and fake.state["launches"] > launches
    peer.read(host_local.descs(0, BLOCK), peer.region(host_remote.id).descs(0, BLOCK)).wait(30)
    assert (host_local.owner == 4).all()


def _leased_pair(fake, make_agent, blocks=8):
    a, b = _pair(make_agent, "cuda_ipc")
    theirs = fake.device_array(np.arange(blocks * BLOCK, dtype=np.uint32).view(np.uint8)[: blocks * BLOCK])
    remote_region = b.register(theirs)
    mine = fake.device_array(np.zeros(blocks * BLOCK, np.uint8))
    local_region = a.register(mine)
    peer = a.add_peer(b.metadata())
    assert peer.backend == "cuda_ipc"
    return a, b, peer, theirs, remote_region, mine, local_region


def test_cuda_ipc_copies_through_a_lease_with_no_message_to_the_target(fake, make_agent):
    """The first GPU transfer on a region leases it with its IPC handle;
    later ones are checked against the lease and copied at once: no
    SHM_PIN, no answer awaited. Deregistering the region on the target
    revokes the lease; a transfer after it is refused, with no byte moved."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)
    conn = peer._channel.link.conns[0]
    lease = conn.leases[(remote_region.id, False)]
    assert lease[1] == remote_region.size_bytes and len(lease) == 2 + 9  # (base, size), offset, handle
    assert bytes(np.array(lease[3:], np.uint64)) == remote_region.ipc_handle
    submitted = []
    original = conn.submit
    conn.submit = lambda *args: (submitted.append(args), original(*args))[1]
    launches = fake.state["launches"]
    for k in range(1, 6):
        transfer = peer.read(local_region.descs(k * BLOCK, BLOCK), remote.descs(k * BLOCK, BLOCK))
        assert transfer.done()  # copied on this thread
        transfer.wait(1)
    assert submitted == [] and fake.state["launches"] - launches == 5
    assert np.array_equal(mine.host[: 6 * BLOCK], theirs.host[: 6 * BLOCK])
    # A WRITE on the same region takes a lease of its own (write access is checked apart).
    mine.host[:BLOCK] = 0xAB
    peer.write(local_region.descs(0, BLOCK), remote.descs(7 * BLOCK, BLOCK), notify=b"w").wait(30)
    assert (theirs.host[7 * BLOCK : 8 * BLOCK] == 0xAB).all() and (remote_region.id, True) in conn.leases
    assert [n.data for n in b.notifications(5)] == [b"w"]
    started = time.monotonic()
    b.deregister(remote_region, timeout_s=10)  # the live peer gives the leases back at once
    assert time.monotonic() - started < 5
    assert (remote_region.id, False) not in conn.leases and (remote_region.id, True) not in conn.leases
    mine.host[:] = 0
    with pytest.raises(kvx.AccessError, match="unknown region"):
        peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)
    assert not mine.host.any()


def test_a_leased_gpu_copy_is_one_c_check_and_one_launch(fake, make_agent, monkeypatch):
    """Through a lease, a GPU transfer is checked and turned into the copy
    kernel's arguments by one C call (leased_triples) on the posting thread;
    what that check refuses goes down the full path, which names the error,
    with no byte moved. Another process's lease is mapped once and kept."""
    from kvx._datapath import io as _io

    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    _as_another_process(peer)  # the IPC handle is opened, as in a process of its own
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased from here on
    calls = []
    real = _io.leased_triples
    monkeypatch.setattr(_io, "leased_triples", lambda *args: (calls.append(args), real(*args))[1])
    opened = gpu.IpcMap.open
    opens = []
    monkeypatch.setattr(gpu.IpcMap, "open", lambda self, h: (opens.append(h), opened(self, h))[1])
    launches = fake.state["launches"]
    local = Descs.from_blocks(local_region, [5, 1, 3], BLOCK)
    theirs_ids = [2, 7, 4]
    for _ in range(3):
        transfer = peer.read(local, Descs.from_blocks(remote, theirs_ids, BLOCK))
        assert transfer.done()  # copied on this thread
        transfer.wait(1)
    assert len(calls) == 3 and fake.state["launches"] - launches == 3
    assert len(opens) == 1  # the mapping is kept with the lease, not looked up per copy
    got, want = mine.host.reshape(-1, BLOCK), theirs.host.reshape(-1, BLOCK)
    assert all(np.array_equal(got[m], want[t]) for m, t in zip([5, 1, 3], theirs_ids, strict=True))
    # Refused by the C check, then named by the full path; nothing moves.
    before = mine.host.copy()
    with pytest.raises(kvx.AccessError):
        peer.read(local_region.descs(0, BLOCK), remote.descs(remote_region.size_bytes - 8, BLOCK)).wait(30)
    host = a.register(np.zeros(BLOCK, np.uint8))
    peer.read(host.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # host memory: not this path
    assert len(calls) == 4  # the refused one was tried; the host one was not
    assert np.array_equal(mine.host, before)


def test_what_the_leased_gpu_path_leaves_the_full_path_copies(fake, make_agent, monkeypatch):
    """Transfers the one-C-call path does not take still copy, through the
    full path: remote blocks in two regions, more triples than one launch
    carries, and KVX_CUDA_COPY=memcpy."""
    from kvx._datapath import io as _io

    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    other = fake.device_array(np.full(2 * BLOCK, 0x3C, np.uint8))
    second = b.register(other)
    peer = a.add_peer(b.metadata())
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # both leased
    peer.read(local_region.descs(0, BLOCK), peer.region(second.id).descs(0, BLOCK)).wait(30)
    taken = []
    real = _io.leased_triples

    def traced(*args):
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(_io, "leased_triples", traced)
    both = Descs.concat([remote.descs(3 * BLOCK, BLOCK), peer.region(second.id).descs(BLOCK, BLOCK)])
    peer.read(local_region.descs(0, 2 * BLOCK), both).wait(30)
    assert taken == [(1, 1)]  # the second region is not in the lease the call holds
    assert np.array_equal(mine.host[:BLOCK], theirs.host[3 * BLOCK : 4 * BLOCK])
    assert (mine.host[BLOCK : 2 * BLOCK] == 0x3C).all()
    monkeypatch.setattr(gpu, "MAX_LAUNCH_PIECES", 2)  # three blocks: the C check says (3, 3)
    mine.host[:] = 0
    local = Descs.from_blocks(local_region, [0, 1, 2], BLOCK)
    peer.read(local, Descs.from_blocks(remote, [6, 4, 5], BLOCK)).wait(30)
    assert taken[1:] == [(3, 3)]
    got, want = mine.host.reshape(-1, BLOCK), theirs.host.reshape(-1, BLOCK)
    assert np.array_equal(got[:3], want[[6, 4, 5]])
    # One cudaMemcpyAsync per block: a channel opened then never takes the C path.
    monkeypatch.setattr(gpu, "MAX_LAUNCH_PIECES", 1 << 16)
    monkeypatch.setenv("KVX_CUDA_COPY", "memcpy")
    c = make_agent(name="memcpy-initiator", backend="cuda_ipc")
    mine2 = fake.device_array(np.zeros(2 * BLOCK, np.uint8))
    region2 = c.register(mine2)
    peer2 = c.add_peer(b.metadata())
    for _ in range(2):
        peer2.read(region2.descs(0, BLOCK), peer2.region(remote_region.id).descs(BLOCK, BLOCK)).wait(30)
    assert len(taken) == 2  # none more
    assert np.array_equal(mine2.host[:BLOCK], theirs.host[BLOCK : 2 * BLOCK])


def test_a_leased_gpu_copy_that_cannot_start_gives_its_lease_back(fake, make_agent, monkeypatch):
    """A failure before the launch (here: the thread's engine cannot be
    made) fails the transfer, and the lease's use is given back: the
    target's deregister does not wait on it."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased

    def broken(device):
        raise kvx.ConfigError("KVX_CUDA_SPIN_US must be a whole number of microseconds")

    monkeypatch.setattr(gpu, "engine", broken)
    with pytest.raises(kvx.ConfigError, match="KVX_CUDA_SPIN_US"):
        peer.read(local_region.descs(BLOCK, BLOCK), remote.descs(BLOCK, BLOCK)).wait(30)
    conn = peer._channel.link.conns[0]
    assert not conn.lease_uses and not conn.copies
    started = time.monotonic()
    b.deregister(remote_region, timeout_s=5)
    assert time.monotonic() - started < 3


def test_an_interrupt_between_a_leased_copys_launch_and_its_wait_waits_for_the_copy(
    fake, make_agent, monkeypatch
):
    """A KeyboardInterrupt after the launch, before the wait has begun, gave
    the lease back while the copy could still be running (the stand-in's
    copies run only when their event is waited for: here, never). The copy
    now ends before the lease is given back and the interrupt goes on."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased
    conn = peer._channel.link.conns[0]
    uses_at_unlease = []
    unlease = conn.unlease

    def recording_unlease(regions):
        uses_at_unlease.append(mine.host[BLOCK : 2 * BLOCK].copy())
        return unlease(regions)

    def interrupted(self, event):
        raise KeyboardInterrupt

    monkeypatch.setattr(conn, "unlease", recording_unlease)
    monkeypatch.setattr(gpu.Engine, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        peer.read(local_region.descs(BLOCK, BLOCK), remote.descs(BLOCK, BLOCK))
    # When the lease was given back, the block had landed: the copy had ended.
    assert len(uses_at_unlease) == 1
    assert np.array_equal(uses_at_unlease[0], theirs.host[BLOCK : 2 * BLOCK])
    assert not conn.lease_uses and not conn.copies


def test_a_lease_placed_past_its_allocation_is_not_copied_through(fake, make_agent):
    """The one-C-call path bounds a lease by the allocation's length, as
    the full path does, when it maps the lease (once per lease)."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    _as_another_process(peer)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased, honestly
    channel = peer._channel
    honest = channel._link.conns[0].leases[(remote_region.id, False)]
    length = remote_region.size_bytes
    for size, offset in ((length + 1, 0), (length, 1), (8, length - 7), (1, 1 << 63)):
        lie = (honest[0], size, offset, *honest[3:])
        assert channel._leased_args(0, remote_region.id, False, lie) is None
    assert channel._leased_args(0, remote_region.id, False, honest)[2].tolist()[1] == length
    assert channel._leased_args(0, remote_region.id, False, honest[:2]) is None  # a host lease


def test_a_copy_under_way_through_an_ipc_lease_holds_deregister(fake, make_agent, monkeypatch):
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased from here on
    entered, release = threading.Event(), threading.Event()
    wait = gpu.Engine.wait

    def slow_copy(self, event):  # launched: the GPU copies until the wait ends
        entered.set()
        assert release.wait(30)
        return wait(self, event)

    monkeypatch.setattr(gpu.Engine, "wait", slow_copy)
    reader = threading.Thread(
        target=lambda: peer.read(local_region.descs(BLOCK, BLOCK), remote.descs(BLOCK, BLOCK)).wait(30)
    )
    reader.start()
    assert entered.wait(10)
    with pytest.raises(kvx.RegionBusyError, match="lease"):
        b.deregister(remote_region, timeout_s=0.5)  # the copy still runs on the GPU
    release.set()
    reader.join(10)
    assert np.array_equal(mine.host[BLOCK : 2 * BLOCK], theirs.host[BLOCK : 2 * BLOCK])
    b.deregister(remote_region, timeout_s=10)


def test_an_initiator_that_goes_away_gives_its_ipc_leases_back(fake, make_agent):
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    peer.read(local_region.descs(0, BLOCK), peer.region(remote_region.id).descs(0, BLOCK)).wait(30)
    a.close()
    started = time.monotonic()
    b.deregister(remote_region, timeout_s=10)
    assert time.monotonic() - started < 5


def _as_another_process(peer):
    """Make the initiator open the target's handles as a process of its own
    would (the agents of these tests share one process, where it need not)."""
    peer._channel.pid = -1


def test_a_target_cannot_steer_ipc_copies_outside_the_allocation(fake, make_agent, monkeypatch):
    """The target says where a region lies in its allocation; the driver says
    how long the allocation is. A region placed past its end is refused with
    no byte moved, and the connection to that target ends with its leases
    (each copy through a lease checks the bound again)."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    _as_another_process(peer)
    victim = fake.device_array(np.zeros(2 * BLOCK, np.uint8))  # memory of the initiator's, never registered
    from kvx.memory import RegionTable

    export = RegionTable.ipc_export
    lie = victim.host.ctypes.data - theirs.host.ctypes.data  # "the region starts in the victim"

    def lying_export(self, ids, who):
        honest = export(self, ids, who)
        return (lie % (1 << 64)).to_bytes(8, "little") + honest[8:]

    monkeypatch.setattr(RegionTable, "ipc_export", lying_export)
    mine.host[:] = 0x5A
    remote = peer.region(remote_region.id)
    with pytest.raises(kvx.ProtocolError, match="offset"):
        peer.write(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)
    assert wait_until(lambda: not peer._channel.link.alive and not peer._channel._maps, 10)
    with pytest.raises(kvx.PeerLostError):
        peer.write(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)
    assert not victim.host.any() and (theirs.host[:BLOCK] != 0x5A).any()
    # An honest target's lease copies through the same map.
    monkeypatch.setattr(RegionTable, "ipc_export", export)
    b.deregister(remote_region, timeout_s=10)
    honest = b.register(theirs)
    peer = a.add_peer(b.metadata())
    _as_another_process(peer)
    peer.write(local_region.descs(0, BLOCK), peer.region(honest.id).descs(0, BLOCK)).wait(30)
    assert (theirs.host[:BLOCK] == 0x5A).all() and not victim.host.any()


def test_a_region_leased_twice_differently_ends_the_connection(fake, make_agent, monkeypatch):
    """Two pins of one region asked at once are both answered with a lease;
    an honest target gives the same one twice. A second answer that places
    the region elsewhere is a protocol error: the connection ends, and no
    byte moves through either lease."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased
    from kvx.memory import RegionTable

    export = RegionTable.ipc_export
    monkeypatch.setattr(
        RegionTable,
        "ipc_export",
        lambda self, ids, who: BLOCK.to_bytes(8, "little") + export(self, ids, who)[8:],
    )
    conn = peer._channel.link.conns[0]
    lease = conn.lease
    conn.lease = lambda regions, writing: None  # as if this pin had been asked before the lease came
    mine.host[:] = 0
    with pytest.raises(kvx.ProtocolError, match="twice"):
        peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)
    conn.lease = lease
    assert wait_until(lambda: not peer._channel.link.alive and not peer._channel._maps, 10)
    assert not mine.host.any()


def test_a_revoked_lease_closes_its_ipc_mapping(fake, make_agent):
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    _as_another_process(peer)
    second = b.register(fake.device_array(np.ones(BLOCK, np.uint8)))
    peer = a.add_peer(b.metadata())
    _as_another_process(peer)
    for rid in (remote_region.id, second.id):
        peer.read(local_region.descs(0, BLOCK), peer.region(rid).descs(0, BLOCK)).wait(30)
    (ipc_map,) = peer._channel._maps.values()
    assert set(ipc_map._held) == {remote_region.ipc_handle, second.ipc_handle}
    b.deregister(remote_region, timeout_s=10)
    # Closed before the target let the region go; the other region's mapping stays.
    assert set(ipc_map._held) == {second.ipc_handle}
    assert (0, remote_region.ipc_handle) not in gpu._opened
    peer.read(local_region.descs(0, BLOCK), peer.region(second.id).descs(0, BLOCK)).wait(30)
    assert (mine.host[:BLOCK] == 1).all()


def test_a_lease_answer_of_the_wrong_shape_ends_the_connection(fake, make_agent, monkeypatch):
    """A lease whose answer carries more or fewer words per region than its
    kind has is a protocol error: nothing is leased, the connection ends."""
    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent)
    from kvx.memory import RegionTable

    export = RegionTable.ipc_export
    monkeypatch.setattr(RegionTable, "ipc_export", lambda self, ids, who: export(self, ids, who) + bytes(8))
    with pytest.raises((kvx.ProtocolError, kvx.PeerLostError)):
        peer.read(local_region.descs(0, BLOCK), peer.region(remote_region.id).descs(0, BLOCK)).wait(30)
    assert peer._channel.link.conns[0].leases == {}
    deadline = time.monotonic() + 10  # the transfer fails first, then the reader ends the link
    while peer._channel.link.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not peer._channel.link.alive


def test_large_transfers_and_many_blocks_on_the_ipc_path(fake, make_agent, monkeypatch):
    """Above INLINE_COPY_BYTES a leased transfer is copied on a reader (the
    caller does not wait for it); a transfer of more blocks than one launch
    takes is copied in several launches."""
    from kvx.backends import cuda_ipc

    a, b, peer, theirs, remote_region, mine, local_region = _leased_pair(fake, make_agent, blocks=64)
    remote = peer.region(remote_region.id)
    peer.read(local_region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(30)  # leased from here on
    conn = peer._channel.link.conns[0]
    submitted = []
    original = conn.submit
    conn.submit = lambda *args: (submitted.append(args), original(*args))[1]
    monkeypatch.setattr(cuda_ipc, "INLINE_COPY_BYTES", 4 * BLOCK)
    monkeypatch.setattr(gpu, "MAX_LAUNCH_PIECES", 7)
    ids = np.arange(64)[::-1]
    launches = fake.state["launches"]
    peer.read(
        Descs.from_blocks(local_region, np.arange(64), BLOCK), Descs.from_blocks(remote, ids, BLOCK)
    ).wait(30)
    assert submitted  # through the readers: pins of the leased regions
    assert fake.state["launches"] - launches == 10  # 64 blocks, 7 a launch
    assert np.array_equal(mine.host.reshape(-1, BLOCK), theirs.host.reshape(-1, BLOCK)[ids])
    b.deregister(remote_region, timeout_s=10)  # the lease asked for again is still one lease
