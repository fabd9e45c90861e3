"""The waiting thread reads its own answer (``Connection.lead``).

A thread in ``Transfer.wait`` takes the connection's socket from the reader
thread while every request in flight on it is its own; the reader sleeps on
and wakes only for what the waiter does not take. These tests check who
finished each transfer, that the socket goes back to the reader whenever the
waiter stops, that a peer sending slowly cannot hold a wait past its
timeout, and that nothing is lost or hangs when many threads wait on one
connection at once.
"""

import _thread
import contextlib
import os
import socket
import threading
import time

import numpy as np
import pytest

import kvx
from kvx import Descs
from kvx._net import parse_address
from kvx.backends.control import link, wire
from kvx.v1 import agent_pb2

BLOCK = 4096


def _thaw_once_reading(worker, conn, thread, wait_s=10.0):
    """Let the worker answer once ``thread`` reads the connection (is in
    lead()), or after ``wait_s``: (the thawing thread, a list it fills with
    whether ``thread`` was reading then)."""
    seen = []

    def thaw():
        deadline = time.monotonic() + wait_s
        while conn.reading is not thread and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(conn.reading is thread)
        worker.thaw()

    thawer = threading.Thread(target=thaw, daemon=True)
    thawer.start()
    return thawer, seen


def _peer(make_worker, make_agent, metadata=None, **agent_kwargs):
    worker = make_worker()
    agent = make_agent(backend="tcp", **agent_kwargs)
    pool = np.zeros(1 << 20, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(metadata(worker.metadata) if metadata else worker.metadata)
    return worker, agent, pool, region, peer


def _conn(peer):
    return peer._channel._link.conns[0]


def _wait_done(t, timeout_s=10):
    """Without wait(): only the reader thread can finish ``t``."""
    deadline = time.monotonic() + timeout_s
    while not t.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return t.done()


def test_the_waiting_thread_reads_its_answer_and_an_unwaited_one_is_read_by_the_reader(
    make_worker, make_agent
):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote, conn = peer.regions[0], _conn(peer)

    worker.freeze()  # the answer comes only once this thread is in wait()
    t = peer.read(region.descs(0, BLOCK), remote.descs(BLOCK, BLOCK))
    led = conn.answers_led
    _thaw_once_reading(worker, conn, threading.current_thread())
    t.wait(10)
    assert conn.answers_led == led + 1
    assert pool[:BLOCK].tobytes() == worker.expected(BLOCK, BLOCK).tobytes()

    t = peer.read(region.descs(BLOCK, BLOCK), remote.descs(0, BLOCK))
    assert _wait_done(t) and t.state is kvx.TransferState.DONE
    assert conn.answers_led == led + 1  # the reader took it
    assert pool[BLOCK : 2 * BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()


def test_a_transfer_of_two_requests_takes_its_first_answer_the_general_way(
    make_worker, make_agent, monkeypatch
):
    """One transfer cut into two READs on one connection: with two in flight
    the waiting thread reads the first answer the general way; only the
    last, alone by then, may go through recv_answer."""
    worker = make_worker(limits={"max_message_bytes": BLOCK})
    agent = make_agent(backend="tcp")
    pool = np.zeros(1 << 20, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    conn = _conn(peer)
    calls = _record_answers(monkeypatch)
    worker.freeze()
    t = peer.read(region.descs(0, 2 * BLOCK), peer.regions[0].descs(0, 2 * BLOCK))
    assert len(conn.pending) == 2
    led = conn.answers_led
    thawer, seen = _thaw_once_reading(worker, conn, threading.current_thread())
    t.wait(10)
    thawer.join(10)
    assert seen == [True] and conn.answers_led == led + 2
    assert len(calls) <= 1
    assert pool[: 2 * BLOCK].tobytes() == worker.expected(0, 2 * BLOCK).tobytes()


def _record_answers(monkeypatch) -> list:
    """What each call of the data path's recv_answer returned, from now on."""
    from kvx._datapath import io as _io

    results: list = []
    real = _io.recv_answer

    def recorded(*args):
        results.append(real(*args))
        return results[-1]

    monkeypatch.setattr(_io, "recv_answer", recorded)
    return results


def _read_frozen(worker, peer, conn, local, remote, wait_s=0.5):
    """READ with the answer held back until this thread reads the connection
    (or ``wait_s``); True when it was this thread that read."""
    worker.freeze()
    t = peer.read(local, remote)
    thawer, seen = _thaw_once_reading(worker, conn, threading.current_thread(), wait_s=wait_s)
    t.wait(10)
    thawer.join(10)
    assert t.state is kvx.TransferState.DONE
    return seen[0]


def test_a_lone_answer_is_taken_in_one_call_and_anything_else_the_long_way(
    make_worker, make_agent, monkeypatch
):
    """The answer to a READ (or WRITE) alone in flight lands through
    recv_answer (one call); a refused READ's ERROR goes through the general
    path, and the connection lives on."""
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote, conn = peer.regions[0], _conn(peer)
    calls = _record_answers(monkeypatch)
    for i in range(3):
        assert _read_frozen(
            worker, peer, conn, region.descs(i * BLOCK, BLOCK), remote.descs(i * BLOCK, BLOCK)
        )
    assert calls.count(True) == 3  # a wake-up before all of an answer came adds a False
    assert pool[: 3 * BLOCK].tobytes() == worker.expected(0, 3 * BLOCK).tobytes()

    # The target refuses a range past the end of its region (this side is
    # told the region is larger than it is): an ERROR, not the expected header.
    sizes, flags, devices = peer._table
    monkeypatch.setattr(peer, "_table", (sizes * 2, flags, devices))
    calls.clear()
    worker.freeze()
    t = peer.read(region.descs(0, BLOCK), remote.descs(int(sizes[remote.id]), BLOCK))
    thawer, seen = _thaw_once_reading(worker, conn, threading.current_thread())
    with pytest.raises(kvx.AccessError, match="remote read"):
        t.wait(10)
    thawer.join(10)
    assert seen == [True] and calls and True not in calls
    calls.clear()
    assert _read_frozen(
        worker, peer, conn, region.descs(0, BLOCK), remote.descs(0, BLOCK), wait_s=10
    )  # still up
    assert calls.count(True) == 1

    # A lone WRITE's answer (its header alone) too.
    monkeypatch.setattr(peer, "_table", (sizes, flags, devices))
    calls.clear()
    pool[:BLOCK] = 0x5A
    worker.freeze()
    t = peer.write(region.descs(0, BLOCK), remote.descs(2 * BLOCK, BLOCK))
    thawer, seen = _thaw_once_reading(worker, conn, threading.current_thread())
    t.wait(10)
    thawer.join(10)
    assert seen == [True] and calls.count(True) == 1
    assert worker.call("peek", 2 * BLOCK, BLOCK) == b"\x5a" * BLOCK


def test_large_answers_and_answers_larger_than_the_window_are_the_readers(
    make_worker, make_agent, monkeypatch
):
    """The reader copies a large answer while the rest of it still arrives; a
    waiting thread would first wait for all of it (link._LEAD_MAX_DATA). And a
    waiting thread that slept until more of a message has come than the
    receive window lets the peer send would wait in vain."""
    marks = []
    real_set_lowat = link._set_lowat
    monkeypatch.setattr(
        link, "_set_lowat", lambda sock, old, new: marks.append(new) or real_set_lowat(sock, old, new)
    )
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote, conn = peer.regions[0], _conn(peer)
    size = link._LEAD_MAX_DATA

    def check(local_size, took_turn, led):
        before = conn.answers_led
        local, far = region.descs(0, local_size), remote.descs(BLOCK, local_size)
        assert _read_frozen(worker, peer, conn, local, far) is took_turn
        assert conn.answers_led - before == led
        assert pool[:local_size].tobytes() == worker.expected(BLOCK, local_size).tobytes()
        pool[:local_size] = 0

    # A new connection's buffer (tcp_rmem's default, 128 KiB on Linux) does not hold it:
    # the waiting thread looks at the header, then gives the message to the reader.
    assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2 < size
    check(size, True, 0)
    assert max(marks, default=1) <= wire.HEADER_SIZE
    # Once the kernel has grown the buffer for the traffic, it does.
    for _ in range(3):
        peer.read(region.descs(0, 1 << 20), remote.descs(0, 1 << 20)).wait(10)
    assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2 >= size + BLOCK
    check(size, True, 1)
    # One block more: not even the header.
    check(size + BLOCK, False, 0)


def test_answers_to_other_transfers_and_transfers_with_callbacks_are_the_readers(make_worker, make_agent):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote, conn = peer.regions[0], _conn(peer)
    led = conn.answers_led
    worker.freeze()
    try:
        first = peer.read(region.descs(0, BLOCK), remote.descs(0, BLOCK))
        second = peer.read(region.descs(BLOCK, BLOCK), remote.descs(BLOCK, BLOCK))
    finally:
        threading.Timer(0.3, worker.thaw).start()
    first.wait(10)  # another transfer is in flight: this thread does not read
    assert _wait_done(second)

    # A done callback that takes a lock the waiting thread holds: were the callback run
    # on the waiting thread, under its lock, it would never return.
    lock, ran = threading.Lock(), []

    def callback(_):
        if lock.acquire(timeout=5):  # no hang if it ever ran under the waiting thread's lock
            lock.release()
            ran.append(threading.current_thread().name)
        else:
            ran.append("the waiting thread, which holds the lock")

    worker.freeze()
    third = peer.read(region.descs(2 * BLOCK, BLOCK), remote.descs(2 * BLOCK, BLOCK))
    third.add_done_callback(callback)
    threading.Timer(0.3, worker.thaw).start()
    with lock:
        third.wait(10)
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran and ran[0].startswith("kvx-read-")
    assert conn.answers_led == led
    assert pool[: 3 * BLOCK].tobytes() == worker.expected(0, 3 * BLOCK).tobytes()


def test_a_wait_that_times_out_gives_the_socket_back_to_the_reader(make_worker, make_agent):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    conn = _conn(peer)
    led = conn.answers_led
    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        with pytest.raises(kvx.TimeoutError):
            t.wait(0.2)
        assert t.state is kvx.TransferState.PENDING
        assert conn.reading is None
    finally:
        worker.thaw()
    assert _wait_done(t) and t.state is kvx.TransferState.DONE
    assert conn.answers_led == led
    assert pool[:BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()


def test_an_interrupted_wait_gives_the_socket_back_to_the_reader(make_worker, make_agent):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    conn = _conn(peer)
    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        me = threading.current_thread()

        def interrupt():
            deadline = time.monotonic() + 10
            while conn.reading is not me and time.monotonic() < deadline:
                time.sleep(0.005)
            _thread.interrupt_main()

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            t.wait(10)
        assert conn.reading is None and t.state is kvx.TransferState.PENDING
    finally:
        worker.thaw()
    assert _wait_done(t) and t.state is kvx.TransferState.DONE
    assert peer.alive and pool[:BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()


def test_a_hung_peer_fails_a_wait_that_reads_the_socket_within_io_s(make_worker, make_agent):
    worker, _, _, region, peer = _peer(make_worker, make_agent, timeouts=kvx.Timeouts(io_s=1))
    worker.freeze()
    try:
        start = time.monotonic()
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        readers = []
        threading.Timer(0.3, lambda: readers.append(_conn(peer).reading)).start()
        with pytest.raises(kvx.TimeoutError, match="io_s"):
            t.wait(10)
        assert 0.9 < time.monotonic() - start < 3
        assert readers == [threading.current_thread()]  # this thread was reading when it stalled
        assert _conn(peer).closed  # reset before the failure was reported
    finally:
        worker.thaw()
    assert not peer.alive


def test_closing_the_agent_ends_a_wait_that_reads_the_socket(make_worker, make_agent):
    worker, agent, _, region, peer = _peer(make_worker, make_agent)
    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK))
        errors = []

        def waiter():
            try:
                t.wait(30)
            except kvx.KvxError as exc:
                errors.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 5
        while _conn(peer).reading is not thread and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _conn(peer).reading is thread
        started = time.monotonic()
        agent.close()
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - started < 3
        assert len(errors) == 1 and isinstance(errors[0], kvx.ClosedError)
    finally:
        worker.thaw()


class _SlowProxy:
    """A TCP relay in front of a worker. While ``slow`` is set it passes on
    the first 64 bytes of what the worker sends at once (a message's header
    and a little of its body), then one byte every 20 ms; while ``paused`` is
    also set, nothing more until it is cleared."""

    def __init__(self, target):
        self.target = target
        self.slow = threading.Event()
        self.paused = threading.Event()
        self.held = threading.Event()  # nothing passes while set
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
                self._socks += [client, upstream]
                threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, slowed):
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while slowed and self.held.is_set():
                    time.sleep(0.005)
                if slowed and self.slow.is_set():
                    dst.sendall(data[:64])
                    data = data[64:]
                while slowed and self.slow.is_set() and data:
                    if self.paused.is_set():
                        time.sleep(0.01)
                        continue
                    dst.sendall(data[:1])
                    data = data[1:]
                    time.sleep(0.02)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def metadata(self, metadata):
        md = agent_pb2.AgentMetadata.FromString(metadata)
        for endpoint in md.endpoints:
            if endpoint.backend == agent_pb2.BACKEND_TCP:
                self.target = parse_address(endpoint.address)
                endpoint.address = self.address
        return md.SerializeToString()

    def close(self):
        self._listener.close()
        for sock in self._socks:
            sock.close()


def _release_once_reading(proxy, conn, thread):
    def release():
        deadline = time.monotonic() + 10
        while conn.reading is not thread and time.monotonic() < deadline:
            time.sleep(0.005)
        proxy.held.clear()

    threading.Thread(target=release, daemon=True).start()


def test_a_peer_that_answers_slowly_cannot_hold_a_wait_past_its_timeout(make_worker, make_agent):
    proxy = _SlowProxy(None)
    try:
        worker, _, pool, region, peer = _peer(make_worker, make_agent, metadata=proxy.metadata)
        conn = _conn(peer)
        peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK)).wait(10)

        # The header and a little of the body at once, the rest a byte per 20 ms (80 s),
        # once this thread reads the connection.
        proxy.held.set()
        proxy.slow.set()
        t = peer.read(region.descs(BLOCK, BLOCK), peer.regions[0].descs(BLOCK, BLOCK))
        _release_once_reading(proxy, conn, threading.current_thread())
        start = time.monotonic()
        with pytest.raises(kvx.TimeoutError):
            t.wait(0.5)
        assert time.monotonic() - start < 1.5
        assert t.state is kvx.TransferState.PENDING
        assert conn.reading is not threading.current_thread()
        proxy.slow.clear()  # the rest comes at once; the reader takes it
        assert _wait_done(t) and t.state is kvx.TransferState.DONE
        assert pool[BLOCK : 2 * BLOCK].tobytes() == worker.expected(BLOCK, BLOCK).tobytes()

        # A message that stops coming half-way goes back to the reader long before the wait ends.
        proxy.held.set()
        proxy.paused.set()
        proxy.slow.set()
        t = peer.read(region.descs(2 * BLOCK, BLOCK), peer.regions[0].descs(2 * BLOCK, BLOCK))
        waiter = threading.Thread(target=lambda: t.wait(10))
        waiter.start()
        _release_once_reading(proxy, conn, waiter)
        seen, deadline = set(), time.monotonic() + 5
        while time.monotonic() < deadline and not (waiter in seen and conn.reading is conn.reader):
            seen.add(conn.reading)
            time.sleep(0.005)
        assert waiter in seen and conn.reading is conn.reader and not t.done()  # the reader's now
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        proxy.paused.clear()
        proxy.slow.clear()
        waiter.join(10)
        assert t.state is kvx.TransferState.DONE
        assert pool[2 * BLOCK : 3 * BLOCK].tobytes() == worker.expected(2 * BLOCK, BLOCK).tobytes()
        assert peer.alive
    finally:
        proxy.close()


