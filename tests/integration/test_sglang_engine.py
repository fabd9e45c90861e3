"""KvxTransferEngine: SGLang's address-based transfer interface over kvx agents."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest

from kvx._net import parse_address
from kvx.agent import Peer
from kvx.connectors.sglang.engine import MAX_FAILURES, KvxTransferEngine
from kvx.errors import AccessError


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


def _established_to(endpoint: str) -> int:
    """TCP connections accepted on ``endpoint``'s port and still open, from the kernel's
    tables (this host's network namespace), not from kvx's own bookkeeping."""
    _, port = parse_address(endpoint)
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # 01: ESTABLISHED
                count += 1
    return count


def test_first_contact_happens_once_when_threads_race(engines, monkeypatch) -> None:
    """SGLang's transfer threads reach a new peer at once: one side-channel fetch, one
    add_peer, one peer, one connection set, and every transfer lands."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("counts connections from /proc/net/tcp (Linux)")
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.arange(1 << 16, dtype=np.uint8)
    b = np.zeros(1 << 16, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, b.nbytes)
    session = dst.get_session_id()
    threads = 8
    start = threading.Barrier(threads)
    contacts = []
    add_peer = src.agent.add_peer

    def slow_add_peer(metadata: bytes):
        contacts.append(threading.get_ident())
        time.sleep(0.2)  # holds the race open: without the engine's lock, every thread gets here
        return add_peer(metadata)

    monkeypatch.setattr(src.agent, "add_peer", slow_add_peer)

    def send(k: int) -> int:
        start.wait()
        return src.batch_transfer_sync(
            session, [a.ctypes.data + k * 4096], [b.ctypes.data + k * 4096], [4096]
        )

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        assert list(pool.map(send, range(threads))) == [0] * threads
    assert np.array_equal(b[: threads * 4096], a[: threads * 4096])
    assert len(contacts) == 1, f"{len(contacts)} first contacts with one session"
    [peer] = src.agent.peers
    assert _established_to(dst.agent.endpoint) == peer.streams
    assert not src._contacts, "the per-session contact locks outlived the contact"


def test_a_transfer_whose_post_raises_fails_with_its_reason(engines, monkeypatch, caplog) -> None:
    src, dst = engines("prefill-0"), engines("decode-0")
    a = np.ones(4096, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    src.register(a.ctypes.data, a.nbytes)
    dst.register(b.ctypes.data, b.nbytes)
    session = dst.get_session_id()
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == 0
    b[:] = 0

    def broken_write(self, local, remote, notify=None):
        raise RuntimeError("the post broke")

    monkeypatch.setattr(Peer, "write", broken_write)
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == -1
    assert "the post broke" in caplog.text
    assert src.failure(session) == "RuntimeError: the post broke"
    assert not b.any()

    def refused_write(self, local, remote, notify=None):
        raise AccessError("region 7 is not writable")

    monkeypatch.setattr(Peer, "write", refused_write)
    assert src.transfer_sync(session, a.ctypes.data, b.ctypes.data, 4096) == -1
    assert src.failure(session) == "region 7 is not writable"
    monkeypatch.undo()
    # The failed peer was dropped: the next transfer contacts the session again, and lands.
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == 0
    assert (b == 1).all()
    assert src.failure(session) is None


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
    assert "a bug in address translation" in (src.failure(session) or "")
    assert not b.any()
    monkeypatch.setattr(src.agent, "add_peer", broken)
    src._peers.clear()
    assert src.send_probe(session) == -1
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == -1
    monkeypatch.undo()
    assert src.batch_transfer_sync(session, [a.ctypes.data], [b.ctypes.data], [4096]) == 0
    assert (b == 1).all()


def test_failure_reasons_are_bounded(engines) -> None:
    src = engines("prefill-0")
    for port in range(1, MAX_FAILURES + 11):  # nothing listens on these sessions
        src._failed(f"127.0.0.1:{port}", f"gone {port}")
    assert len(src._failures) == MAX_FAILURES
    assert src.failure("127.0.0.1:1") is None
    assert src.failure(f"127.0.0.1:{MAX_FAILURES + 10}") == f"gone {MAX_FAILURES + 10}"


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
