"""KvxTransferEngine: SGLang's address-based transfer interface over kvx agents."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest

from kvx.connectors.sglang.engine import KvxTransferEngine


@pytest.fixture
def engines():
    made = []

    def make(name):
        engine = KvxTransferEngine(name)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_batch_write_by_address(engines) -> None:
    src, dst = engines("prefill-0"), engines("decode-0")
    kv_src = np.arange(1 << 16, dtype=np.uint8)
    aux_src = np.full(256, 7, dtype=np.uint8)
    kv_dst = np.zeros(1 << 16, dtype=np.uint8)
    aux_dst = np.zeros(256, dtype=np.uint8)
    assert src.batch_register([kv_src.ctypes.data, aux_src.ctypes.data], [kv_src.nbytes, aux_src.nbytes]) == 0
    assert dst.batch_register([kv_dst.ctypes.data, aux_dst.ctypes.data], [kv_dst.nbytes, aux_dst.nbytes]) == 0
    s, d = kv_src.ctypes.data, kv_dst.ctypes.data
    # Pages 3 and 9 land in pages 1 and 5; the aux buffer whole.
    rc = src.batch_transfer_sync(
        dst.get_session_id(),
        [s + 3 * 4096, s + 9 * 4096, aux_src.ctypes.data],
        [d + 1 * 4096, d + 5 * 4096, aux_dst.ctypes.data],
        [4096, 4096, 256],
    )
    assert rc == 0
    assert np.array_equal(kv_dst[4096:8192], kv_src[3 * 4096 : 4 * 4096])
    assert np.array_equal(kv_dst[5 * 4096 : 6 * 4096], kv_src[9 * 4096 : 10 * 4096])
    assert not kv_dst[:4096].any() and not kv_dst[8192 : 5 * 4096].any()
    assert (aux_dst == 7).all()
    assert src.send_probe(dst.get_session_id()) == 0


def test_ranges_outside_registered_memory_are_refused(engines) -> None:
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.ones(4096, dtype=np.uint8)
    b = np.zeros(8192, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, 4096)  # only the first half
    session = dst.get_session_id()
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data + 4096], [4096]) == -1
    assert src.batch_transfer_sync(session, [a.ctypes.data + 1], [b.ctypes.data], [4096]) == -1
    assert not b.any()
    dst.deregister(b.ctypes.data)
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == -1
    assert not b.any()


def test_dead_peer_is_an_error_not_a_hang(engines) -> None:
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.ones(4096, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    session = dst.get_session_id()
    dst.close()
    assert src.send_probe(session) == -1
    assert src.batch_transfer_sync(session, [a.ctypes.data], [0x1000], [16]) == -1


def test_first_contact_happens_once_when_threads_race(engines) -> None:
    """SGLang's transfer threads reach a new peer at once: one connection
    set, one peer, every transfer lands."""
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.arange(1 << 16, dtype=np.uint8)
    b = np.zeros(1 << 16, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, b.nbytes)
    session = dst.get_session_id()
    threads = 8
    start = threading.Barrier(threads)

    def send(k: int) -> int:
        start.wait()
        return src.batch_transfer_sync(
            session, [a.ctypes.data + k * 4096], [b.ctypes.data + k * 4096], [4096]
        )

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        assert list(pool.map(send, range(threads))) == [0] * threads
    assert np.array_equal(b[: threads * 4096], a[: threads * 4096])
    [peer] = src.agent.peers
    inbound = dst.agent._listener._inbound
    assert len(inbound) == peer.streams, f"{len(inbound)} connections for one peer of {peer.streams} streams"


def test_a_bug_in_a_transfer_fails_it_instead_of_escaping(engines, monkeypatch, caplog) -> None:
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.ones(4096, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, b.nbytes)
    session = dst.get_session_id()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in address translation")

    monkeypatch.setattr(src._local, "descs", broken)
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == -1
    assert "a bug in address translation" in caplog.text
    assert not b.any()
    monkeypatch.setattr(src.agent, "add_peer", broken)
    src._peers.clear()
    assert src.send_probe(session) == -1
    monkeypatch.undo()
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == 0
    assert (b == 1).all()


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_the_backend_setting_reaches_the_agent(engines, backend) -> None:
    src = KvxTransferEngine("prefill-b", backend=backend)
    dst = engines("decode-b")
    try:
        a = np.ones(4096, dtype=np.uint8)
        b = np.zeros(4096, dtype=np.uint8)
        src.register(a.ctypes.data, a.nbytes)
        dst.register(b.ctypes.data, b.nbytes)
        assert src.batch_transfer_sync(dst.get_session_id(), [a.ctypes.data], [b.ctypes.data], [4096]) == 0
        [peer] = src.agent.peers
        assert peer.backend == ("tcp" if backend == "tcp" else "shm"), peer.backend_reason
    finally:
        src.close()
