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

The same socket (the agent's local socket, started whenever it offers shm)
also tells a same-host initiator which connections the agent serves: the
kernel names the process listening on it (SO_PEERCRED), and that process's
answer ties the initiator's connection to it (``prove`` in __init__.py).
Requests start with a kind byte: KIND_SEGMENTS or KIND_SERVES.

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
from kvx.errors import AccessError, ConnectError, LimitError, PeerLostError, ProtocolError, TimeoutError
from kvx.memory import REMOTE_READ, Region

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
MAX_TOKENS = 256
# The kernel passes at most 253 descriptors (SCM_MAX_FD) in one message.
MAX_REGIONS_PER_REQUEST = 253
# Request kinds: the first byte of a request on the local socket.
KIND_SEGMENTS = b"S"  # then a token, a count and region ids: their segments' descriptors
KIND_SERVES = b"O"  # then a count and socket inodes: which of them this agent serves
MAX_INODES_PER_REQUEST = 64
_MAX_REQUEST_BYTES = 1 + TOKEN_BYTES + 4 + 4 * MAX_REGIONS_PER_REQUEST
# Per region in the answer: status (0 ok), offset in its segment, size; then one fd per ok region.
_ENTRY = struct.Struct("<IQQ")
_IO_TIMEOUT_S = 5.0
# Writing an answer (it fits the socket's buffer, so this is never reached by an honest client).
_SEND_TIMEOUT_S = 1.0
# Connections let in per turn of the loop (fewer than MAX_CLIENTS / 2: one
# let in is served the next turn, before newer ones can push it out), and
# waiting to be let in.
_ACCEPTS_PER_TURN = 16
_BACKLOG = 512
_WARN_EVERY_S = 10.0


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
        self._sock.listen(_BACKLOG)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._clients: dict[socket.socket, _Client] = {}  # insertion order: oldest first
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._dropped = 0
        self._warned_at = -_WARN_EVERY_S
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
            events = self._selector.select(timeout)
            # Clients whose request came in are served before newcomers are
            # let in: a burst of connections cannot push out a waiting request.
            for key, _ in events:
                if key.fileobj == self._wake_r:
                    return
                if key.fileobj is not self._sock:
                    self._readable(key.data)
            if any(key.fileobj is self._sock for key, _ in events):
                self._accept()
            now = time.monotonic()
            for client in [c for c in self._clients.values() if c.deadline <= now]:
                logger.info("segment request refused: not complete within %.0f s", _IO_TIMEOUT_S)
                self._drop(client)

    def _accept(self) -> None:
        # A few at a time: the loop serves what came in before it lets more in.
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the listener stays up
                logger.warning("segment socket accept failed: %s", exc)
                return
            if len(self._clients) >= MAX_CLIENTS:
                # The oldest: an honest client is served the turn after it is let
                # in, long before MAX_CLIENTS newer ones (a few per turn) push it out.
                self._dropped += 1
                now = time.monotonic()
                if now - self._warned_at >= _WARN_EVERY_S:  # a flood must not flood the log too
                    logger.warning(
                        "%d local-socket clients at once: dropped the oldest, %d times since the last warning",
                        MAX_CLIENTS,
                        self._dropped,
                    )
                    self._warned_at, self._dropped = now, 0
                self._drop(next(iter(self._clients.values())))
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
            more = client.sock.recv(_MAX_REQUEST_BYTES - len(client.data))
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
        kind = bytes(data[:1])
        if kind == KIND_SERVES:
            return self._serve_inodes(client)
        if kind != KIND_SEGMENTS:
            raise ProtocolError(f"unknown request kind {kind!r} on the local socket")
        head = 1 + TOKEN_BYTES + 4
        if len(data) < head:
            return False
        token, count = bytes(data[1 : 1 + TOKEN_BYTES]), struct.unpack_from("<I", data, 1 + TOKEN_BYTES)[0]
        if count > MAX_REGIONS_PER_REQUEST:
            raise ProtocolError(f"{count} regions in one segment request; at most {MAX_REGIONS_PER_REQUEST}")
        if len(data) < head + 4 * count:
            return False
        if len(data) > head + 4 * count:
            raise ProtocolError("bytes after a segment request")
        ids = np.frombuffer(data, dtype="<u4", count=count, offset=head)
        client.sock.settimeout(_SEND_TIMEOUT_S)  # the answer fits the socket's buffer
        peer = self._redeem(token)
        if peer is None:
            client.sock.sendall(struct.pack("<I", 1))  # refused: no answer beyond that
            raise AccessError("a segment request presented an unknown or expired token")
        entries, fds, opened, pins = [], [], [], []
        table = self.ctx.regions
        try:
            for rid in ids.tolist():
                region = table.get(rid)
                try:
                    # Pinned while its descriptor is sent: a deregistration waits.
                    pins.append(table.pin_regions(np.array([rid]), REMOTE_READ, "segment request")[2])
                except AccessError:
                    region = None
                status, fd = self._hand_out(region)
                if fd < 0:
                    entries.append(_ENTRY.pack(REFUSED, 0, 0))
                    continue
                assert region is not None
                if fd != region.segment_fd:
                    opened.append(fd)
                entries.append(_ENTRY.pack(status, 0, region.size_bytes))
                fds.append(fd)
            socket.send_fds(client.sock, [struct.pack("<I", 0) + b"".join(entries)], fds)
        finally:
            for fd in opened:
                os.close(fd)
            for token_ in pins:
                table.release(token_)
        logger.debug("gave peer %s %d segment(s)", peer, len(fds))
        return True

    def _serve_inodes(self, client: _Client) -> bool:
        """KIND_SERVES: one byte per socket inode, 1 when it is one of the
        authenticated connections this agent serves. The asker learned this
        process's pid from the kernel (SO_PEERCRED), so the answer ties its
        connection to this process; nothing secret is told."""
        data = client.data
        if len(data) < 5:
            return False
        count = struct.unpack_from("<I", data, 1)[0]
        if not 0 < count <= MAX_INODES_PER_REQUEST:
            raise ProtocolError(f"{count} inodes in one request; 1 to {MAX_INODES_PER_REQUEST}")
        if len(data) < 5 + 8 * count:
            return False
        if len(data) > 5 + 8 * count:
            raise ProtocolError("bytes after an inode request")
        inodes = np.frombuffer(data, dtype="<u8", count=count, offset=5).tolist()
        client.sock.settimeout(_SEND_TIMEOUT_S)
        client.sock.sendall(bytes(int(self.ctx.serves(i)) for i in inodes))
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


def _connect(name: str, peer: str, deadline: float) -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect("\0" + name)
            return sock
        except BlockingIOError:  # its backlog is full (a flood of connections): again, until the deadline
            sock.close()
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"peer {peer!r}'s local socket @{name} took no connection in time"
                ) from None
            time.sleep(0.0005)
        except OSError as exc:
            sock.close()
            raise ConnectError(
                f"cannot reach peer {peer!r}'s local socket @{name}: {exc} (another network namespace?)"
            ) from None


