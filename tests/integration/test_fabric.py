"""kvx._fabric between real processes over libfabric's tcp;ofi_rxm on 127.0.0.1.

Each test starts a target process (multiprocessing, spawn) that opens an
endpoint, registers memory and answers commands over a pipe; the test
process is the initiator. The connection exchange is the one the rdma
backend does over its control connection: the initiator prepares and sends
its info, the target completes and answers with its own, the initiator
completes. Skipped when kvx was built without libfabric.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvx.backends.rdma import fabric
from kvx.errors import ConfigError
from kvx.errors import TimeoutError as KvxTimeoutError
from tests.conftest import native_pass_only

# kvx._fabric moves the bytes whatever KVX_NATIVE says: one pass is enough.
pytestmark = [
    pytest.mark.skipif(fabric.available() is not None, reason=str(fabric.available())),
    native_pass_only,
]

PROVIDER = "tcp;ofi_rxm"
NODE = "127.0.0.1"
PIPE_TIMEOUT_S = 20.0
PIECE = 32 * 1024
PIECES = 1000


def _u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def _target(conn: Any, size: int, regions: list[tuple[bool, bool]]) -> None:
    """Registers one buffer per (remote_read, remote_write) in ``regions``, then serves commands."""
    ep = fabric.Endpoint(PROVIDER, NODE)
    bufs = [
        np.frombuffer(np.random.default_rng(i).bytes(size), dtype=np.uint8).copy()
        for i in range(len(regions))
    ]
    mrs = [
        ep.register(b.ctypes.data, b.nbytes, remote_read=r, remote_write=w)
        for b, (r, w) in zip(bufs, regions, strict=True)
    ]
    half, info = ep.prepare()
    remote_info = conn.recv()
    ep.complete(half, remote_info)
    conn.send((info, [(m.key, m.addr, m.length) for m in mrs], ep.virt_addr))
    while conn.poll(PIPE_TIMEOUT_S):
        cmd, arg = conn.recv()
        if cmd == "digest":
            conn.send(hashlib.sha256(bufs[arg].tobytes()).hexdigest())
        elif cmd == "close_mr":
            mrs[arg].close()
            conn.send("closed")
        elif cmd == "connect":  # the exchange again, after a reset on either side
            half, info = ep.prepare()
            ep.complete(half, arg)
            conn.send(info)
        elif cmd == "reset":
            ep.reset("asked by the test")
            conn.send((ep.address, [m.key for m in mrs]))
        elif cmd == "stop":
            break
    ep.close()


class Target:
    """A target process and the initiator's endpoint connected to it."""

    def __init__(self, size: int, regions: list[tuple[bool, bool]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(child, size, regions), daemon=True)
        self.proc.start()
        self.ep = fabric.Endpoint(PROVIDER, NODE)
        half, info = self.ep.prepare()
        self.conn.send(info)
        assert self.conn.poll(PIPE_TIMEOUT_S), "the target did not answer"
        self.remote_info, self.regions, virt_addr = self.conn.recv()
        remote_info = self.remote_info
        self.peer = self.ep.complete(half, remote_info)
        self.base = [addr if virt_addr else 0 for _, addr, _ in self.regions]
        self.keys = [key for key, _, _ in self.regions]

    def ask(self, cmd: str, arg: int = 0) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(PIPE_TIMEOUT_S), f"the target did not answer {cmd}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop", 0))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.ep.close()


@pytest.fixture
def make_target():
    made: list[Target] = []

    def make(size: int = PIECE * PIECES, regions: list[tuple[bool, bool]] | None = None) -> Target:
        t = Target(size, regions or [(True, True)])
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def _local(ep: fabric.Endpoint, size: int) -> tuple[np.ndarray, fabric.MemoryRegion]:
    buf = np.zeros(size, dtype=np.uint8)
    return buf, ep.register(buf.ctypes.data, buf.nbytes, remote_read=False, remote_write=False)


