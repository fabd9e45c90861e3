"""Shared segments: same-host host memory where cross-memory attach is refused.

Some hosts forbid ``process_vm_readv`` between the agents (a container
without CAP_SYS_PTRACE, Yama ``ptrace_scope`` 2 or 3, agents in different
pid namespaces). The shm backend then copies through shared memory instead,
for memory the application allocated with ``kvx.alloc_shared`` (a memfd
mapped MAP_SHARED): the target hands the initiator a descriptor of each
such region's segment, and the initiator maps it once and copies with
memcpy. Other memory still goes over tcp.

Handing over a file descriptor needs a Unix socket (SCM_RIGHTS). The target
listens on an abstract one (``segment_socket`` in its metadata; abstract
sockets live in the network namespace, so containers of one pod reach each
other's). That socket is not authenticated by itself: the initiator first
asks for a single-use random token over its authenticated tcp connection
(SEG_TOKEN, kvx/backends/control/wire.py) and presents it on the Unix socket,
so only a peer that passed the HMAC challenge gets descriptors.

A descriptor gives whoever holds it the whole segment for as long as it
keeps it, so what is handed out is narrowed to what was registered:

- only a region that is a whole segment (``kvx.alloc_shared`` memory
  registered in full, with remote access) is handed out; a region that is
  part of a segment goes over tcp, since the rest of the segment was never
  registered;
- a region registered without remote write gets a read-only descriptor, and
  its segment is sealed against new writable mappings (F_SEAL_FUTURE_WRITE),
  so that reopening the descriptor read-write through /proc maps nothing
  writable;
- every segment is sealed against shrinking and growing from the start
  (F_SEAL_SHRINK, F_SEAL_GROW): ``ftruncate`` on a handed-out descriptor
  fails instead of turning every mapping's next access into SIGBUS.

The initiator, in turn, maps only segments sealed against shrinking and at
least as large as the target says, so a hostile target cannot crash it.
A peer that mapped a segment can touch it until it unmaps it, also after the
region is deregistered: register a segment for remote access only when its
memory serves that purpose alone (docs/security.md).

The server serves every client from one thread through a selector, one
deadline per request, and at most MAX_CLIENTS at once (the oldest goes
first when more come): a local process that trickles bytes or opens many
connections cannot keep an honest peer waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import mmap
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from kvx.backends.base import BackendContext
from kvx.backends.control.sock import recv_exact
from kvx.errors import AccessError, ConnectError, PeerLostError, ProtocolError, TimeoutError
from kvx.memory import Region

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
MAX_TOKENS = 256
MAX_REGIONS_PER_REQUEST = 4096
# Per region in the answer: status (0 ok), offset in its segment, size; then one fd per ok region.
_ENTRY = struct.Struct("<IQQ")
_IO_TIMEOUT_S = 5.0
# Writing an answer (it fits the socket's buffer, so this is never reached by an honest client).
_SEND_TIMEOUT_S = 1.0


def socket_name(pid: int, epoch: int) -> str:
    return f"kvx-seg-{pid}-{epoch:016x}"


# The memfd seals (fcntl.F_SEAL_*; Python names no F_SEAL_FUTURE_WRITE).
SEAL_SHRINK = fcntl.F_SEAL_SHRINK
SEAL_GROW = fcntl.F_SEAL_GROW
SEAL_FUTURE_WRITE = 0x0010
# Entry statuses in the answer.
OK_READ_WRITE = 0
REFUSED = 1
OK_READ_ONLY = 2
# Clients served at once; past that, the oldest connection is dropped.
MAX_CLIENTS = 64


def whole_segment(region: Region) -> bool:
    """The region is a whole kvx.alloc_shared segment: one that may be handed out."""
    if region.segment_fd < 0 or region.segment_offset:
        return False
    try:
        return os.fstat(region.segment_fd).st_size == region.size_bytes
    except OSError:
        return False


@dataclasses.dataclass(eq=False)
class _Client:
    sock: socket.socket
    deadline: float
    data: bytearray = dataclasses.field(default_factory=bytearray)


class SegmentServer:
    """The target's side: hands segment descriptors to token holders."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.name = socket_name(os.getpid(), ctx.epoch)
        self._tokens: dict[bytes, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._clients: dict[socket.socket, _Client] = {}  # insertion order: oldest first
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"kvx-segments-{ctx.agent_name}", daemon=True)
        self._thread.start()

    def issue(self, peer: str) -> bytes:
        """A single-use token for an authenticated peer."""
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
            if len(self._tokens) >= MAX_TOKENS:
                raise AccessError(f"{MAX_TOKENS} segment tokens outstanding; try again later")
            token = secrets.token_bytes(TOKEN_BYTES)
            self._tokens[token] = (peer, now + TOKEN_TTL_S)
            return token

    def _redeem(self, token: bytes) -> str | None:
        with self._lock:
            found = self._tokens.pop(token, None)
        if found is None or found[1] < time.monotonic():
            return None
        return found[0]

    def _loop(self) -> None:
        while not self._closed:
            timeout = None
            if self._clients:
                timeout = max(0.0, min(c.deadline for c in self._clients.values()) - time.monotonic())
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self._sock:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    return
                else:
                    self._readable(key.data)
            now = time.monotonic()
            for client in [c for c in self._clients.values() if c.deadline <= now]:
                logger.info("segment request refused: not complete within %.0f s", _IO_TIMEOUT_S)
                self._drop(client)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the listener stays up
                logger.warning("segment socket accept failed: %s", exc)
                return
            if len(self._clients) >= MAX_CLIENTS:
                oldest = next(iter(self._clients.values()))
                logger.warning("%d segment clients at once; dropping the oldest", MAX_CLIENTS)
                self._drop(oldest)
            conn.setblocking(False)
            client = _Client(conn, time.monotonic() + _IO_TIMEOUT_S)
            self._clients[conn] = client
            self._selector.register(conn, selectors.EVENT_READ, client)

    def _drop(self, client: _Client) -> None:
        self._clients.pop(client.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        client.sock.close()

    def _readable(self, client: _Client) -> None:
        if client.sock not in self._clients:
            return  # dropped meanwhile
        try:
            more = client.sock.recv(TOKEN_BYTES + 4 + 4 * MAX_REGIONS_PER_REQUEST - len(client.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            more = b""
        if not more:
            self._drop(client)
            return
        client.data += more
        try:
            answered = self._serve(client)
        except Exception as exc:  # one bad client must not stop the server
            logger.info("segment request refused: %s", exc)
            answered = True
        if answered:
            self._drop(client)

    def _serve(self, client: _Client) -> bool:
        """Answer once the whole request is in; False while it is not."""
        data = client.data
        if len(data) < TOKEN_BYTES + 4:
            return False
        token, count = bytes(data[:TOKEN_BYTES]), struct.unpack_from("<I", data, TOKEN_BYTES)[0]
        if count > MAX_REGIONS_PER_REQUEST:
            raise ProtocolError(f"{count} regions in one segment request")
        if len(data) < TOKEN_BYTES + 4 + 4 * count:
            return False
        if len(data) > TOKEN_BYTES + 4 + 4 * count:
            raise ProtocolError("bytes after a segment request")
        ids = np.frombuffer(data, dtype="<u4", count=count, offset=TOKEN_BYTES + 4)
        client.sock.settimeout(_SEND_TIMEOUT_S)  # the answer fits the socket's buffer
        peer = self._redeem(token)
        if peer is None:
            client.sock.sendall(struct.pack("<I", 1))  # refused: no answer beyond that
            raise AccessError("a segment request presented an unknown or expired token")
        entries, fds, opened = [], [], []
        try:
            for rid in ids.tolist():
                status, fd = self._hand_out(self.ctx.regions.get(rid))
                if fd < 0:
                    entries.append(_ENTRY.pack(REFUSED, 0, 0))
                    continue
                region = self.ctx.regions.get(rid)
                assert region is not None
                entries.append(_ENTRY.pack(status, 0, region.size_bytes))
                fds.append(fd)
                if fd != region.segment_fd:
                    opened.append(fd)
            socket.send_fds(client.sock, [struct.pack("<I", 0) + b"".join(entries)], fds)
        finally:
            for fd in opened:
                os.close(fd)
        logger.debug("gave peer %s %d segment(s)", peer, len(fds))
        return True

    @staticmethod
    def _hand_out(region: Region | None) -> tuple[int, int]:
        """(status, descriptor) for one region; descriptor -1 when refused.
        A read-only region gets a read-only descriptor of its own, the
        caller closes it."""
        if region is None or not (region.remote_read or region.remote_write) or not whole_segment(region):
            return REFUSED, -1
        if region.remote_write:
            try:
                sealed = fcntl.fcntl(region.segment_fd, fcntl.F_GET_SEALS) & SEAL_FUTURE_WRITE
            except OSError:
                sealed = True
            if sealed:  # handed out read-only once: no peer may map it writable again
                logger.info(
                    "region %d's segment was handed out read-only before; peers write it over tcp", region.id
                )
                return REFUSED, -1
            return OK_READ_WRITE, region.segment_fd
        try:
            # Reopening through /proc gives a new read-only open file; the seal
            # stops a read-write reopen of it from mapping anything writable.
            fcntl.fcntl(region.segment_fd, fcntl.F_ADD_SEALS, SEAL_FUTURE_WRITE)
            return OK_READ_ONLY, os.open(f"/proc/self/fd/{region.segment_fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            logger.warning(
                "cannot hand out region %d read-only (%s); peers reach it over tcp", region.id, exc
            )
            return REFUSED, -1

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(5)
        for client in list(self._clients.values()):
            self._drop(client)
        self._selector.close()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        return bytes(recv_exact(sock, n, deadline))
    except (PeerLostError, TimeoutError) as exc:
        raise ProtocolError(f"segment request cut short: {exc}") from None


class Mapping:
    """A peer's segment, mapped here: where each region starts."""

    def __init__(self, mapped: mmap.mmap, base: int, size: int, writable: bool = True) -> None:
        self.mapped = mapped
        self.base = base
        self.size = size
        self.writable = writable


def fetch(name: str, token: bytes, region_ids: list[int], peer: str) -> dict[int, Mapping]:
    """The initiator's side: map the segments of ``region_ids`` (those the
    target has; the others are left out)."""
    if not region_ids:
        return {}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_IO_TIMEOUT_S)
    fds: list[int] = []
    try:
        try:
            sock.connect("\0" + name)
        except OSError as exc:
            raise ConnectError(
                f"cannot reach peer {peer!r}'s segment socket @{name}: {exc} (another network namespace?)"
            ) from None
        sock.sendall(token + struct.pack("<I", len(region_ids)) + np.asarray(region_ids, "<u4").tobytes())
        want = 4 + _ENTRY.size * len(region_ids)
        data, fds, _, _ = socket.recv_fds(sock, want, len(region_ids))
        while len(data) < want and data[:4] == b"\0\0\0\0":
            more = sock.recv(want - len(data))
            if not more:
                break
            data += more
        if data[:4] != b"\0\0\0\0":
            raise AccessError(f"peer {peer!r} refused the segment request")
        if len(data) != want:
            raise ProtocolError(f"peer {peer!r} sent a short segment answer")
        out: dict[int, Mapping] = {}
        at = 0
        for i, rid in enumerate(region_ids):
            status, offset, size = _ENTRY.unpack_from(data, 4 + i * _ENTRY.size)
            if status == REFUSED:
                continue
            if status not in (OK_READ_WRITE, OK_READ_ONLY):
                raise ProtocolError(f"peer {peer!r} sent segment status {status}")
            if at >= len(fds):
                raise ProtocolError(f"peer {peer!r} sent fewer descriptors than segments")
            fd = fds[at]
            at += 1
            check_segment(fd, offset, size, peer)
            writable = status == OK_READ_WRITE
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapped = mmap.mmap(fd, offset + size, mmap.MAP_SHARED, prot)
            view = np.frombuffer(mapped, dtype=np.uint8)
            out[rid] = Mapping(mapped, view.ctypes.data + offset, size, writable)
            del view
        return out
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def check_segment(fd: int, offset: int, size: int, peer: str) -> None:
    """A descriptor from a peer may be mapped: a memfd sealed against
    shrinking (else the peer could truncate it and turn our next copy into
    SIGBUS) that holds the range the peer names."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        length = os.fstat(fd).st_size
    except OSError as exc:
        raise ProtocolError(f"peer {peer!r} sent a descriptor that is not a sealed segment ({exc})") from None
    if not seals & SEAL_SHRINK:
        raise ProtocolError(f"peer {peer!r} sent a segment that is not sealed against shrinking")
    if size <= 0 or offset + size > length:
        raise ProtocolError(f"peer {peer!r} names {size} bytes at {offset} in a segment of {length}")


def close_all(maps: dict[int, Any]) -> None:
    for m in maps.values():
        # BufferError: a view is still exported; the mapping goes with it.
        with contextlib.suppress(BufferError):
            m.mapped.close()
