"""Types of the C extension built from csrc/kvx_io.c; the twin is io_py.py."""

from typing import Any

from _typeshed import ReadableBuffer

IOV_MAX: int
PEEK_MAX: int
SERVE_MAX_DESCS: int

def sendv(
    fd: int, prefix: ReadableBuffer, addrs: ReadableBuffer, lens: ReadableBuffer, timeout_ms: int, /
) -> None: ...
def recvv(fd: int, addrs: ReadableBuffer, lens: ReadableBuffer, timeout_ms: int, /) -> None: ...
def wait_readable(fd: int, spin_us: int, /) -> bool: ...
def peek(fd: int, nbytes: int, /) -> bytes: ...
def serve_read(
    fd: int,
    header: ReadableBuffer,
    payload_len: int,
    table: Any,
    need: int,
    max_bytes: int,
    timeout_ms: int,
    /,
) -> bytes | None: ...
def serve_write(
    fd: int,
    header: ReadableBuffer,
    payload_len: int,
    data_len: int,
    table: Any,
    need: int,
    timeout_ms: int,
    /,
) -> bytes | None: ...
def recv_answer(
    fd: int, expect: ReadableBuffer, addrs: ReadableBuffer, lens: ReadableBuffer, timeout_ms: int, /
) -> bool: ...
