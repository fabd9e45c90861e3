"""The send deadline of kvx's HTTP protocol (kvx/_http.py), driven by hand:
a client whose connection's buffers stay full must take SEND_PROGRESS_BYTES
of its answer every send_timeout_s. One that reads, however slowly, keeps
its connection; one that stopped is reset (SO_LINGER 0, then abort)."""

import struct

import uvicorn
from uvicorn.server import ServerState

from kvx import _http


class FakeTransport:
    def __init__(self) -> None:
        self.buffered = 0
        self.aborted = False
        self.linger: bytes | None = None

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default=None):
        if name == "socket":
            return self
        if name == "peername":
            return ("192.0.2.7", 4242)
        return default

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        self.linger = value

    def getsockname(self) -> tuple[str, int]:
        return ("192.0.2.1", 8000)

    def getpeername(self) -> tuple[str, int]:
        return ("192.0.2.7", 4242)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class FakeLoop:
    """call_later that the test fires by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback):
        loop = self

        class Handle:
            cancelled = False

            def cancel(self) -> None:
                self.cancelled = True
                loop.timers.remove(self)

        handle = Handle()
        handle.fire = callback
        self.timers.append(handle)
        return handle

    def fire(self) -> None:
        [handle] = self.timers
        self.timers.remove(handle)
        self.now += 60
        handle.fire()


def _connected(loop: FakeLoop):
    protocol_class = _http.deadline_protocol(header_timeout_s=10, send_timeout_s=60)
    config = uvicorn.Config(app=lambda scope, receive, send: None, log_config=None)
    protocol = protocol_class(config, ServerState(), {}, _loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    for timer in list(loop.timers):  # the header deadline: not what this tests
        timer.cancel()
    return protocol, transport


def test_a_client_that_stops_reading_is_reset(monkeypatch) -> None:
    monkeypatch.setattr(_http, "_warned", {"at": -_http._WARN_EVERY_S, "since": 0})
    loop = FakeLoop()
    protocol, transport = _connected(loop)
    transport.buffered = 1 << 20
    protocol.pause_writing()
    transport.buffered -= _http.SEND_PROGRESS_BYTES - 1  # not quite enough read in the period
    loop.fire()
    assert transport.aborted and struct.unpack("ii", transport.linger) == (1, 0)


def test_a_slow_reader_keeps_its_connection_and_draining_stops_the_deadline() -> None:
    loop = FakeLoop()
    protocol, transport = _connected(loop)
    transport.buffered = 4 << 20  # a large answer, written at once
    protocol.pause_writing()
    for _ in range(5):  # 64 KiB a minute: slow, but it reads
        transport.buffered -= _http.SEND_PROGRESS_BYTES
        loop.fire()
        assert not transport.aborted and len(loop.timers) == 1
    protocol.resume_writing()  # drained below the low-water mark
    assert not loop.timers and not transport.aborted
