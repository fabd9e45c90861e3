"""The side channel against hostile clients and servers, on real loopback sockets.

Trickling clients (a header line every 0.2 s, forever) are cut off at the
request deadline and do not keep a legitimate peer from its document; the
handler threads stay within their bound; an oversized request is refused;
and ``fetch`` gives up on a server that trickles its answer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import select
import socket
import threading
import time

import pytest

from kvx.connectors import side_channel
from kvx.errors import ConfigError, ConnectError
from tests.conftest import native_pass_only

pytestmark = [pytest.mark.timeout(60), native_pass_only]

DOC = {"engine_id": "e0", "ranks": [{"rank": 0, "agent": "prefill-0"}]}
TRICKLE_S = 0.2  # between two header lines of a trickling client
GIVE_UP_S = 20.0  # a test's own bound on waiting for something the fix makes happen within seconds


@pytest.fixture
def make_server():
    started: list[side_channel.SideChannelServer] = []

    def make(**kwargs) -> side_channel.SideChannelServer:
        server = side_channel.SideChannelServer("127.0.0.1", 0, **kwargs)
        server.publish(DOC)
        started.append(server)
        return server

    yield make
    for server in started:
        server.close()


def handler_threads() -> int:
    return sum(t.name == "kvx-side-channel-request" for t in threading.enumerate())


class Tricklers:
    """Clients that send a request line, then one header line every TRICKLE_S, until the server hangs up."""

    def __init__(self, port: int, count: int) -> None:
        self.started = time.monotonic()
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
        for sock in self.socks:
            sock.sendall(f"GET {side_channel.PATH} HTTP/1.1\r\nHost: kvx\r\n".encode())
        self.cut_after_s: dict[int, float] = {}

    def step(self) -> None:
        """One header line from each client still connected; notes those the server closed."""
        for i, sock in enumerate(self.socks):
            if i in self.cut_after_s:
                continue
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                closed = bool(select.select([sock], [], [], 0)[0]) and sock.recv(4096) == b""
            except OSError:
                closed = True
            if closed:
                self.cut_after_s[i] = time.monotonic() - self.started

    def all_cut(self) -> bool:
        return len(self.cut_after_s) == len(self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def test_trickling_clients_are_cut_off_and_a_peer_is_answered_promptly(make_server):
    server = make_server(deadline_s=1.0)
    tricklers = Tricklers(server.port, 6)
    try:
        tricklers.step()
        before = time.monotonic()
        assert side_channel.fetch("127.0.0.1", server.port, timeout_s=5) == DOC
        assert time.monotonic() - before < 3  # not held behind the tricklers
        while not tricklers.all_cut() and time.monotonic() - tricklers.started < GIVE_UP_S:
            tricklers.step()
            time.sleep(TRICKLE_S)
    finally:
        tricklers.close()
    assert tricklers.all_cut(), f"still connected after {GIVE_UP_S} s: {tricklers.cut_after_s}"
    # Cut at the 1 s deadline (seen by the next step); a per-read timeout would never fire.
    assert max(tricklers.cut_after_s.values()) < 5, tricklers.cut_after_s
    assert side_channel.fetch("127.0.0.1", server.port, timeout_s=5) == DOC


def test_handler_threads_stay_within_their_bound(make_server):
    server = make_server(deadline_s=1.0, max_handlers=2)
    tricklers = Tricklers(server.port, 5)
    most = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Queued behind the tricklers: answered once the deadline frees handlers.
            peer = pool.submit(side_channel.fetch, "127.0.0.1", server.port, 10)
            while (
                not (tricklers.all_cut() and peer.done()) and time.monotonic() - tricklers.started < GIVE_UP_S
            ):
                most = max(most, handler_threads())
                tricklers.step()
                time.sleep(TRICKLE_S)
            assert peer.result(0) == DOC
    finally:
        tricklers.close()
    assert tricklers.all_cut(), tricklers.cut_after_s
    assert 1 <= most <= 2, most


def test_a_flood_of_tricklers_cannot_keep_a_peer_from_its_document(make_server):
    """The attack: more trickling clients than handlers, with a long deadline,
    so that no handler frees itself for a long time. The slowest request is
    cut off to make room: the peer's fetch is answered at once, not after
    the deadline."""
    server = make_server(deadline_s=30.0, max_handlers=4)
    tricklers = Tricklers(server.port, 3 * 4)
    try:
        tricklers.step()
        time.sleep(0.5)  # every handler taken by a trickler
        before = time.monotonic()
        assert side_channel.fetch("127.0.0.1", server.port, timeout_s=10) == DOC
        assert time.monotonic() - before < 10  # held behind the tricklers, it would wait 30 s
        assert side_channel.fetch("127.0.0.1", server.port, timeout_s=10) == DOC
    finally:
        tricklers.close()


def test_clients_that_never_read_the_answer_cannot_keep_a_peer_from_it(make_server):
    """The attack: complete requests whose answers are never read (a zero
    window), with a document larger than the socket buffers, so every
    handler waits on its write. The longest-handled connection is cut off to
    make room for the peer."""
    server = make_server(deadline_s=30.0, max_handlers=4)
    big = {"engine_id": "e0", "pad": "x" * (8 << 20)}
    server.publish(big)
    readers = []
    try:
        for _ in range(2 * 4):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(f"GET {side_channel.PATH} HTTP/1.1\r\nHost: kvx\r\n\r\n".encode())
            readers.append(sock)
        time.sleep(0.5)  # every handler is blocked writing to a reader that does not read
        before = time.monotonic()
        assert side_channel.fetch("127.0.0.1", server.port, timeout_s=10) == big
        assert time.monotonic() - before < 10  # held behind them, it would wait out their 30 s
    finally:
        for sock in readers:
            sock.close()


def test_an_oversized_request_is_refused(make_server):
    server = make_server()
    head = f"GET {side_channel.PATH} HTTP/1.1\r\nHost: kvx\r\n".encode()
    padding = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))  # 20 KiB
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + padding + b"\r\n")
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.0 431 "), answer[:200]
    assert side_channel.fetch("127.0.0.1", server.port, timeout_s=5) == DOC


def test_bad_settings_are_refused():
    for bad in ({"deadline_s": 0}, {"max_handlers": 0}, {"max_request_bytes": -1}):
        with pytest.raises(ConfigError):
            side_channel.SideChannelServer("127.0.0.1", 0, **bad)


def test_fetch_gives_up_on_a_server_that_trickles_its_answer():
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            while not stop.wait(TRICKLE_S):  # each byte well inside the per-read timeout
                conn.sendall(b" ")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        before = time.monotonic()
        with pytest.raises(ConnectError, match="not its whole document within 1.0 s"):
            side_channel.fetch("127.0.0.1", listener.getsockname()[1], timeout_s=1.0)
        assert time.monotonic() - before < 5
    finally:
        stop.set()
        thread.join(5)
        listener.close()