def _read_until_served(t: Target, buf: np.ndarray) -> None:
    """A good READ after a refused one: tcp;ofi_rxm's target drops the connection that carried
    the refused request, and posts fail with FI_ENOTCONN for the few milliseconds until the
    initiator has seen it close; then the next post connects anew."""
    deadline = time.monotonic() + 10
    while True:
        try:
            _read_small(t, buf)
            return
        except fabric.FabricError as exc:
            if exc.status != "FI_ENOTCONN" or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _read_small(t: Target, buf: np.ndarray, region: int = 0, offset: int = 0, key: int | None = None) -> None:
    key = t.keys[region] if key is None else key
    t.ep.post(fabric.READ, t.peer, _u64(buf.ctypes.data), _u64(64), _u64(t.base[region] + offset), _u64(64),
              _u64(key), 10_000)  # fmt: skip


def test_1000_pieces_of_32_kib_read_and_write_byte_exact(make_target):
    t = make_target()
    size = PIECE * PIECES
    local, _mr = _local(t.ep, size)
    # Remote pieces in a shuffled order, so a piece that lands in the wrong place shows.
    order = np.random.default_rng(7).permutation(PIECES).astype(np.uint64)
    remote_addrs = t.base[0] + order * PIECE
    local_addrs = local.ctypes.data + np.arange(PIECES, dtype=np.uint64) * PIECE
    lens = np.full(PIECES, PIECE, dtype=np.uint64)
    keys = np.full(PIECES, t.keys[0], dtype=np.uint64)
    t.ep.post(fabric.READ, t.peer, local_addrs, lens, remote_addrs, lens, keys, 15_000)
    source = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
    expected = source.reshape(PIECES, PIECE)[order.astype(np.int64)].reshape(-1)
    assert np.array_equal(local, expected)

    # WRITE it back unshuffled: the target's buffer becomes the original again, byte for byte.
    before = t.ask("digest", 0)
    local[:] = np.frombuffer(np.random.default_rng(99).bytes(size), dtype=np.uint8)
    t.ep.post(fabric.WRITE, t.peer, local_addrs, lens, remote_addrs, lens, keys, 15_000)
    written = np.empty_like(local)
    written.reshape(PIECES, PIECE)[order.astype(np.int64)] = local.reshape(PIECES, PIECE)
    assert t.ask("digest", 0) == hashlib.sha256(written.tobytes()).hexdigest() != before
    counters = t.ep.counters()
    assert counters["work_requests"] == 2 * PIECES and counters["errors"] == 0 and counters["inflight"] == 0


def test_a_range_past_the_region_is_refused_and_the_target_keeps_serving(make_target):
    t = make_target(size=64 * 1024)
    local, _mr = _local(t.ep, 1 << 20)
    for offset, length in ((64 * 1024 - 64, 4096), (1 << 30, 64), (1 << 40, 64)):
        with pytest.raises(fabric.FabricError) as err:
            t.ep.post(fabric.READ, t.peer, _u64(local.ctypes.data), _u64(length), _u64(t.base[0] + offset),
                      _u64(length), _u64(t.keys[0]), 10_000)  # fmt: skip
        assert err.value.peer == t.peer and err.value.status.startswith("FI_")
        _read_until_served(t, local)
    assert bytes(local[:64]) == np.random.default_rng(0).bytes(64 * 1024)[:64]


def test_a_write_to_a_read_only_region_is_refused(make_target):
    t = make_target(size=4096, regions=[(True, False)])
    local, _mr = _local(t.ep, 4096)
    local[:] = 1
    before = t.ask("digest", 0)
    with pytest.raises(fabric.FabricError):
        t.ep.post(fabric.WRITE, t.peer, _u64(local.ctypes.data), _u64(64), _u64(t.base[0]), _u64(64),
                  _u64(t.keys[0]), 10_000)  # fmt: skip
    assert t.ask("digest", 0) == before
    _read_until_served(t, local)  # reading it is allowed


def test_a_closed_region_is_refused(make_target):
    t = make_target(size=4096, regions=[(True, True), (True, True)])
    local, _mr = _local(t.ep, 4096)
    _read_small(t, local, region=1)
    assert t.ask("close_mr", 1) == "closed"
    with pytest.raises(fabric.FabricError):
        _read_small(t, local, region=1)
    _read_until_served(t, local)  # the other region still serves


def test_a_wrong_key_is_refused(make_target):
    t = make_target(size=4096)
    local, _mr = _local(t.ep, 4096)
    with pytest.raises(fabric.FabricError):
        _read_small(t, local, key=t.keys[0] ^ 1)
    _read_until_served(t, local)


