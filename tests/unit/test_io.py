"""The C data path and its pure-Python twin: same bytes, same errors."""

import contextlib
import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvx._datapath import io as _io
from kvx._datapath import io_py as _io_py
from kvx.backends.tcp.serve import SMALL_REQUEST_DESCS
from kvx.errors import ConfigError

try:
    from kvx._datapath import _native
except ImportError:  # only allowed when the twin was asked for
    _native = None

IMPLS = [pytest.param(_io_py, id="python")]
if _native is not None:
    IMPLS.append(pytest.param(_native, id="native"))


def test_the_implementation_follows_kvx_native():
    """KVX_NATIVE=1: the C extension, which must be built; 0: the twin;
    unset: the C extension when it was built."""
    choice = os.environ.get("KVX_NATIVE", "")
    want_native = choice == "1" or (choice == "" and _native is not None)
    assert ("native" if want_native else "python") == _io.IMPL
    expected = _native if want_native else _io_py
    assert expected is not None, "KVX_NATIVE=1 but kvx._datapath._native is not built"
    names = ("sendv", "recvv", "wait_readable", "peek", "serve_read", "serve_write", "recv_answer")
    assert [getattr(_io, name) for name in names] == [getattr(expected, name) for name in names]


def test_kvx_native_takes_only_0_1_or_nothing():
    with pytest.raises(ConfigError, match="KVX_NATIVE must be 0, 1 or unset"):
        _io.use("yes")


def _pieces(buf: np.ndarray, rng, count: int):
    """count random non-overlapping pieces of buf, shuffled: (addrs, lens)."""
    cuts = np.sort(rng.choice(np.arange(1, len(buf)), size=2 * count, replace=False))
    starts, ends = cuts[0::2], cuts[1::2]
    order = rng.permutation(count)
    addrs = (buf.ctypes.data + starts[order]).astype(np.uint64)
    return addrs, (ends - starts)[order].astype(np.uint64), starts[order], ends[order]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("count", [1, 7, 3000])  # 3000 > IOV_MAX: batched