def _recv_within(sock: socket.socket, want: int, deadline: float, data: bytes = b"") -> bytes:
    """Bytes until ``want`` are in, the peer closes, or the deadline passes."""
    while len(data) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer on the local socket within {_IO_TIMEOUT_S} s")
        sock.settimeout(left)
        more = sock.recv(want - len(data))
        if not more:
            break
        data += more
    return data


def serves(name: str, pid: int, inodes: list[int], peer: str) -> str | None:
    """None when the process ``pid`` listens on the local socket ``name``
    (the kernel says so: SO_PEERCRED holds the credentials of the process
    that called listen(), which no descriptor passing changes) and says it
    serves every connection in ``inodes``; else why not."""
    deadline = time.monotonic() + _IO_TIMEOUT_S
    try:
        sock = _connect(name, peer, deadline)
    except ConnectError as exc:
        return str(exc)
    try:
        listener_pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if listener_pid != pid:
            return f"the local socket @{name} belongs to pid {listener_pid}, not {pid}: the metadata names another process"
        sock.sendall(KIND_SERVES + struct.pack("<I", len(inodes)) + np.asarray(inodes, "<u8").tobytes())
        answer = _recv_within(sock, len(inodes), deadline)
    except (OSError, TimeoutError) as exc:
        return f"pid {pid} did not answer on its local socket: {exc}"
    finally:
        sock.close()
    if answer != b"\1" * len(inodes):
        return f"pid {pid} does not serve this connection: the metadata names another process"
    return None


def fetch(name: str, token: bytes, region_ids: list[int], peer: str) -> dict[int, Mapping]:
    """The initiator's side: map the segments of ``region_ids`` (those the
    target has; the others are left out). One deadline for all of it."""
    if not region_ids:
        return {}
    if len(region_ids) > MAX_REGIONS_PER_REQUEST:
        raise LimitError(f"{len(region_ids)} segments in one request; at most {MAX_REGIONS_PER_REQUEST}")
    deadline = time.monotonic() + _IO_TIMEOUT_S
    sock = _connect(name, peer, deadline)
    fds: list[int] = []
    try:
        sock.sendall(
            KIND_SEGMENTS
            + token
            + struct.pack("<I", len(region_ids))
            + np.asarray(region_ids, "<u4").tobytes()
        )
        want = 4 + _ENTRY.size * len(region_ids)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data, fds, _, _ = socket.recv_fds(sock, want, len(region_ids))
        # Descriptors from a peer are checked at once and let go of when they
        # are not sealed segments: kvx holds no other file of another process.
        kept: list[int] = []
        for fd in fds:
            try:
                ok = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEAL_SHRINK)
            except OSError:
                ok = False
            if ok:
                kept.append(fd)
            else:
                os.close(fd)
        dropped, fds = len(fds) - len(kept), kept
        if dropped or data[:4] != b"\0\0\0\0":
            raise AccessError(f"peer {peer!r} refused the segment request")
        data = _recv_within(sock, want, deadline, data)
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
    except TimeoutError as exc:
        raise ProtocolError(f"peer {peer!r}: {exc}") from None
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
