"""Pure-Python twin of kvx._datapath._native (csrc/kvx_io.c).

Same functions, same semantics, same exceptions; slower (one Python object
per descriptor). Selected with KVX_NATIVE=0, or used when the C extension was
not built. Tests run against both.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import termios

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
PEEK_MAX = 4096
SERVE_MAX_DESCS = 64
_DESC = struct.Struct("<IIQQ")  # region, padding, offset, length
_U64_MAX = (1 << 64) - 1

_libc = ctypes.CDLL(None, use_errno=True)
_recv = _libc.recv
_recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_recv.restype = ctypes.c_ssize_t
_getsockopt = _libc.getsockopt
_getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_getsockopt.restype = ctypes.c_int


def _socket_error(fd: int) -> bool:
    """The socket has a pending error (SO_ERROR, which reading clears), or
    cannot say; through libc, as peek."""
    err, size = ctypes.c_int(0), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    return _getsockopt(
        fd, socket.SOL_SOCKET, socket.SO_ERROR, ctypes.byref(err), ctypes.byref(size)
    ) != 0 or bool(err.value)


def _views(addrs, lens, writable: bool) -> list[memoryview]:
    views = []
    for addr, length in zip(addrs.tolist(), lens.tolist(), strict=True):
        if length == 0:
            continue
        view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
        views.append(view if writable else view.toreadonly())
    return views


def _wait(fd: int, events: int, timeout_ms: int) -> bool:
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(timeout_ms))


def _move_all(fd: int, views: list[memoryview], sending: bool, timeout_ms: int) -> None:
    total = sum(len(v) for v in views)
    moved = 0
    at = 0
    while at < len(views):
        batch = views[at : at + IOV_MAX]
        try:
            n = os.writev(fd, batch) if sending else os.readv(fd, batch)
        except InterruptedError:
            continue
        except BlockingIOError:
            # Blocking socket: its SO_RCVTIMEO/SO_SNDTIMEO expired; else wait in poll.
            if os.get_blocking(fd) or not _wait(fd, select.POLLOUT if sending else select.POLLIN, timeout_ms):
                raise TimeoutError(f"no progress on socket after {moved} of {total} bytes") from None
            continue
        if n == 0 and not sending:
            raise ConnectionResetError(f"connection closed by peer after {moved} of {total} bytes")
        moved += n
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n > 0:
            views[at] = views[at][n:]


def _check_pairs(addrs, lens) -> None:
    a, b = memoryview(addrs), memoryview(lens)
    if a.itemsize != 8 or b.itemsize != 8 or a.nbytes != b.nbytes:
        raise ValueError("addrs and lens must be uint64 buffers of equal length")


def sendv(fd: int, prefix: bytes, addrs, lens, timeout_ms: int) -> None:
    """Send prefix, then each (addr, len), in order; see csrc/kvx_io.c."""
    _check_pairs(addrs, lens)
    views = ([memoryview(prefix).cast("B")] if len(prefix) else []) + _views(addrs, lens, False)
    _move_all(fd, views, True, timeout_ms)


def recvv(fd: int, addrs, lens, timeout_ms: int) -> None:
    """Receive exactly into each (addr, len), in order; see csrc/kvx_io.c."""
    _check_pairs(addrs, lens)
    _move_all(fd, _views(addrs, lens, True), False, timeout_ms)


def wait_readable(fd: int, spin_us: int) -> bool:
    """True once fd is readable (bytes, the end of the connection, an error)
    within spin_us microseconds; see csrc/kvx_io.c. The twin sleeps in one
    poll() of whole milliseconds instead of polling without sleeping: a loop
    here would take the GIL back after every poll."""
    if spin_us < 0 or fd < 0:
        raise ValueError("spin_us must not be negative" if spin_us < 0 else "fd must not be negative")
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(-(-spin_us // 1000)))


def peek(fd: int, nbytes: int) -> bytes:
    """Up to nbytes of what the socket holds, left there; never waits
    (BlockingIOError when it holds nothing); see csrc/kvx_io.c. Through
    libc's recv, not a socket object: one made for the fd would own it
    (an exception at the wrong moment would close it) and would take
    socket.getdefaulttimeout() into the fd's mode."""
    if fd < 0:
        raise ValueError("fd must not be negative")
    if not 1 <= nbytes <= PEEK_MAX:
        raise ValueError(f"nbytes must be 1 to {PEEK_MAX}")
    buf = ctypes.create_string_buffer(nbytes)
    while True:
        n = _recv(fd, buf, nbytes, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        if n >= 0:
            return buf.raw[:n]
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))  # EAGAIN: BlockingIOError