def _guesser(conn: Any, target_info: bytes, guesses: list[int]) -> None:
    """A process that reached the libfabric port but holds no key: it tries them."""
    ep = fabric.Endpoint(PROVIDER, NODE)
    buf = np.zeros(4096, dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, buf.nbytes, remote_read=False, remote_write=False)
    peer = ep.complete(None, target_info)
    hits = 0
    for key in guesses:
        for op in (fabric.READ, fabric.WRITE):
            try:
                ep.post(op, peer, _u64(buf.ctypes.data), _u64(64), _u64(0), _u64(64), _u64(key), 5_000)
                hits += 1
            except (fabric.FabricError, KvxTimeoutError):
                # The target drops the connection that carried a refused request: connect anew.
                ep.disconnect(peer)
                peer = ep.complete(None, target_info)
    conn.send(hits)
    mr.close()
    ep.close()


def test_an_unauthenticated_process_cannot_guess_a_key(make_target):
    """The attack: with offset addressing a key is all a peer needs, so a process that
    connects to the target's libfabric port enumerates small keys and tries random ones.
    Keys come from a CSPRNG: every guess is refused, and the target keeps serving."""
    t = make_target(size=4096)
    local, _mr = _local(t.ep, 4096)
    before = t.ask("digest", 0)
    assert all(k >= 1 << 16 for k in t.keys), "a key that small would be found by enumeration"
    guesses = list(range(128)) + [
        int(x) for x in np.random.default_rng().integers(0, 2**63, 32, dtype=np.uint64)
    ]
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    # The guesser knows the target's address (what its port answers to), not its keys.
    proc = ctx.Process(target=_guesser, args=(theirs, t.remote_info, guesses), daemon=True)
    proc.start()
    assert mine.poll(30), "the guesser did not finish"
    assert mine.recv() == 0
    proc.join(10)
    assert t.ask("digest", 0) == before
    _read_small(t, local)


