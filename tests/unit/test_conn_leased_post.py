"""conn_leased_post: the shm backend's latency path takes a connection's
lease, copies and gives the lease back in one call (C and twin alike). The
lease's bookkeeping must be Connection.lease/unlease's: a revoke or a close
waits for the copy, a copy that ends after the connection broke shuts its
socket down, and nothing is counted when nothing is leased."""

import os
import select
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvx._datapath import cma_py as _cma_py
from kvx.backends.control.link import Connection
from kvx.descs import DESC_DTYPE
from kvx.errors import PeerLostError
from kvx.memory import DEVICE, LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, VALID

try:
    from kvx._datapath import _cma
except ImportError:  # only allowed when the twin was asked for
    _cma = None

IMPLS = [pytest.param(_cma_py, id="python")] + ([pytest.param(_cma, id="native")] if _cma else [])
NEED = VALID | LOCAL_WRITE


def _descs(rows):
    out = np.zeros(len(rows), DESC_DTYPE)
    for i, row in enumerate(rows):
        out[i] = row
    return out


def _u64(values):
    return np.asarray(values, dtype=np.uint64)


@pytest.fixture
def conn():
    """A Connection as a link makes it (its reader not started), on a socket pair."""
    mine, theirs = socket.socketpair()
    links = SimpleNamespace(
        spin_us=0, ctx=SimpleNamespace(io_ms=1000, timeouts=SimpleNamespace(io_s=1.0, close_s=1.0))
    )
    c = Connection(links, mine, "peer", 0)
    yield c, theirs
    mine.close()
    theirs.close()


class Setup:
    """``src`` leased as region 7 (for reading and writing), ``dst`` as local region 1."""

    def __init__(self, conn, size):
        self.src = np.frombuffer(np.random.default_rng(size).bytes(size), np.uint8).copy()
        self.dst = np.zeros(size, np.uint8)
        self.size = size
        for writing in (False, True):
            conn.leases[(7, writing)] = (self.src.ctypes.data, size)
        self.table = (_u64([0, self.dst.ctypes.data]), _u64([0, size]), np.array([0, NEED], np.uint8))

    def read(self, impl, conn, remote=None, local=None, max_bytes=1 << 40):
        remote = _descs([(7, 0, self.size)]) if remote is None else remote
        local = _descs([(1, 0, self.size)]) if local is None else local
        return impl.conn_leased_post(
            conn, os.getpid(), False, local, *self.table, NEED, NEED | DEVICE, remote, REMOTE_READ, max_bytes
        )


def _idle(conn):
    assert conn.lease_uses == {} and conn.copies == 0, "a use or a copy was left counted"


@pytest.mark.parametrize("impl", IMPLS)
def test_copies_through_the_lease_and_gives_it_back(impl, conn):
    c, _ = conn
    s = Setup(c, 1 << 16)
    assert s.read(impl, c) == 1 << 16
    assert (s.dst == s.src).all()
    _idle(c)
    # A write, through the lease for writing, scattered over two runs of the region.
    s.dst[:] = 0xAB
    local = _descs([(1, 0, 4096)])
    remote = _descs([(7, 8192, 1024), (7, 100, 3072)])
    got = impl.conn_leased_post(
        c, os.getpid(), True, local, *s.table, VALID, VALID | DEVICE, remote, REMOTE_WRITE, 1 << 30
    )
    assert got == 4096
    assert (s.src[8192 : 8192 + 1024] == 0xAB).all() and (s.src[100:3172] == 0xAB).all()
    _idle(c)


@pytest.mark.parametrize("impl", IMPLS)
def test_nothing_leased_nothing_counted(impl, conn):
    c, _ = conn
    s = Setup(c, 4096)
    # Another region, or a list that names one region leased and one not.
    assert s.read(impl, c, remote=_descs([(8, 0, 4096)])) is None
    assert s.read(impl, c, remote=_descs([(7, 0, 2048), (8, 0, 2048)])) is None
    # Leased for reading only.
    del c.leases[(7, True)]
    got = impl.conn_leased_post(
        c,
        os.getpid(),
        True,
        _descs([(1, 0, 4096)]),
        *s.table,
        VALID,
        VALID | DEVICE,
        _descs([(7, 0, 4096)]),
        REMOTE_WRITE,
        1 << 30,
    )
    assert got is None
    # A broken connection leases nothing.
    c.error = PeerLostError("gone")
    assert s.read(impl, c) is None
    assert not s.dst.any(), "bytes moved without a lease"
    _idle(c)


@pytest.mark.parametrize("impl", IMPLS)
def test_refusals_and_failures_give_the_lease_back(impl, conn):
    c, _ = conn
    s = Setup(c, 4096)
    # Past the leased size; totals that differ; over max_bytes: refused, nothing moved.
    assert s.read(impl, c, remote=_descs([(7, 1, 4096)])) == (1, 0)
    assert s.read(impl, c, local=_descs([(1, 0, 2048)])) == (2, -1)
    assert s.read(impl, c, max_bytes=4095) == (2, -1)
    assert not s.dst.any()
    _idle(c)
    # A lease the kernel cannot copy from (no memory mapped there): the copy's error.
    c.leases[(7, False)] = (4096, 1 << 20)
    with pytest.raises(OSError):
        s.read(impl, c)
    _idle(c)
    with pytest.raises(ValueError):
        impl.conn_leased_post(
            c, os.getpid(), False, b"x" * 24, *s.table, NEED, NEED, b"y" * 25, REMOTE_READ, 1 << 30
        )
    _idle(c)