def test_many_threads_waiting_on_one_connection_lose_nothing(make_worker, make_agent):
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote = peer.regions[0]
    blocks = (1 << 20) // BLOCK
    expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)
    threads, per_thread = 4, 150
    failures = []
    done = []

    def run(index):
        rng = np.random.default_rng(index)
        mine = np.arange(index, blocks, threads)  # each thread its own local blocks
        try:
            for k in range(per_thread):
                local = int(mine[k % len(mine)])
                r = int(rng.integers(blocks))
                pool[local * BLOCK : (local + 1) * BLOCK] = 0
                t = peer.read(
                    Descs.from_blocks(region, [local], BLOCK), Descs.from_blocks(remote, [r], BLOCK)
                )
                t.wait(10)
                done.append(t.state)
                if not np.array_equal(pool[local * BLOCK : (local + 1) * BLOCK], expected[r]):
                    failures.append((index, k, local, r))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "a waiting thread hung"
    assert failures == []
    assert done == [kvx.TransferState.DONE] * (threads * per_thread)
    assert _conn(peer).answers_led > 0  # some waiting threads read their own answers
    assert peer.alive


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_waiting_thread_polls_for_its_answer_only_so_long_before_it_sleeps(
    make_worker, make_agent, monkeypatch
):
    """KVX_TCP_SPIN_US: the waiting thread polls the socket without sleeping
    for that long before it sleeps in poll(); an answer that comes meanwhile
    is caught without the kernel waking a thread. An answer that does not
    come costs at most that long per slice of the wait, not the wait; 0
    never polls."""
    monkeypatch.setenv("KVX_TCP_SPIN_US", "10000")
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote, conn = peer.regions[0], _conn(peer)
    assert conn.spin_us == 10_000
    caught = conn.spins_caught
    for i in range(20):
        peer.read(region.descs(0, BLOCK), remote.descs(i * BLOCK, BLOCK)).wait(10)
        assert pool[:BLOCK].tobytes() == worker.expected(i * BLOCK, BLOCK).tobytes()
    assert conn.spins_caught > caught

    worker.freeze()
    try:
        t = peer.read(region.descs(0, BLOCK), remote.descs(0, BLOCK))
        cpu = time.thread_time()
        with pytest.raises(kvx.TimeoutError):
            t.wait(1.0)
        # About 10 ms of each 100 ms slice (link._LEAD_SLICE_S); polling throughout, 1 s.
        assert time.thread_time() - cpu < 0.4
    finally:
        worker.thaw()
    assert _wait_done(t) and t.state is kvx.TransferState.DONE

    conn.spin_us = 0
    caught = conn.spins_caught
    for i in range(10):
        peer.read(region.descs(0, BLOCK), remote.descs(i * BLOCK, BLOCK)).wait(10)
    assert conn.spins_caught == caught