def test_gather_send_scatter_receive(impl, count):
    rng = np.random.default_rng(count)
    src = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
    dst = np.zeros(1 << 21, dtype=np.uint8)
    s_addrs, s_lens, s_starts, s_ends = _pieces(src, rng, count)
    expected = b"".join(src[a:b].tobytes() for a, b in zip(s_starts, s_ends, strict=True))
    total = len(expected)
    # Receive into a different cut of the destination, of the same total size.
    d_lens = np.full(count, total // count, dtype=np.uint64)
    d_lens[-1] += total - int(d_lens.sum())
    d_starts = np.cumsum(np.concatenate(([0], d_lens[:-1] + 3))).astype(np.uint64)
    d_addrs = (dst.ctypes.data + d_starts).astype(np.uint64)
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    prefix = b"HDR!"
    sender = threading.Thread(target=impl.sendv, args=(a.fileno(), prefix, s_addrs, s_lens, 5000))
    sender.start()
    head = b.recv(4, socket.MSG_WAITALL)
    impl.recvv(b.fileno(), d_addrs, d_lens, 5000)
    sender.join(5)
    got = b"".join(dst[int(s) : int(s) + int(n)].tobytes() for s, n in zip(d_starts, d_lens, strict=True))
    assert head == prefix and got == expected
    gaps = np.ones(len(dst), bool)
    for s, n in zip(d_starts, d_lens, strict=True):
        gaps[int(s) : int(s) + int(n)] = False
    assert not dst[gaps].any(), "bytes landed outside the receive descriptors"
    a.close()
    b.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_eof_is_connection_reset(impl):
    a, b = socket.socketpair()
    b.settimeout(5)
    buf = np.zeros(100, np.uint8)
    a.sendall(b"x" * 10)
    a.close()
    with pytest.raises(ConnectionResetError, match="after 10 of 100 bytes"):
        impl.recvv(b.fileno(), np.array([buf.ctypes.data], np.uint64), np.array([100], np.uint64), 5000)
    b.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_no_progress_is_a_timeout(impl):
    a, b = socket.socketpair()
    b.settimeout(5)
    buf = np.zeros(100, np.uint8)
    with pytest.raises(TimeoutError, match="no progress"):
        impl.recvv(b.fileno(), np.array([buf.ctypes.data], np.uint64), np.array([100], np.uint64), 100)
    a.close()
    b.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_send_to_closed_peer_raises(impl):
    a, b = socket.socketpair()
    a.settimeout(5)
    b.close()
    buf = np.zeros(1 << 20, np.uint8)
    with pytest.raises(OSError):
        impl.sendv(
            a.fileno(), b"", np.array([buf.ctypes.data], np.uint64), np.array([1 << 20], np.uint64), 1000
        )
    a.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_arrays_are_refused(impl):
    with pytest.raises(ValueError):
        impl.recvv(0, np.zeros(2, np.uint64), np.zeros(3, np.uint64), 10)


@pytest.mark.parametrize("impl", IMPLS)
def test_wait_readable_polls_for_at_most_its_time(impl):
    """A bounded busy-poll: False once the time is spent with nothing to
    read, True at once for bytes, for the end of the connection and for a
    reset; 0 looks once."""
    a, b = socket.socketpair()
    with a, b:
        start = time.perf_counter()
        assert impl.wait_readable(a.fileno(), 20_000) is False
        assert 0.02 <= time.perf_counter() - start < 2
        assert impl.wait_readable(a.fileno(), 0) is False
        b.send(b"x")
        start = time.perf_counter()
        assert impl.wait_readable(a.fileno(), 5_000_000) is True
        assert time.perf_counter() - start < 2  # not the 5 s it may poll for
        assert a.recv(1) == b"x"
        b.close()
        assert impl.wait_readable(a.fileno(), 0) is True  # the end: the next recv says so
        assert a.recv(1) == b""
        with pytest.raises(ValueError, match="spin_us must not be negative"):
            impl.wait_readable(a.fileno(), -1)
        with pytest.raises(ValueError, match="fd must not be negative"):
            impl.wait_readable(-1, 10)


@pytest.mark.parametrize("impl", IMPLS)
def test_wait_readable_returns_when_bytes_come_while_it_polls(impl):
    a, b = socket.socketpair()
    with a, b:
        timer = threading.Timer(0.05, b.send, (b"late",))
        timer.start()
        try:
            assert impl.wait_readable(a.fileno(), 5_000_000) is True
        finally:
            timer.join()
        assert a.recv(4) == b"late"


@pytest.mark.parametrize("impl", IMPLS)
def test_a_blocking_socket_times_out_by_its_own_timeout(impl):
    """On a blocking socket the kernel waits (SO_RCVTIMEO); EAGAIN is the
    timeout, not a reason to poll for timeout_ms more."""
    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
        assert os.get_blocking(b.fileno())
        buf = np.zeros(100, np.uint8)
        a.send(b"x" * 40)  # some progress first: the wait is for the rest
        start = time.perf_counter()
        with pytest.raises(TimeoutError, match="after 40 of 100 bytes"):
            impl.recvv(b.fileno(), np.array([buf.ctypes.data], np.uint64), np.array([100], np.uint64), 5_000)
        assert time.perf_counter() - start < 4  # the socket's 0.1 s, not the 5 s given
        assert bytes(buf[:40]) == b"x" * 40


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("timeout", [None, 5.0])  # a blocking socket; one Python made non-blocking
def test_peek_leaves_the_bytes_and_never_waits(impl, timeout):
    a, b = socket.socketpair()
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(1.0)  # must neither make peek wait nor leak into the fd's mode
    try:
        with a, b:
            a.settimeout(timeout)
            start = time.perf_counter()
            with pytest.raises(BlockingIOError):
                impl.peek(a.fileno(), 32)  # nothing there: at once, whatever the socket's mode
            assert time.perf_counter() - start < 0.5
            b.sendall(b"0123456789")
            assert impl.peek(a.fileno(), 4) == b"0123"
            assert impl.peek(a.fileno(), 32) == b"0123456789"  # fewer than asked: what is there
            assert a.recv(32) == b"0123456789"  # still there for the next read
            assert a.gettimeout() == timeout and os.get_blocking(a.fileno()) == (timeout is None)
            b.close()
            assert impl.peek(a.fileno(), 32) == b""  # the end of the connection
            os.fstat(a.fileno())  # the fd is still open: peek never owns it
            for nbytes in (0, -1, impl.PEEK_MAX + 1):
                with pytest.raises(ValueError, match="nbytes must be 1 to"):
                    impl.peek(a.fileno(), nbytes)
            with pytest.raises(ValueError, match="fd must not be negative"):
                impl.peek(-1, 32)
            assert impl.PEEK_MAX >= 32  # a message header fits
    finally:
        socket.setdefaulttimeout(previous)


@pytest.mark.parametrize("impl", IMPLS)
def test_signals_do_not_stretch_a_wait_past_its_timeout(impl):
    """A wait interrupted by signals polls only for what is left of its
    timeout: signals every 20 ms against a 300 ms wait for bytes that never
    come."""
    a, b = socket.socketpair()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    # The signals stop after 2 s whatever happens (from another thread: the waiting one is
    # inside the call), so that a wait they stretch still ends, and fails the bound below.
    stop = threading.Timer(2.0, signal.setitimer, (signal.ITIMER_REAL, 0))
    with a, b:
        b.settimeout(5)  # non-blocking underneath: the data path waits in poll()
        buf = np.zeros(100, np.uint8)
        signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
        stop.start()
        start = time.perf_counter()
        try:
            with pytest.raises(TimeoutError, match="no progress"):
                impl.recvv(
                    b.fileno(), np.array([buf.ctypes.data], np.uint64), np.array([100], np.uint64), 300
                )
            elapsed = time.perf_counter() - start
        finally:
            stop.cancel()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert 0.29 <= elapsed < 1.5


# serve_read: a region table with kvx.memory.RegionTable's pin_table and release.
_READ_OK = 1 | 2  # VALID | REMOTE_READ
_NO_PAIRS = np.zeros(0, np.uint64)


class _Table:
    """Regions over one buffer: 0 host memory open to remote reads and
    writes, 1 registered without remote access, 2 open too but on a CUDA
    device, 3 a hole, 4 open to remote reads only. Counts its pins and knows
    which are held."""

    def __init__(self) -> None:
        self.buf = np.arange(4 * 4096, dtype=np.uint64).view(np.uint8).copy()
        base = self.buf.ctypes.data
        self.tables = (
            np.array([base, base + 4096, base + 8192, 0, base + 12288], dtype=np.uint64),
            np.array([4096, 4096, 4096, 0, 4096], dtype=np.uint64),
            np.array([_READ_OK | 4, 1, _READ_OK | 4, 0, _READ_OK], dtype=np.uint8),
            np.array([-1, -1, 0, -1, -1], dtype=np.int32),
        )
        self.pinned: set[int] = set()
        self.pins = 0
        self.named: list[set[int]] = []  # per pin, the regions it was asked to hold back

    def pin_table(self, ids=None):
        assert ids is not None, "a request pins the regions it names, not the whole table"
        self.named.append(set(ids))
        assert len(self.named[-1]) == len(ids), "each region once"
        self.pins += 1
        self.pinned.add(self.pins)
        return (self.pins, *self.tables)

    def release(self, token):
        self.pinned.remove(token)


def _payload(descs) -> bytes:
    return b"".join(struct.pack("<IIQQ", r, 0, o, n) for r, o, n in descs)


def _serve(impl, table, descs, max_bytes=1 << 20):
    """Send descs' payload from one end of a socket pair and serve it at the
    other: (the payload, what serve_read returned, the bytes it sent)."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        payload = _payload(descs)
        a.sendall(payload)
        got = impl.serve_read(
            b.fileno(), b"H" * 24 + b"\xff" * 8, len(payload), table, _READ_OK, max_bytes, 5000
        )
        a.setblocking(False)
        sent = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := a.recv(1 << 20):
                sent += chunk
        assert (table.pins, table.pinned) == (1, set()), "one pin, released"
        assert table.named == [{r for r, _, _ in descs}]
        return payload, got, sent


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_sends_the_header_with_its_length_then_the_ranges(impl):
    table = _Table()
    descs = [(0, 100, 28), (0, 0, 0), (0, 4000, 96), (0, 7, 1)]
    _, got, sent = _serve(impl, table, descs)
    assert got is None
    want = b"".join(bytes(table.buf[o : o + n]) for _, o, n in descs)
    assert sent == b"H" * 24 + struct.pack("<Q", len(want)) + want


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "bad",
    [
        (1, 0, 8),  # no remote read
        (2, 0, 8),  # CUDA memory: the staged path's
        (3, 0, 0),  # a hole in the table
        (5, 0, 8),  # past the table
        (0, 4090, 7),  # one byte past the end
        (0, 4097, 0),  # an offset past the end
        (0, 2**64 - 1, 2),  # an offset far past the end
        (0, 8, 2**64 - 4),  # a length far past the end
    ],
)
def test_serve_read_refuses_without_sending_a_byte(impl, bad):
    """Any descriptor refused: nothing goes out, and the payload comes back
    for the caller's checks to answer with the reason."""
    payload, got, sent = _serve(impl, _Table(), [(0, 0, 16), bad])
    assert got == payload
    assert sent == b""


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_refuses_a_total_over_max_bytes(impl):
    _, got, sent = _serve(impl, _Table(), [(0, 0, 4096)], max_bytes=4096)
    assert got is None and len(sent) == 32 + 4096
    payload, got, sent = _serve(impl, _Table(), [(0, 0, 4096), (0, 0, 1)], max_bytes=4096)
    assert (got, sent) == (payload, b"")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("payload_len", [0, 23, 25, 65 * 24, -24])
def test_serve_read_takes_1_to_64_whole_descriptors(impl, payload_len):
    a, b = socket.socketpair()
    with a, b, pytest.raises(ValueError, match="whole descriptors"):
        impl.serve_read(b.fileno(), b"H" * 32, payload_len, _Table(), _READ_OK, 1 << 20, 100)
    assert impl.SERVE_MAX_DESCS == 64 >= SMALL_REQUEST_DESCS


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_checks_its_buffers_and_releases_the_pin(impl):
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError, match="header must be 32 bytes"):
            impl.serve_read(b.fileno(), b"H" * 31, 24, _Table(), _READ_OK, 1 << 20, 100)
        for column, wrong in ((1, np.zeros(3, np.uint64)), (3, np.zeros(4, np.int64))):
            table = _Table()
            table.tables = tuple(wrong if i == column else t for i, t in enumerate(table.tables))
            a.sendall(_payload([(0, 0, 8)]))
            with pytest.raises(ValueError, match="one length"):
                impl.serve_read(b.fileno(), b"H" * 32, 24, table, _READ_OK, 1 << 20, 100)
            assert (table.pins, table.pinned) == (1, set())


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_pins_nothing_while_the_descriptors_come(impl):
    """A peer that sends its descriptors slowly must not hold deregister
    back: the table is pinned only once they are all in."""
    table = _Table()
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        payload = _payload([(0, 0, 64), (0, 64, 64)])
        a.sendall(payload[:30])
        seen = []
        timer = threading.Timer(0.3, lambda: (seen.append(set(table.pinned)), a.sendall(payload[30:])))
        timer.start()
        assert impl.serve_read(b.fileno(), b"H" * 32, len(payload), table, _READ_OK, 1 << 20, 5000) is None
        timer.join()
        assert seen == [set()] and (table.pins, table.pinned) == (1, set())


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_is_bounded_in_time_and_sees_the_end(impl):
    """Descriptors that never come: TimeoutError after timeout_ms, not a
    hang; a peer that leaves halfway: ConnectionResetError. Nothing pinned."""
    table = _Table()
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(b"x" * 30)  # one descriptor and a quarter of the next
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            impl.serve_read(b.fileno(), b"H" * 32, 48, table, _READ_OK, 1 << 20, 200)
        assert 0.15 < time.monotonic() - start < 3
    a, b = socket.socketpair()
    with b:
        b.settimeout(5)
        a.sendall(b"x" * 30)
        a.close()
        with pytest.raises(ConnectionResetError):
            impl.serve_read(b.fileno(), b"H" * 32, 48, table, _READ_OK, 1 << 20, 5000)
    assert table.pins == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_releases_the_pin_when_the_send_fails(impl):
    table = _Table()
    a, b = socket.socketpair()
    with b:
        b.settimeout(5)
        a.sendall(_payload([(0, 0, 4096)]))
        a.close()
        with pytest.raises(OSError):  # EPIPE, or a reset
            impl.serve_read(b.fileno(), b"H" * 32, 24, table, _READ_OK, 1 << 20, 5000)
    assert (table.pins, table.pinned) == (1, set())