def test_a_killed_peer_fails_the_transfer_within_the_timeout(make_target):
    t = make_target()
    size = PIECE * PIECES
    local, _mr = _local(t.ep, size)
    lens = np.full(PIECES, PIECE, dtype=np.uint64)
    local_addrs = local.ctypes.data + np.arange(PIECES, dtype=np.uint64) * PIECE
    remote_addrs = t.base[0] + np.arange(PIECES, dtype=np.uint64) * PIECE
    keys = np.full(PIECES, t.keys[0], dtype=np.uint64)
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                t.ep.post(fabric.READ, t.peer, local_addrs, lens, remote_addrs, lens, keys, 5_000)
            except (fabric.FabricError, KvxTimeoutError) as exc:
                errors.append(exc)
                return

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    time.sleep(0.3)
    os.kill(t.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    worker.join(15)
    stop.set()
    assert not worker.is_alive(), "post did not return after the peer died"
    assert errors and time.monotonic() - killed < 12
    assert t.ep.counters()["inflight"] >= 0


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("the target did not stop")


def test_a_stopped_peer_times_out_and_late_completions_touch_nothing(make_target):
    t = make_target()
    local, _mr = _local(t.ep, PIECE * 64)
    lens = np.full(64, PIECE, dtype=np.uint64)
    addrs = local.ctypes.data + np.arange(64, dtype=np.uint64) * PIECE
    remote = t.base[0] + np.arange(64, dtype=np.uint64) * PIECE
    keys = np.full(64, t.keys[0], dtype=np.uint64)
    t.ep.post(fabric.READ, t.peer, addrs, lens, remote, lens, keys, 10_000)
    os.kill(t.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(t.proc.pid)
        started = time.monotonic()
        with pytest.raises(KvxTimeoutError):
            t.ep.post(fabric.READ, t.peer, addrs, lens, remote, lens, keys, 500)
        assert time.monotonic() - started < 5
    finally:
        os.kill(t.proc.pid, signal.SIGCONT)
    # The timed-out batch's completions arrive now; then the endpoint works as before.
    t.ep.post(fabric.READ, t.peer, addrs, lens, remote, lens, keys, 10_000)
    deadline = time.monotonic() + 10
    while t.ep.counters()["inflight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    c = t.ep.counters()
    assert c["inflight"] == 0 and c["orphans"] == 0 and c["timeouts"] == 1


def test_local_memory_must_be_registered(make_target):
    t = make_target(size=4096)
    local, mr = _local(t.ep, 4096)
    other = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ConfigError, match=hex(other.ctypes.data)):
        t.ep.post(fabric.READ, t.peer, _u64(other.ctypes.data), _u64(64), _u64(t.base[0]), _u64(64),
                  _u64(t.keys[0]), 5_000)  # fmt: skip
    with pytest.raises(ConfigError):  # one byte past the registered range
        t.ep.post(fabric.READ, t.peer, _u64(local.ctypes.data + 4096 - 32), _u64(64), _u64(t.base[0]),
                  _u64(64), _u64(t.keys[0]), 5_000)  # fmt: skip
    mr.close()
    with pytest.raises(ConfigError):
        _read_small(t, local)


def test_bad_peer_info_is_refused():
    with fabric.Endpoint(PROVIDER, NODE) as ep:
        for info in (b"", b"x", b"x" * 4096):
            with pytest.raises(fabric.PeerInfoError):
                ep.complete(None, info)


def test_one_user_of_a_shared_peer_number_disconnecting_leaves_the_others(make_target):
    """The attack: the provider gives one address one peer number, so a peer that
    replays another's endpoint info (or an honest pair linked both ways) shares it;
    when that user disconnects, the other must keep its peer, not fail with
    "not connected"."""
    t = make_target(size=4096)
    local, _mr = _local(t.ep, 4096)
    again = t.ep.complete(0, t.remote_info)  # a second user of the same address
    assert again == t.peer
    t.ep.disconnect(again)
    _read_small(t, local)  # the first user still reaches the target
    assert local[:64].tobytes() == _target_bytes(4096, 0, 0, 64)
    t.ep.disconnect(t.peer)
    with pytest.raises(ConfigError, match="not connected"):
        _read_small(t, local)


def _target_bytes(size: int, region: int, offset: int, length: int) -> bytes:
    """What the target's buffer ``region`` of ``size`` bytes holds (see ``_target``)."""
    return np.random.default_rng(region).bytes(size)[offset : offset + length]


# ---- Endpoint.reset: what closing an MR does not stop, closing the endpoint does ----


def _writer(conn: Any, target_info: bytes, key: int, size: int) -> None:
    """A peer that holds a key and WRITEs ``size`` bytes of 0xAA into the region."""
    ep = fabric.Endpoint(PROVIDER, NODE)
    src = np.full(size, 0xAA, dtype=np.uint8)
    _mr = ep.register(src.ctypes.data, size, remote_read=False, remote_write=False)
    peer = ep.complete(None, target_info)
    conn.send("posting")
    try:
        ep.post(fabric.WRITE, peer, _u64(src.ctypes.data), _u64(size), _u64(0), _u64(size), _u64(key), 15_000)
        conn.send("completed")
    except (fabric.FabricError, KvxTimeoutError) as exc:
        conn.send(f"failed: {exc}")
    ep.close()


def test_a_write_in_flight_stops_landing_once_reset_returns():
    """The attack: a peer starts a 256 MiB WRITE; the target deregisters the region (with
    tcp;ofi_rxm the bytes keep landing after fi_close(mr)) by resetting its endpoint with
    the region dropped. After reset() returns no byte lands any more, and the writer's
    post fails."""
    size = 256 << 20
    ep = fabric.Endpoint(PROVIDER, NODE)
    assert not ep.mr_close_is_final
    buf = np.zeros(size, dtype=np.uint8)
    mr = ep.register(buf.ctypes.data, size, remote_read=True, remote_write=True)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(theirs, ep.address, mr.key, size), daemon=True)
    proc.start()
    try:
        assert mine.poll(PIPE_TIMEOUT_S) and mine.recv() == "posting"
        deadline = time.monotonic() + 10
        while not buf[: 1 << 20].any() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert buf[: 1 << 20].any(), "the WRITE did not start"
        # The registration closes with the reset, after the connections: closing it first,
        # under the live WRITE, is what crashed libfabric's tcp provider in fi_close(ep).
        ep.reset("the region was deregistered", drop=[mr])
        assert mr.closed
        landed = int(np.count_nonzero(buf))
        assert landed < size, "the WRITE finished before the reset; the test proves nothing"
        time.sleep(2)
        assert int(np.count_nonzero(buf)) == landed
        assert mine.poll(PIPE_TIMEOUT_S)
        assert mine.recv().startswith("failed")
        assert ep.counters()["resets"] == 1
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        ep.close()


def test_a_timed_out_read_stops_landing_once_reset_returns(make_target):
    """The attack: the target stalls until the initiator's READ times out, then resumes;
    with tcp;ofi_rxm its bytes would land in the initiator's buffer after the timeout
    (and after disconnect and closing the MR). After reset() none do."""
    t = make_target()
    size = PIECE * PIECES
    local, _mr = _local(t.ep, size)
    _read_small(t, local)  # the connection is up
    os.kill(t.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(t.proc.pid)
        with pytest.raises(KvxTimeoutError):
            t.ep.post(fabric.READ, t.peer, _u64(local.ctypes.data), _u64(size), _u64(t.base[0]), _u64(size),
                      _u64(t.keys[0]), 1_000)  # fmt: skip
        t.ep.reset("a READ timed out")
        local[:] = 0x11  # the memory is someone else's now
    finally:
        os.kill(t.proc.pid, signal.SIGCONT)
    time.sleep(2)
    assert int(np.count_nonzero(local != 0x11)) == 0
    c = t.ep.counters()
    assert c["resets"] == 1 and c["inflight"] == 0 and c["timeouts"] == 1


def test_after_a_reset_peers_connect_again_and_old_keys_still_serve(make_target):
    t = make_target(size=4096, regions=[(True, True), (True, True)])
    local, mr = _local(t.ep, 4096)
    old_address, old_key = t.ep.address, mr.key
    t.ep.reset("test")
    assert t.ep.address != old_address and t.ep.prepare()[1] == t.ep.address
    assert mr.key == old_key and not mr.closed
    with pytest.raises(ConfigError, match="not connected"):
        _read_small(t, local)
    old_peer = t.peer
    half, info = t.ep.prepare()
    t.peer = t.ep.complete(half, t.ask("connect", info))
    _read_small(t, local, region=1, offset=64)
    assert local[:64].tobytes() == _target_bytes(4096, 1, 64, 64)
    with pytest.raises(ConfigError, match="not connected"):  # the old number names no new peer
        t.ep.post(fabric.READ, old_peer, _u64(local.ctypes.data), _u64(64), _u64(t.base[1]), _u64(64),
                  _u64(t.keys[1]), 5_000)  # fmt: skip

    # The target resets too: one region closed before stays closed, the other keeps its key.
    assert t.ask("close_mr", 1) == "closed"
    address, keys = t.ask("reset")
    assert address != t.remote_info and keys == t.keys
    t.ep.disconnect(t.peer)  # the target's old address is gone: connect to the new one
    half, info = t.ep.prepare()
    t.ask("connect", info)
    t.peer = t.ep.complete(half, address)
    _read_small(t, local, region=0, offset=128)
    assert local[:64].tobytes() == _target_bytes(4096, 0, 128, 64)
    with pytest.raises(fabric.FabricError):
        _read_small(t, local, region=1)
    mr.close()  # closes the registration the reset made
    assert t.ep.counters()["regions"] == 0


def test_a_reset_while_threads_post_fails_their_posts_cleanly(make_target):
    t = make_target()
    local, _mr = _local(t.ep, 4 << 20)
    results: list[list[str]] = [[] for _ in range(4)]

    def loop(i: int) -> None:
        dst = local.ctypes.data + i * (1 << 20)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                t.ep.post(fabric.READ, t.peer, _u64(dst), _u64(1 << 20), _u64(t.base[0] + i * (1 << 20)),
                          _u64(1 << 20), _u64(t.keys[0]), 10_000)  # fmt: skip
                results[i].append("ok")
            except fabric.FabricError as exc:
                results[i].append(exc.status)
                return
            except ConfigError as exc:
                results[i].append("not connected" if "not connected" in str(exc) else str(exc))
                return

    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(4)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 10
    while not all(results) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(results), "the posts did not get going"
    started = time.monotonic()
    t.ep.reset("test")
    assert time.monotonic() - started < 10
    for w in workers:
        w.join(15)
    assert not any(w.is_alive() for w in workers), "a post hung across the reset"
    ends = {r[-1] for r in results}
    assert ends <= {fabric.RESET, "not connected"} and fabric.RESET in ends
    assert all(set(r[:-1]) == {"ok"} for r in results)
    c = t.ep.counters()
    assert c["resets"] == 1 and c["inflight"] == 0
