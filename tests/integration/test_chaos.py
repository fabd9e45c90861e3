"""Randomised, time-bounded stress: many threads, mixed operations, faults.

Whatever happens, every transfer ends (done with the right bytes, or a kvx
error) within its timeout, and nothing is left running.
"""

import contextlib
import os
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest

import kvx
from kvx import Descs
from kvx._net import parse_address
from kvx.agent import parse_metadata
from kvx.backends.control import wire as _wire
from kvx.backends.control.wire import MsgType
from kvx.v1 import handshake_pb2
from tests.conftest import backend_setting, kvx_threads, wait_until

pytestmark = pytest.mark.slow
BLOCK = 4096
BLOCKS = 512
HALF = BLOCKS // 2


@pytest.fixture(params=["tcp", "shm", "shm-segments", "rdma"], autouse=True)
def backend(request, monkeypatch):
    """Every test here runs over tcp, over shm, over shm with cross-memory
    attach refused and the workers' pools in shared segments (the initiator's
    setting; targets offer all), and over rdma through libfabric's tcp provider."""
    return backend_setting(request.param, monkeypatch)


def test_concurrent_transfers_with_remote_churn_and_a_final_kill(make_worker, make_agent):
    threads_before = kvx_threads()
    worker = make_worker(pool_bytes=BLOCKS * BLOCK, timeouts={"io_s": 2.0})
    agent = make_agent(
        streams=2, timeouts=kvx.Timeouts(io_s=2.0, transfer_s=10), limits=kvx.Limits(max_inflight_per_peer=8)
    )
    pools = [np.zeros(BLOCKS * BLOCK, np.uint8) for _ in range(4)]
    regions = [agent.register(p) for p in pools]
    peer = agent.add_peer(worker.metadata)
    remote = peer.regions[0]
    expected = worker.expected(0, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
    stop = time.monotonic() + 6
    outcomes = {"done": 0, "failed": 0}
    problems = []
    lock = threading.Lock()

    def client(k):
        rng = random.Random(k)
        pool, region = pools[k], regions[k]
        while time.monotonic() < stop:
            n = rng.randint(1, 64)
            ids = rng.sample(range(HALF), n)  # reads come from the lower half, writes go to the upper
            local_ids = rng.sample(range(BLOCKS), n)
            notify = b"n" if rng.random() < 0.3 else None
            try:
                if rng.random() < 0.7:
                    t = peer.read(
                        Descs.from_blocks(region, local_ids, BLOCK),
                        Descs.from_blocks(remote, ids, BLOCK),
                        notify=notify,
                    )
                    t.wait(15)
                    got = pool.reshape(BLOCKS, BLOCK)[local_ids]
                    if not np.array_equal(got, expected[ids]):
                        problems.append("read returned wrong bytes")
                else:
                    t = peer.write(
                        Descs.from_blocks(region, local_ids, BLOCK),
                        Descs.from_blocks(remote, [i + HALF for i in ids], BLOCK),
                    )
                    t.wait(15)
                with lock:
                    outcomes["done"] += 1
            except kvx.KvxError:
                with lock:
                    outcomes["failed"] += 1
            except Exception as exc:  # noqa: BLE001 - anything else is a bug
                problems.append(repr(exc))

    def churn():
        rng = random.Random(99)
        while time.monotonic() < stop:
            extra = worker.call("register", BLOCK * 8, True)
            time.sleep(rng.uniform(0.01, 0.05))
            worker.call("deregister", extra)
            if rng.random() < 0.2:
                worker.freeze()
                time.sleep(rng.uniform(0.05, 0.3))
                worker.thaw()

    workers = [threading.Thread(target=client, args=(k,)) for k in range(4)] + [
        threading.Thread(target=churn)
    ]
    for th in workers:
        th.start()
    for th in workers:
        th.join(60)
    assert not any(th.is_alive() for th in workers), "a thread hung"
    assert not problems, problems[:5]
    assert outcomes["done"] > 20, outcomes

    # Kill the peer with transfers in flight: every one ends, quickly.
    inflight = [
        peer.read(
            Descs.from_blocks(regions[k], range(BLOCKS), BLOCK),
            Descs.from_blocks(remote, range(BLOCKS), BLOCK),
        )
        for k in range(4)
    ]
    worker.kill()
    for t in inflight:
        with contextlib.suppress(kvx.KvxError):
            t.wait(5)
        assert t.done()
    for region in regions:
        agent.deregister(region, timeout_s=2)
    agent.close()
    worker.stop()
    assert wait_until(lambda: kvx_threads() == threads_before, 5), kvx_threads()


def test_random_frames_never_take_the_server_down(make_worker, make_agent):
    worker = make_worker()
    md = parse_metadata(worker.metadata)
    address = parse_address(md.endpoints[0].address)
    rng = random.Random(5)
    deadline = time.monotonic() + 8
    frames = 0
    while time.monotonic() < deadline and frames < 300:
        sock = socket.create_connection(address, timeout=5)
        try:
            hello = handshake_pb2.Hello(
                name="fuzz", epoch=1, target_name=md.name, target_epoch=md.epoch, nonce=os.urandom(32)
            ).SerializeToString()
            sock.sendall(_wire.pack(MsgType.HELLO, payload_len=len(hello)) + hello)
            sock.recv(4096)
            auth = handshake_pb2.Auth().SerializeToString()
            sock.sendall(_wire.pack(MsgType.AUTH, payload_len=len(auth)) + auth)
            sock.recv(64)
            for _ in range(rng.randint(1, 5)):
                msg_type = rng.choice(list(MsgType) + [0, 99, 65535])
                payload = os.urandom(rng.choice([0, 1, 23, 24, 48, 100]))
                header = struct.pack(
                    "<4sHHQIIQ",
                    _wire.MAGIC,
                    _wire.PROTOCOL_VERSION,
                    int(msg_type),
                    rng.getrandbits(64),
                    len(payload),
                    rng.choice([0, 1, len(payload), 2**32 - 1]),
                    rng.choice([0, 1, 4096, 2**63]),
                )
                sock.sendall(header + payload)
                frames += 1
        except OSError:
            pass  # the server closed on us: allowed
        finally:
            sock.close()
    # The serving agent still serves a well-behaved peer, and its memory is intact
    # outside what the random frames could legitimately have written.
    agent = make_agent()
    pool = np.zeros(BLOCK, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    peer.read(region.descs(0, 16), peer.regions[0].descs(0, 16)).wait(10)
    assert frames > 50