def _answer_pair(impl, sent: bytes, expect: bytes, nbytes: int):
    """Put ``sent`` in a socket and ask recv_answer for ``expect`` and
    ``nbytes`` of data in two ranges: (its result, the ranges, what is left)."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(sent)
        time.sleep(0.01)
        buf = np.zeros(nbytes + 16, dtype=np.uint8)
        cut = nbytes // 3
        addrs = np.array([buf.ctypes.data + cut + 8, buf.ctypes.data], dtype=np.uint64)  # out of order
        lens = np.array([nbytes - cut, cut], dtype=np.uint64)
        took = impl.recv_answer(b.fileno(), expect, addrs, lens, 5000)
        got = bytes(buf[:cut]) + bytes(buf[cut + 8 : nbytes + 8])
        b.setblocking(False)
        left = b""
        with contextlib.suppress(BlockingIOError):
            left = b.recv(1 << 20)
        return took, got, left


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_answer_takes_the_expected_answer_and_nothing_more(impl):
    header = struct.pack("<4sHHQIIQ", b"KVXF", 5, 2, 7, 0, 0, 1000)
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    took, got, left = _answer_pair(impl, header + data + b"next", header, 1000)
    assert took is True
    cut = 1000 // 3
    assert got == data[1000 - cut :] + data[: 1000 - cut]  # the ranges in their order
    assert left == b"next"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("at", [0, 4, 6, 8, 16, 20, 24, 31])  # each field of the header
def test_recv_answer_takes_nothing_unless_the_header_is_the_expected_one(impl, at):
    header = struct.pack("<4sHHQIIQ", b"KVXF", 5, 2, 7, 0, 0, 100)
    other = bytearray(header)
    other[at] ^= 1
    sent = bytes(other) + b"d" * 200
    took, got, left = _answer_pair(impl, sent, header, 100)
    assert (took, left) == (False, sent)
    assert got == b"\0" * 100


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_answer_takes_nothing_before_all_of_it_is_there(impl):
    header = struct.pack("<4sHHQIIQ", b"KVXF", 5, 2, 7, 0, 0, 100)
    for sent in (header[:20], header, header + b"d" * 99):
        took, _, left = _answer_pair(impl, sent, header, 100)
        assert (took, left) == (False, sent)


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_answer_checks_its_arguments_and_sees_a_closed_socket(impl):
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError, match="32 bytes"):
            impl.recv_answer(b.fileno(), b"x" * 31, _NO_PAIRS, _NO_PAIRS, 100)
        with pytest.raises(ValueError, match="equal length"):
            impl.recv_answer(b.fileno(), b"x" * 32, np.zeros(2, np.uint64), np.zeros(1, np.uint64), 100)
        a.close()
        assert impl.recv_answer(b.fileno(), b"x" * 32, _NO_PAIRS, _NO_PAIRS, 100) is False


_WRITE_OK = 1 | 4  # VALID | REMOTE_WRITE


def _write(impl, table, descs, data: bytes, data_len=None, reset=False, timeout_ms=5000):
    """Send a WRITE's descriptors and data (after a reset, with the
    connection reset by the sender) and serve it: (the payload, what
    serve_write returned or raised, what it sent back, what it left unread)."""
    if reset:  # a reset is tcp's
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
    else:
        a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        payload = _payload(descs)
        a.sendall(payload + data)
        time.sleep(0.05)  # all of it in b's buffer before the reset
        if reset:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            a.close()
        try:
            got = impl.serve_write(
                b.fileno(),
                b"W" * 32,
                len(payload),
                len(data) if data_len is None else data_len,
                table,
                _WRITE_OK,
                timeout_ms,
            )
        except OSError as exc:
            got = exc
        assert (table.pins, table.pinned) == (1, set()), "one pin, released"
        if reset:
            return payload, got, b"", b""
        b.setblocking(False)
        a.setblocking(False)
        sent = left = b""
        with contextlib.suppress(BlockingIOError):
            sent = a.recv(1 << 20)
        with contextlib.suppress(BlockingIOError):
            left = b.recv(1 << 20)
        return payload, got, sent, left


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_write_lands_the_data_then_answers(impl):
    table = _Table()
    descs = [(0, 100, 28), (0, 0, 0), (0, 4000, 96)]
    data = bytes(range(124))
    _, got, sent, left = _write(impl, table, descs, data + b"next", data_len=len(data))
    assert got is None and sent == b"W" * 32 and left == b"next"
    assert bytes(table.buf[100:128]) + bytes(table.buf[4000:4096]) == data
    assert (
        table.buf[128:4000].tobytes()
        == np.arange(3 * 4096, dtype=np.uint64).view(np.uint8)[128:4000].tobytes()
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "bad",
    [
        (1, 0, 8),  # no remote write
        (4, 0, 8),  # remote reads only
        (2, 0, 8),  # CUDA memory
        (3, 0, 0),  # a hole
        (5, 0, 8),  # past the table
        (0, 4090, 7),  # past the end of the region
        (0, 2**64 - 1, 2),  # an offset far past the end
    ],
)
def test_serve_write_refuses_without_reading_the_data(impl, bad):
    table = _Table()
    before = table.buf.copy()
    data = b"\xee" * (16 + bad[2] % 1000)
    payload, got, sent, left = _write(impl, table, [(0, 0, 16), bad], data, data_len=16 + bad[2] % 1000)
    assert (got, sent, left) == (payload, b"", data)
    assert (table.buf == before).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("announced", [15, 17])
def test_serve_write_refuses_data_other_than_its_descriptors_cover(impl, announced):
    table = _Table()
    before = table.buf.copy()
    payload, got, sent, left = _write(impl, table, [(0, 0, 16)], b"\xee" * announced)
    assert (got, sent, left) == (payload, b"", b"\xee" * announced)
    assert (table.buf == before).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_write_drops_a_write_the_initiator_reset(impl):
    """A reset connection: the initiator gave up on the WRITE, whose bytes
    must not land late, over newer data."""
    table = _Table()
    before = table.buf.copy()
    _, got, _, _ = _write(impl, table, [(0, 0, 64)], b"\xee" * 64, reset=True)
    assert isinstance(got, ConnectionResetError)
    assert (table.buf == before).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_write_is_bounded_in_time(impl):
    """Data that stops coming: TimeoutError after timeout_ms, the pin released."""
    table = _Table()
    _, got, _, _ = _write(impl, table, [(0, 0, 64)], b"\xee" * 10, data_len=64, timeout_ms=200)
    assert isinstance(got, TimeoutError)


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_write_checks_its_arguments(impl):
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError, match="header must be 32 bytes"):
            impl.serve_write(b.fileno(), b"W" * 31, 24, 8, _Table(), _WRITE_OK, 100)
        with pytest.raises(ValueError, match="whole descriptors"):
            impl.serve_write(b.fileno(), b"W" * 32, 25, 8, _Table(), _WRITE_OK, 100)


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_answer_takes_a_header_alone(impl):
    """A WRITE's answer: the header, no data."""
    header = struct.pack("<4sHHQIIQ", b"KVXF", 5, 4, 9, 0, 0, 0)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(header + b"more")
        time.sleep(0.01)
        assert impl.recv_answer(b.fileno(), header, _NO_PAIRS, _NO_PAIRS, 1000) is True
        assert b.recv(100) == b"more"


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_read_demands_valid_whatever_need_says(impl):
    """A region whose flags lack VALID (being removed) is never served, even
    by a caller that forgot VALID in need."""
    table = _Table()
    table.tables[2][0] = 2 | 4  # remote read and write, not VALID
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        payload = _payload([(0, 0, 8)])
        a.sendall(payload)
        assert impl.serve_read(b.fileno(), b"H" * 32, 24, table, 2, 1 << 20, 1000) == payload
        a.sendall(payload + b"d" * 8)
        assert impl.serve_write(b.fileno(), b"W" * 32, 24, 8, table, 4, 1000) == payload
    assert table.pinned == set()


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_refuses_negative_limits_and_a_pin_that_is_not_one(impl):
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError, match="must not be negative"):
            impl.serve_read(b.fileno(), b"H" * 32, 24, _Table(), _READ_OK, -1, 100)
        with pytest.raises(ValueError, match="must not be negative"):
            impl.serve_write(b.fileno(), b"W" * 32, 24, -1, _Table(), _WRITE_OK, 100)
        table = _Table()
        pin_table = table.pin_table
        table.pin_table = lambda ids: list(pin_table(ids))
        a.sendall(_payload([(0, 0, 8)]))
        with pytest.raises(ValueError, match="5-tuple"):
            impl.serve_read(b.fileno(), b"H" * 32, 24, table, _READ_OK, 1 << 20, 100)
        assert (table.pins, table.pinned) == (1, set())  # given back all the same
        with pytest.raises(ValueError, match="fd must not be negative"):
            impl.recv_answer(-1, b"x" * 32, _NO_PAIRS, _NO_PAIRS, 100)


@pytest.mark.parametrize("impl", IMPLS)
def test_serve_refuses_ranges_whose_addresses_wrap(impl):
    """A region at the top of the address space (no real table has one):
    a range inside it whose end address wraps is refused, not sent."""
    table = _Table()
    table.tables[0][0], table.tables[1][0] = 2**64 - 10, 100
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        for descs in ([(0, 0, 20)], [(0, 9, 2)]):
            payload = _payload(descs)
            a.sendall(payload)
            assert (
                impl.serve_read(b.fileno(), b"H" * 32, len(payload), table, _READ_OK, 1 << 20, 1000)
                == payload
            )
    assert table.pinned == set()