def test_a_serving_thread_polls_only_after_a_request_of_an_authenticated_peer(
    make_worker, make_agent, monkeypatch
):
    """KVX_SERVE_SPIN_US: after each request it answered, the target's
    serving thread polls for the next one for that long, then sleeps. An
    idle connection costs the target no CPU, and connections that never
    finish their handshake never make it poll."""
    monkeypatch.setenv("KVX_SERVE_SPIN_US", "10000")
    # A target in this process, to see its serving thread: the polls catch requests.
    target = make_agent("target", backend="tcp")
    theirs = np.random.default_rng(0).integers(0, 256, 20 * BLOCK, dtype=np.uint8)
    target.register(theirs, remote_access=True)
    initiator = make_agent(backend="tcp")
    mine = np.zeros(BLOCK, np.uint8)
    local = initiator.register(mine)
    near = initiator.add_peer(target.metadata())
    for i in range(20):
        near.read(local.descs(0, BLOCK), near.regions[0].descs(i * BLOCK, BLOCK)).wait(10)
        assert mine.tobytes() == theirs[i * BLOCK : (i + 1) * BLOCK].tobytes()
    (conn,) = target._listener._inbound
    assert conn.spins_caught > 0

    # A target process: its CPU while connections are idle.
    worker, _, pool, region, peer = _peer(make_worker, make_agent)
    remote = peer.regions[0]
    for i in range(50):
        peer.read(region.descs(0, BLOCK), remote.descs(i % 64 * BLOCK, BLOCK)).wait(10)
        assert pool[:BLOCK].tobytes() == worker.expected(i % 64 * BLOCK, BLOCK).tobytes()
    time.sleep(0.05)  # the last request's poll ends (10 ms)
    cpu = _cpu_s(worker.process.pid)
    time.sleep(1.0)
    assert _cpu_s(worker.process.pid) - cpu < 0.3  # polling throughout: about 1 s

    md = agent_pb2.AgentMetadata.FromString(worker.metadata)
    address = next(parse_address(e.address) for e in md.endpoints if e.backend == agent_pb2.BACKEND_TCP)
    with contextlib.ExitStack() as stack:
        for _ in range(16):  # half a header each: the handshake waits, nothing polls
            sock = stack.enter_context(socket.create_connection(address, timeout=5))
            sock.sendall(wire.MAGIC)
        cpu = _cpu_s(worker.process.pid)
        time.sleep(1.0)
        assert _cpu_s(worker.process.pid) - cpu < 0.3
    peer.read(region.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(10)  # still served


@pytest.mark.parametrize("variable", ["KVX_TCP_SPIN_US", "KVX_SERVE_SPIN_US"])
def test_an_agent_refuses_a_poll_time_out_of_range(make_agent, monkeypatch, variable):
    for bad in ("-1", "10001", "1e3", "soon"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(kvx.ConfigError, match=f"{variable} must be a whole number of microseconds"):
            make_agent(backend="tcp")
    monkeypatch.setenv(variable, "0")
    make_agent(backend="tcp").close()


def test_the_target_serves_small_requests_in_one_call(make_agent, monkeypatch):
    """A READ or WRITE of a few descriptors is served by serve_read /
    serve_write (one call each), a refused one by the checks that name the
    reason. The target runs in this process, so that its calls are seen."""
    from kvx._datapath import io as _io

    seen = []
    for name in ("serve_read", "serve_write"):
        real = getattr(_io, name)
        monkeypatch.setattr(
            _io, name, lambda *args, real=real, name=name: seen.append((name, real(*args))) or seen[-1][1]
        )
    target = make_agent("target", backend="tcp")
    theirs = np.arange(1 << 16, dtype=np.uint8)
    remote_region = target.register(theirs)
    agent = make_agent(backend="tcp")
    ours = np.zeros(1 << 16, np.uint8)
    region = agent.register(ours)
    peer = agent.add_peer(target.metadata())
    remote = peer.regions[0]
    peer.read(
        Descs.from_blocks(region.id, [0, 2, 5], 4096), Descs.from_blocks(remote.id, [1, 3, 4], 4096)
    ).wait(10)
    assert ours[:4096].tobytes() == theirs[4096:8192].tobytes()
    ours[:] = 0x77
    peer.write(region.descs(0, 100), remote.descs(1000, 100)).wait(10)
    assert (theirs[1000:1100] == 0x77).all()
    deadline = time.monotonic() + 5  # the target's call returns after it answered
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen == [("serve_read", None), ("serve_write", None)]
    # Refused at the target (this side is told the region is larger): the payload goes back to the checks.
    sizes, flags, devices = peer._table
    monkeypatch.setattr(peer, "_table", (sizes * 2, flags, devices))
    with pytest.raises(kvx.AccessError, match="remote read"):
        peer.read(region.descs(0, 64), remote.descs(remote_region.size_bytes, 64)).wait(10)
    assert seen[-1][0] == "serve_read" and isinstance(seen[-1][1], bytes)
    # A WRITE to memory peers may only read (this side is told it is writable): refused at the target.
    readonly = target.register(b"r" * 4096)
    peer = agent.add_peer(target.metadata())  # the same epoch: the live peer, with the new region
    sizes, flags, devices = peer._table
    monkeypatch.setattr(peer, "_table", (sizes, flags | 4, devices))  # REMOTE_WRITE everywhere
    with pytest.raises(kvx.AccessError, match="remote write"):
        peer.write(region.descs(0, 64), Descs.build(readonly.id, 0, 64)).wait(10)
    assert seen[-1][0] == "serve_write" and isinstance(seen[-1][1], bytes)
