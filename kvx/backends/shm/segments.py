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
(SEG_TOKEN, kvx/backends/control/wire.py) and presents it on the Unix socket, so only a
peer that passed the HMAC challenge gets descriptors, and only of regions
registered with remote access.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from kvx.backends.base import BackendContext
from kvx.backends.control.sock import recv_exact
from kvx.errors import AccessError, ConnectError, PeerLostError, ProtocolError, TimeoutError

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
MAX_TOKENS = 256
MAX_REGIONS_PER_REQUEST = 4096
# Per region in the answer: status (0 ok), offset in its segment, size; then one fd per ok region.
_ENTRY = struct.Struct("<IQQ")
_IO_TIMEOUT_S = 5.0


def socket_name(pid: int, epoch: int) -> str:
    return f"kvx-seg-{pid}-{epoch:016x}"


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
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvx-segments-{ctx.agent_name}", daemon=True
        )
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

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            try:
                conn.settimeout(_IO_TIMEOUT_S)
                self._serve(conn)
            except Exception as exc:  # one bad client must not stop the server
                logger.info("segment request refused: %s", exc)
            finally:
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        # One request at a time, so one deadline for all of it: a client that
        # trickles bytes cannot hold the server for more than _IO_TIMEOUT_S.
        deadline = time.monotonic() + _IO_TIMEOUT_S
        head = _recv(conn, TOKEN_BYTES + 4, deadline)
        token, count = head[:TOKEN_BYTES], struct.unpack("<I", head[TOKEN_BYTES:])[0]
        if count > MAX_REGIONS_PER_REQUEST:
            raise ProtocolError(f"{count} regions in one segment request")
        ids = np.frombuffer(_recv(conn, 4 * count, deadline), dtype="<u4")
        peer = self._redeem(token)
        if peer is None:
            conn.sendall(struct.pack("<I", 1))  # refused: no answer beyond that
            raise AccessError("a segment request presented an unknown or expired token")
        entries, fds = [], []
        for rid in ids.tolist():
            region = self.ctx.regions.get(rid)
            if region is None or region.segment_fd < 0 or not (region.remote_read or region.remote_write):
                entries.append(_ENTRY.pack(1, 0, 0))
                continue
            entries.append(_ENTRY.pack(0, region.segment_offset, region.size_bytes))
            fds.append(region.segment_fd)
        payload = struct.pack("<I", 0) + b"".join(entries)
        socket.send_fds(conn, [payload], fds)
        logger.debug("gave peer %s %d segment(s)", peer, len(fds))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        return bytes(recv_exact(sock, n, deadline))
    except (PeerLostError, TimeoutError) as exc:
        raise ProtocolError(f"segment request cut short: {exc}") from None


class Mapping:
    """A peer's segment, mapped here: where each region starts."""

    def __init__(self, mapped: mmap.mmap, base: int, size: int) -> None:
        self.mapped = mapped
        self.base = base
        self.size = size


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
            if status:
                continue
            if at >= len(fds):
                raise ProtocolError(f"peer {peer!r} sent fewer descriptors than segments")
            fd = fds[at]
            at += 1
            length = offset + size
            mapped = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = np.frombuffer(mapped, dtype=np.uint8)
            out[rid] = Mapping(mapped, view.ctypes.data + offset, size)
            del view
        return out
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def close_all(maps: dict[int, Any]) -> None:
    for m in maps.values():
        # BufferError: a view is still exported; the mapping goes with it.
        with contextlib.suppress(BufferError):
            m.mapped.close()