def serve_read(
    fd: int, header, payload_len: int, table, need: int, max_bytes: int, timeout_ms: int
) -> bytes | None:
    """Answer a small READ_REQ: receive its descriptors, pin ``table``, check
    them, send the header (its data length set) and the ranges, release the
    pin; None once sent, else the payload, nothing sent; see csrc/kvx_io.c."""
    return _serve_request(False, fd, header, payload_len, table, need, max_bytes, timeout_ms)


def serve_write(
    fd: int, header, payload_len: int, data_len: int, table, need: int, timeout_ms: int
) -> bytes | None:
    """Take a small WRITE_REQ: receive its descriptors, pin ``table``, check
    them (their total is data_len), receive the data into the ranges,
    release the pin, send the header; None once done, else the payload,
    nothing more read; see csrc/kvx_io.c."""
    return _serve_request(True, fd, header, payload_len, table, need, data_len, timeout_ms)


def _serve_request(
    writing: bool, fd: int, header, payload_len: int, table, need: int, limit: int, timeout_ms: int
) -> bytes | None:
    name = "serve_write" if writing else "serve_read"
    if limit < 0:
        raise ValueError(f"{name}: {'data_len' if writing else 'max_bytes'} must not be negative")
    need |= 1  # VALID always: pin_table's contract reads only regions that carry it
    if len(header) != 32:
        raise ValueError(f"{name}: the header must be 32 bytes")
    if not 0 < payload_len <= SERVE_MAX_DESCS * _DESC.size or payload_len % _DESC.size:
        raise ValueError(f"{name}: 1 to {SERVE_MAX_DESCS} whole descriptors of {_DESC.size} bytes")
    payload = bytearray(payload_len)
    _move_all(fd, [memoryview(payload)], False, timeout_ms)  # nothing pinned while it comes
    # Only the regions the descriptors name: a request that lasts stalls no other's deregistration.
    pinned = table.pin_table(tuple({region for region, _, _, _ in _DESC.iter_unpack(payload)}))
    try:
        if not isinstance(pinned, tuple) or len(pinned) != 5:
            raise ValueError(f"{name}: pin_table() must give a 5-tuple")
        _, bases, sizes, flags, devices = pinned
        flags = memoryview(flags).cast("B")
        top = len(flags)
        try:
            base_of = memoryview(bases).cast("B").cast("Q")
            size_of = memoryview(sizes).cast("B").cast("Q")
            device_of = memoryview(devices).cast("B").cast("i")
        except TypeError:  # a length that is not a whole number of items
            base_of = size_of = device_of = memoryview(b"")
        if len(base_of) != top or len(size_of) != top or len(device_of) != top:
            raise ValueError(
                f"{name}: pin_table() must give (token, bases u64, sizes u64, flags u8, devices i32) "
                "of one length"
            )
        views, total = [], 0
        for region, _, offset, length in _DESC.iter_unpack(payload):
            if region >= top or flags[region] & need != need or device_of[region] >= 0:
                return bytes(payload)
            base, size = base_of[region], size_of[region]
            if offset > size or length > size - offset or base + offset + length > _U64_MAX:
                return bytes(payload)
            if length > limit - total:
                return bytes(payload)
            total += length
            if length:
                view = memoryview((ctypes.c_char * length).from_address(base + offset)).cast("B")
                views.append(view if writing else view.toreadonly())
        if writing:
            if total != limit:
                return bytes(payload)
            if _socket_error(fd):
                raise ConnectionResetError(
                    "the initiator reset the connection; its buffered WRITE is dropped"
                )
            _move_all(fd, views, False, timeout_ms)
        else:
            frame = bytes(header[:24]) + total.to_bytes(8, "little")
            _move_all(fd, [memoryview(frame), *views], True, timeout_ms)
    finally:
        if isinstance(pinned, tuple) and len(pinned) == 5:
            table.release(pinned[0])
        elif not isinstance(pinned, dict) and hasattr(type(pinned), "__getitem__"):
            with contextlib.suppress(Exception):  # not the pin expected: give back what looks like its token
                table.release(pinned[0])
    if writing:
        _move_all(fd, [memoryview(header).cast("B")], True, timeout_ms)
    return None


def recv_answer(fd: int, expect, addrs, lens, timeout_ms: int) -> bool:
    """Take the answer whose header is ``expect`` and whose data fills the
    ranges, once all of it is buffered; False, nothing taken, otherwise; see
    csrc/kvx_io.c."""
    if fd < 0:
        raise ValueError("fd must not be negative")
    if len(expect) != 32:
        raise ValueError("recv_answer: the expected header must be 32 bytes")
    _check_pairs(addrs, lens)
    total = 32 + sum(memoryview(lens).cast("B").cast("Q"))
    if total > 2**31 - 1:
        return False
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return False
    if count[0] < total:
        return False
    try:
        if peek(fd, 32) != bytes(expect):
            return False
    except OSError:
        return False
    _move_all(fd, [memoryview(bytearray(32)), *_views(addrs, lens, True)], False, timeout_ms)
    return True
