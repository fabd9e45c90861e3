"""Types of the C extension built from csrc/kvx_io.c; the twin is io_py.py."""

from _typeshed import ReadableBuffer

IOV_MAX: int

def sendv(
    fd: int, prefix: ReadableBuffer, addrs: ReadableBuffer, lens: ReadableBuffer, timeout_ms: int, /
) -> None: ...
def recvv(fd: int, addrs: ReadableBuffer, lens: ReadableBuffer, timeout_ms: int, /) -> None: ...
def wait_readable(fd: int, spin_us: int, /) -> bool: ...