class GateLock:
    """conn.lock, with a gate: the thread named ``held`` stops before its
    second acquire (the copy done, its lease not yet given back) until
    ``proceed`` is set, and says so with ``stopped``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.held = None
        self.acquires = 0
        self.stopped = threading.Event()
        self.proceed = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if threading.get_ident() == self.held:
            self.acquires += 1
            if self.acquires == 2:
                self.stopped.set()
                assert self.proceed.wait(30)
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _stop_after_copy(impl, c, s):
    """A copy that stops with its lease still held, once its bytes moved;
    returns its thread, its result box and the gate that holds it."""
    gate = GateLock()
    c.lock = gate
    c.copies_done, c.queue_cv = threading.Condition(gate), threading.Condition(gate)
    box = {}

    def copy():
        gate.held = threading.get_ident()
        box["got"] = s.read(impl, c)

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    assert gate.stopped.wait(30)
    assert c.lease_uses == {7: 1} and c.copies == 1
    return copier, box, gate


@pytest.mark.parametrize("impl", IMPLS)
def test_a_revoke_waits_for_the_copy_using_the_lease(impl, conn):
    c, theirs = conn
    s = Setup(c, 1 << 16)
    copier, box, gate = _stop_after_copy(impl, c, s)
    revoker = threading.Thread(target=c._revoke, args=(7, 0, 0, 0), daemon=True)
    revoker.start()
    revoker.join(0.5)
    assert revoker.is_alive(), "the revoke did not wait for the copy"
    assert (7, False) not in c.leases
    gate.proceed.set()
    revoker.join(30)
    assert not revoker.is_alive(), "the copy's end did not wake the revoke"
    copier.join(30)
    assert box["got"] == s.size and (s.dst == s.src).all()
    _idle(c)
    # The SHM_RELEASE went out once the copy ended, and nothing can lease region 7 now.
    assert theirs.recv(64)
    assert s.read(impl, c) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_a_break_during_the_copy_leaves_the_socket_to_the_copy(impl, conn):
    c, theirs = conn
    s = Setup(c, 1 << 16)
    copier, box, gate = _stop_after_copy(impl, c, s)
    c.shutdown(PeerLostError("lost"))
    # While a copy uses the lease, the target keeps its pins: the socket stays up.
    assert not select.select([theirs], [], [], 0.2)[0], "the socket went down under a copy"
    gate.proceed.set()
    copier.join(30)
    assert box["got"] == s.size
    _idle(c)
    # The copy was the last: it shut the socket down on its way out.
    assert select.select([theirs], [], [], 10)[0]
    assert theirs.recv(64) == b""


@pytest.mark.parametrize("impl", IMPLS)
def test_many_descriptors_over_several_regions(impl, conn):
    """More regions than fit the C's stack arrays, named out of order and
    more than once; leases with a word past (base, size), as an rdma pin's."""
    c, _ = conn
    rng = np.random.default_rng(5)
    src = np.frombuffer(rng.bytes(40 * 4096), np.uint8).copy()
    for rid in range(40):
        c.leases[(100 + rid, False)] = (src.ctypes.data + 4096 * rid, 4096, 0xDEAD)
    dst = np.zeros(60 * 1024, np.uint8)
    table = (_u64([0, dst.ctypes.data]), _u64([0, len(dst)]), np.array([0, NEED], np.uint8))
    picks = [(int(r), int(o)) for r, o in zip(rng.integers(0, 40, 60), rng.integers(0, 3, 60), strict=True)]
    remote = _descs([(100 + r, 1024 * o, 1024) for r, o in picks])
    local = _descs([(1, 0, len(dst))])

    def call(remote):
        return impl.conn_leased_post(
            c, os.getpid(), False, local, *table, NEED, NEED | DEVICE, remote, REMOTE_READ, 1 << 30
        )

    assert call(remote) == len(dst)
    want = b"".join(src[4096 * r + 1024 * o :][:1024].tobytes() for r, o in picks)
    assert dst.tobytes() == want
    _idle(c)
    # One descriptor past its region, the 45th: refused by its index, nothing moved.
    dst[:] = 0
    bad = remote.copy()
    bad[44]["offset"] = 3073
    assert call(bad) == (1, 44)
    assert not dst.any()
    # One region not leased: nothing done at all.
    bad = remote.copy()
    bad[59]["region"] = 99
    assert call(bad) is None
    _idle(c)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_malformed_lease_raises_and_gives_everything_back(impl, conn):
    c, _ = conn
    s = Setup(c, 4096)
    for lease in ((s.src.ctypes.data,), (-1, 4096)):
        c.leases[(7, False)] = lease
        with pytest.raises((TypeError, ValueError, OverflowError)):
            s.read(impl, c)
        _idle(c)
        assert c.lock.acquire(blocking=False), "the lock was left held"
        c.lock.release()
