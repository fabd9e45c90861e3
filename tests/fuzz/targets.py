"""The fuzz targets: each is a function of one input (bytes) that returns
when kvx behaved, and raises when it did not (``Finding`` for a broken
invariant; any other exception is a crash of the code under test).

- ``header``: the 32-byte header check (wire.py, sock.check_header) and the
  socket helpers that read headers and payloads (sock.recv_header,
  recv_exact, drain) on a stream that ends anywhere.
- ``handshake``: the serving side of the control connection
  (serve.InboundConnection) of a real ``kvx.Agent`` with an auth secret, fed
  through a socketpair: raw bytes, or a handshake whose every field may be
  wrong followed by a stream of requests. Checked: no internal error, the
  connection ends by itself, nothing but HELLO_REPLY and ERROR before
  AUTH_OK, AUTH_OK only for the right proof, no byte lands outside the
  remote-writable region, pins and leases are released, and a legitimate
  peer is still served.
- ``descs``: the one-pass descriptor check, C (``_cma.descs_bad``) against
  its Python twin and a plain-integer oracle, and ``memory.check_descs``
  (which of the two it uses follows KVX_NATIVE).
- ``protobuf``: decoding the handshake messages (Hello, HelloReply, Auth)
  and agent metadata from a peer: a message, or DecodeError (or, from the
  pure-Python decoder, UnicodeDecodeError), and a lossless round trip.

Inputs are read front to back by ``Bytes``; reads past the end give zeros,
and a zero always means "the valid choice", so that short inputs exercise
the deep, valid paths and each non-zero byte is a deviation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
from google.protobuf.message import DecodeError

import kvx
from kvx._datapath import cma_py
from kvx._datapath import io as _io
from kvx.agent import parse_metadata
from kvx.backends.control import wire as _wire
from kvx.backends.control.serve import InboundConnection
from kvx.backends.control.sock import check_header, drain, recv_exact, recv_header
from kvx.backends.control.wire import MsgType
from kvx.config import Limits, Timeouts, check_name
from kvx.descs import DESC_DTYPE
from kvx.errors import AccessError, ConfigError, PeerLostError, ProtocolError, VersionError
from kvx.memory import LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, VALID, check_descs
from kvx.v1 import handshake_pb2

try:
    from kvx._datapath import _cma
except ImportError:  # the twin alone is then checked against the oracle
    _cma = None  # type: ignore[assignment]

MAX_LEN = 4096  # the largest input the fuzzers generate (libFuzzer's -max_len)


class Finding(AssertionError):
    """kvx broke one of the invariants a target checks."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Finding(what)


class Bytes:
    """Reads a fuzz input front to back; past its end every read is zeros."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out.ljust(n, b"\0")

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes), "little")

    def odd(self, threshold: int) -> bool:
        """One byte >= threshold (of 256): a deviation from the valid choice."""
        return self.uint(1) >= threshold

    def text(self, n: int) -> str:
        return self.take(n).decode("utf-8", "replace")

    def left(self) -> int:
        return max(0, len(self.data) - self.pos)

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out


# Counters a runner prints, so that a run shows which paths it reached.
STATS: dict[str, int] = {}


def count(key: str) -> None:
    STATS[key] = STATS.get(key, 0) + 1


# (a) Header parsing.


def header(data: bytes) -> None:
    p = Bytes(data)
    mode = p.uint(1)
    raw = bytearray(p.take(32))
    if not mode & 1:  # mostly a real magic and version, so that the fields are reached
        raw[0:4] = _wire.MAGIC
        if not mode & 2:
            raw[4:6] = _wire.PROTOCOL_VERSION.to_bytes(2, "little")
    fields = (
        bytes(raw[0:4]),
        int.from_bytes(raw[4:6], "little"),
        int.from_bytes(raw[6:8], "little"),
        int.from_bytes(raw[8:16], "little"),
        int.from_bytes(raw[16:20], "little"),
        int.from_bytes(raw[20:24], "little"),
        int.from_bytes(raw[24:32], "little"),
    )
    check(_wire.unpack(raw) == fields, f"wire.unpack({bytes(raw)!r}) decodes {_wire.unpack(raw)}")
    try:
        got = check_header(raw)
    except ProtocolError as exc:
        check(fields[0] != _wire.MAGIC and "not a kvx message" in str(exc), f"ProtocolError for {raw!r}")
        count("header.bad_magic")
    except VersionError as exc:
        check(fields[0] == _wire.MAGIC and fields[1] != _wire.PROTOCOL_VERSION, f"VersionError for {raw!r}")
        check(f"version {fields[1]}" in str(exc), f"VersionError does not name the version: {exc}")
        count("header.bad_version")
    else:
        check(fields[0] == _wire.MAGIC and fields[1] == _wire.PROTOCOL_VERSION, f"accepted {raw!r}")
        check(got == fields[2:], f"check_header({raw!r}) returned {got}")
        check(_wire.pack(*got) == bytes(raw), "pack(check_header(h)) != h")
        count("header.ok")
    _stream(p)


def _stream(p: Bytes) -> None:
    """sock.recv_header/recv_exact/drain on a stream of ``sent`` bytes that
    then ends: whole reads, a clean close, or PeerLostError; nothing else."""
    op = p.uint(1) % 3
    want = p.uint(2) % 200
    sent = p.take(p.uint(1) % 160)
    a, b = socket.socketpair()
    try:
        a.sendall(sent)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5.0)
        if op == 0:
            try:
                got = recv_header(b, lambda: False)
            except PeerLostError:
                check(0 < len(sent) < 32, f"recv_header: PeerLostError after {len(sent)} bytes")
                return
            if got is None:
                check(not sent, f"recv_header: None after {len(sent)} bytes")
            else:
                check(bytes(got) == sent[:32], "recv_header returned other bytes than were sent")
        elif op == 1:
            try:
                got = recv_exact(b, want, time.monotonic() + 5.0)
            except PeerLostError:
                check(len(sent) < want, f"recv_exact({want}): PeerLostError after {len(sent)} bytes")
                return
            check(bytes(got) == sent[:want], "recv_exact returned other bytes than were sent")
        else:
            try:
                drain(b, want)
            except PeerLostError:
                check(len(sent) < want, f"drain({want}): PeerLostError after {len(sent)} bytes")
                return
            check(b.recv(1000) == sent[want:], "drain read more or less than asked")
    finally:
        a.close()
        b.close()


# (c) The descriptor check, differentially.

_SIZES = [0, 1, 7, 8, 24, 4096, 1 << 20, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def _near(p: Bytes, size: int) -> int:
    """A uint64 near the interesting edges of a region of ``size`` bytes."""
    k = p.uint(1)
    if k >= 224:
        return p.uint(8)
    base = (0, size, size - 1, size + 1, size // 2, (1 << 64) - 1, 1 << 63)[k % 7]
    return (base + (k >> 3) % 4 - 1) % (1 << 64) if k & 4 else base % (1 << 64)


def oracle(rows: list[tuple[int, int, int]], flags: list[int], sizes: list[int], need: int) -> int:
    """The first bad descriptor in plain integers: unknown region, missing
    flags, or a range not inside the region; -1 when all are good."""
    for i, (region, offset, length) in enumerate(rows):
        if region >= len(flags) or flags[region] & need != need:
            return i
        if offset > sizes[region] or length > sizes[region] - offset:
            return i
    return -1


def descs(data: bytes) -> None:
    p = Bytes(data)
    # The callers' contract: a table of at least one entry (RegionTable's has 64 or more)
    # and flag bits that fit in a byte.
    ntable = 1 + p.uint(1) % 8
    flags = [p.uint(1) for _ in range(ntable)]
    sizes = []
    for _ in range(ntable):
        k = p.uint(1)
        sizes.append(_SIZES[k % len(_SIZES)] if k < 200 else p.uint(8))
    need = p.uint(1)
    n = p.uint(1) % 40  # both sides of memory.SMALL_LIST
    raw = bytearray()
    rows = []
    for _ in range(n):
        k = p.uint(1)
        region = k % (ntable + 1) if k < 224 else p.uint(4)
        size = sizes[region] if region < ntable else 4096
        offset = _near(p, size)
        length = _near(p, (size - offset) % (1 << 64))
        rows.append((region, offset, length))
        raw += struct.pack("<I4sQQ", region, p.take(4), offset, length)  # padding: garbage
    array = np.frombuffer(bytes(raw), dtype=DESC_DTYPE) if n else np.zeros(0, DESC_DTYPE)
    flags_arr = np.array(flags, np.uint8)
    sizes_arr = np.array(sizes, np.uint64)
    want = oracle(rows, flags, sizes, need)
    twin = cma_py.descs_bad(array, flags_arr, sizes_arr, need)
    check(twin == want, f"cma_py.descs_bad says {twin}, the oracle {want}: {rows} {flags} {sizes} {need}")
    if _cma is not None:
        native = _cma.descs_bad(array, flags_arr, sizes_arr, need)
        check(
            native == want, f"_cma.descs_bad says {native}, the oracle {want}: {rows} {flags} {sizes} {need}"
        )
    count("descs.bad" if want >= 0 else "descs.good")
    # check_descs, as RegionTable.resolve calls it (need without VALID; it adds it).
    need_bits = need & (REMOTE_READ | REMOTE_WRITE | LOCAL_WRITE)
    bad = oracle(rows, flags, sizes, need_bits | VALID) >= 0
    try:
        check_descs(array, flags_arr, sizes_arr, need_bits, "fuzz")
    except AccessError as exc:
        check(bad, f"check_descs ({_io.IMPL}) refused good descriptors: {exc}: {rows} {flags} {sizes}")
    else:
        check(not bad, f"check_descs ({_io.IMPL}) let bad descriptors through: {rows} {flags} {sizes}")


# (d) Protobuf handshake messages.

_PEER_MESSAGES = (handshake_pb2.Hello, handshake_pb2.HelloReply, handshake_pb2.Auth)


def protobuf(data: bytes) -> None:
    for cls in _PEER_MESSAGES:
        try:
            msg = cls.FromString(data)
        except DecodeError:
            count(f"protobuf.{cls.__name__}.refused")
            continue
        except UnicodeDecodeError:  # the pure-Python decoder's word for bad UTF-8 in a string
            count(f"protobuf.{cls.__name__}.refused_utf8")
            continue
        wire = msg.SerializeToString(deterministic=True)
        again = cls.FromString(wire)
        check(again == msg, f"{cls.__name__} does not survive a round trip: {data!r}")
        check(again.SerializeToString(deterministic=True) == wire, f"{cls.__name__} re-encodes differently")
        count(f"protobuf.{cls.__name__}.decoded")
        if cls is handshake_pb2.Hello:
            with contextlib.suppress(ConfigError):  # what the target does with the name
                check_name(msg.name)
    try:
        parse_metadata(data)
        count("protobuf.metadata.decoded")
    except (ProtocolError, VersionError):
        count("protobuf.metadata.refused")


# (b) The handshake and the requests after it, as the serving side sees them.

SECRET = b"fuzz-cluster-secret-0123456789"
REGION_BYTES = 4096
GUARD_BYTES = 4096
_PATTERN = np.frombuffer(bytes(range(256)) * (3 * REGION_BYTES // 256), np.uint8)


class _ErrorLog(logging.Handler):
    """Keeps every ERROR kvx logs: an internal error serving a peer is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Target:
    """A real agent, with an auth secret and three regions: remote read and
    write between two guard areas, remote read only, and no remote access."""

    def __init__(self) -> None:
        log = logging.getLogger("kvx")
        log.setLevel(logging.ERROR)  # the refusals the fuzzer provokes are logged as warnings
        log.propagate = False
        self.errors = _ErrorLog()
        log.addHandler(self.errors)
        self.agent = kvx.Agent(
            "fuzz-target",
            auth_secret=SECRET,
            timeouts=Timeouts(connect_s=2.0, io_s=2.0, close_s=2.0),
            limits=Limits(
                max_message_bytes=64 * 1024,
                max_descs_per_message=64,
                max_notify_bytes=256,
                max_pending_notifications=4096,
            ),
        )
        self.pool = _PATTERN.copy()
        self.rw = self.agent.register(self.pool[GUARD_BYTES : GUARD_BYTES + REGION_BYTES])
        self.ro_buf = _PATTERN[:REGION_BYTES].copy()
        self.ro_buf.flags.writeable = False
        self.ro = self.agent.register(self.ro_buf)
        self.private = _PATTERN[:REGION_BYTES].copy()
        self.hidden = self.agent.register(self.private, remote_access=False)
        self.ids = [self.rw.id, self.ro.id, self.hidden.id, 0, 4, 1 << 20, (1 << 32) - 1]
        self.runs = 0

    def close(self) -> None:
        self.agent.close()

    # What must hold after every connection.

    def check_intact(self, authenticated: bool) -> None:
        if self.errors.records:
            raise Finding(f"kvx logged an error: {self._first_error()}")
        check(
            np.array_equal(self.pool[:GUARD_BYTES], _PATTERN[:GUARD_BYTES]), "bytes landed before the region"
        )
        check(
            np.array_equal(self.pool[GUARD_BYTES + REGION_BYTES :], _PATTERN[GUARD_BYTES + REGION_BYTES :]),
            "bytes landed after the region",
        )
        check(np.array_equal(self.ro_buf, _PATTERN[:REGION_BYTES]), "bytes landed in a read-only region")
        check(np.array_equal(self.private, _PATTERN[:REGION_BYTES]), "bytes landed in a private region")
        if not authenticated:
            check(np.array_equal(self.pool, _PATTERN), "an unauthenticated peer wrote into memory")
            check(not self.agent.notifications(), "an unauthenticated peer delivered a notification")
        self.agent.notifications()
        self.pool[:] = _PATTERN
        # Over loopback the serving thread may still be releasing them as we see it close.
        deadline = time.monotonic() + 10.0
        while self.agent._regions._active and time.monotonic() < deadline:
            time.sleep(0.001)
        active = self.agent._regions._active
        check(not active, f"pins or leases left after the connection ended: {active}")

    def _first_error(self) -> str:
        record = self.errors.records[0]
        return record.getMessage() + (
            "\n" + logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
        )

    # A connection.

    def open(self, loopback: bool = False) -> tuple[socket.socket, InboundConnection | None]:
        """A connection served by an InboundConnection of our own over a
        socketpair (fast), or (``loopback``) one the agent's listener
        accepts over TCP."""
        if loopback:
            host, port = self.agent.endpoint.rsplit(":", 1)
            return socket.create_connection((host, int(port)), timeout=5.0), None
        ours, theirs = socket.socketpair()
        ours.settimeout(5.0)
        theirs.settimeout(self.agent.timeouts.connect_s)
        conn = InboundConnection(self.agent._listener, theirs, "fuzz")
        conn.start()
        return ours, conn

    def finish(self, ours: socket.socket, conn: InboundConnection | None, rest: bytes = b"") -> bytes:
        """Send ``rest``, end our side, and collect what the agent sends until it closes."""
        received = bytearray()

        def reader() -> None:
            with contextlib.suppress(OSError):
                while chunk := ours.recv(1 << 16):
                    received.extend(chunk)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        with contextlib.suppress(OSError):  # the agent may close first
            ours.sendall(rest)
        with contextlib.suppress(OSError):
            ours.shutdown(socket.SHUT_WR)
        # connect_s bounds the handshake, io_s each wait after it; with our side ended
        # nothing should wait at all. Generous: the machine may be busy.
        if conn is not None:
            conn.thread.join(20.0)
            check(not conn.thread.is_alive(), "the agent still serves a connection whose peer ended 20 s ago")
        thread.join(20.0)
        check(not thread.is_alive(), "the agent did not close a connection it finished serving")
        ours.close()
        return bytes(received)

    def legitimate_read(self) -> None:
        """A peer that does everything right is served."""
        ours, conn = self.open()
        check(_authenticate(self, ours).ok is True, "a legitimate peer was refused")
        offset = self.runs % (REGION_BYTES - 64)
        request = struct.pack("<I4xQQ", self.rw.id, offset, 64)
        out = self.finish(ours, conn, _wire.pack(MsgType.READ_REQ, 1, len(request)) + request)
        messages = parse_stream(out)
        check(
            [m[0] for m in messages] == [MsgType.READ_RESP],
            f"a legitimate READ got {messages}",
        )
        expect = self.pool[GUARD_BYTES + offset : GUARD_BYTES + offset + 64].tobytes()
        check(messages[0][4] == expect, "a legitimate READ got other bytes than the region holds")
        self.check_intact(True)


def parse_stream(out: bytes) -> list[tuple[int, int, int, bytes, bytes]]:
    """What the agent sent: (type, request id, aux, payload, data) per message.
    Everything it sends must be well framed."""
    messages = []
    pos = 0
    while pos < len(out):
        check(len(out) - pos >= 32, f"the agent sent a cut header: {out[pos:]!r}")
        magic, version, msg_type, request_id, payload_len, aux, data_len = _wire.unpack(out[pos : pos + 32])
        check(magic == _wire.MAGIC and version == _wire.PROTOCOL_VERSION, "the agent sent a bad header")
        end = pos + 32 + payload_len + data_len
        check(end <= len(out), "the agent sent a message shorter than its header says")
        payload = out[pos + 32 : pos + 32 + payload_len]
        messages.append((msg_type, request_id, aux, payload, out[pos + 32 + payload_len : end]))
        pos = end
    return messages


def _read_one(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """One message from the agent: (type, aux, payload); None when it closed."""
    head = b""
    while len(head) < 32:
        chunk = sock.recv(32 - len(head))
        if not chunk:
            check(not head, "the agent closed in the middle of a header")
            return None
        head += chunk
    magic, version, msg_type, _, payload_len, aux, data_len = _wire.unpack(head)
    check(magic == _wire.MAGIC and version == _wire.PROTOCOL_VERSION, "the agent sent a bad header")
    check(payload_len <= _wire.MAX_ERROR_TEXT_BYTES and not data_len, "a handshake answer too large")
    body = b""
    while len(body) < payload_len:
        chunk = sock.recv(payload_len - len(body))
        check(bool(chunk), "the agent closed in the middle of a message")
        body += chunk
    return msg_type, aux, body


def _frame(
    p: Bytes | None, msg_type: int, payload: bytes, request_id: int = 0, aux: int = 0
) -> tuple[bytes, bool]:
    """A header for ``payload`` whose fields ``p`` may each spoil; (bytes, left intact)."""
    version, length, data_len = _wire.PROTOCOL_VERSION, len(payload), 0
    intact = True
    if p is not None and p.odd(224):
        intact = False
        which = p.uint(1) % 5
        if which == 0:
            msg_type = p.uint(2)
        elif which == 1:
            version = p.uint(2)
        elif which == 2:
            length = p.uint(4)
        elif which == 3:
            aux = p.uint(4)
        else:
            data_len = p.uint(8)
    head = _wire.HEADER.pack(_wire.MAGIC, version, msg_type, request_id, length, aux, data_len)
    return head + payload, intact


class Session:
    """How the initiator's side of a handshake went."""

    def __init__(self) -> None:
        self.ok: bool | None = None  # True: AUTH_OK; False: refused; None: left unfinished
        self.sent_proof = False  # an AUTH went out
        self.forged = False  # ... with a proof other than the right one


def _authenticate(target: Target, sock: socket.socket, p: Bytes | None = None) -> Session:
    """The initiator's side of the handshake, every field of which ``p`` may
    spoil. A spoiled frame is sent and the handshake left there (the agent
    would wait for bytes that never come, up to its deadline); otherwise the
    agent must answer at once, and AUTH_OK exactly when nothing was spoiled."""
    agent = target.agent
    session = Session()
    intact = True
    name, epoch = "fuzz-peer", 7
    target_name, target_epoch = agent.name, agent.epoch
    nonce = os.urandom(32)
    extra = b""
    if p is not None:
        if p.odd(240):
            name, intact = p.text(p.uint(1) % 80), False
        epoch = p.uint(8) or epoch
        if p.odd(240):
            target_name, intact = p.text(p.uint(1) % 40), False
        if p.odd(240):
            target_epoch, intact = p.uint(8), False
        if p.odd(240):
            nonce, intact = p.take(p.uint(1) % 64), False
        if p.odd(240):
            extra, intact = p.take(p.uint(1) % 32), False  # more fields, or garbage
    hello = handshake_pb2.Hello(
        name=name, epoch=epoch, target_name=target_name, target_epoch=target_epoch, nonce=nonce
    ).SerializeToString()
    frame, framed = _frame(p, MsgType.HELLO, hello + extra)
    with contextlib.suppress(OSError):
        sock.sendall(frame)
    if not framed:
        return session
    reply = _read_one(sock)
    if reply is None or reply[0] != MsgType.HELLO_REPLY:
        check(not intact, f"a valid HELLO got {reply}")
        if reply is not None:
            check(reply[0] == MsgType.ERROR, f"HELLO answered with message type {reply[0]}")
        count("handshake.hello_refused")
        session.ok = False
        return session
    seen = handshake_pb2.Hello.FromString(hello + extra)  # what the agent read, extra fields and all
    answer = handshake_pb2.HelloReply.FromString(reply[2])
    check(answer.auth_required, "the agent has a secret but does not require auth")
    ids = (seen.name, agent.name, seen.epoch, agent.epoch)
    check(
        answer.proof == _wire.target_proof(SECRET, seen.nonce, answer.nonce, *ids),
        "the agent's proof does not check out",
    )
    right = _wire.initiator_proof(SECRET, seen.nonce, answer.nonce, *ids)
    proof = right
    if p is not None and p.odd(232):
        proof = p.take(p.uint(1) % 48)
    session.sent_proof, session.forged = True, proof != right
    frame, framed = _frame(p, MsgType.AUTH, handshake_pb2.Auth(proof=proof).SerializeToString())
    with contextlib.suppress(OSError):
        sock.sendall(frame)
    if not framed:
        return session
    reply = _read_one(sock)
    if reply is None or reply[0] != MsgType.AUTH_OK:
        check(session.forged, f"a valid AUTH got {reply}")
        if reply is not None:
            check(reply[0] == MsgType.ERROR, f"AUTH answered with message type {reply[0]}")
        count("handshake.auth_refused")
        session.ok = False
        return session
    check(not session.forged, "AUTH_OK for a wrong proof")
    count("handshake.authenticated")
    session.ok = True
    return session


_TARGET: Target | None = None


def target() -> Target:
    global _TARGET
    if _TARGET is None:
        _TARGET = Target()
    return _TARGET


def handshake(data: bytes, loopback: bool = False) -> None:
    t = target()
    t.runs += 1
    p = Bytes(data)
    ours, conn = t.open(loopback)
    if p.uint(1) & 1:  # raw bytes
        session = Session()
        stream, expect = p.rest(), None
        count("handshake.raw")
    else:
        session = _authenticate(t, ours, p)
        stream, expect = _requests(t, p) if session.ok else (p.rest(), None)
    messages = parse_stream(t.finish(ours, conn, stream))
    types = [m[0] for m in messages]
    if session.ok and expect is not None:
        _check_answers(messages, expect)
    authenticated = bool(session.ok) or MsgType.AUTH_OK in types
    if not session.ok:
        # Before AUTH_OK (if any) only the handshake's answers; AUTH_OK only for the right proof.
        before = types[: types.index(MsgType.AUTH_OK)] if MsgType.AUTH_OK in types else types
        check(set(before) <= {MsgType.HELLO_REPLY, MsgType.ERROR}, f"served an unauthenticated peer: {types}")
        if MsgType.AUTH_OK in types:
            check(session.sent_proof and not session.forged, f"AUTH_OK without the right proof: {types}")
    t.check_intact(authenticated)
    if t.runs % 256 == 0:
        t.legitimate_read()


# Requests after a successful handshake.

_BAD_READ, _GOOD_READ, _BAD_WRITE, _GOOD_WRITE = range(4)


def _descs(t: Target, p: Bytes, n: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    raw = bytearray()
    rows = []
    for _ in range(n):
        k = p.uint(1)
        region = t.ids[k % 3] if k < 192 else t.ids[k % len(t.ids)]
        offset = _near(p, REGION_BYTES) if p.odd(128) else p.uint(1) * 8
        length = _near(p, REGION_BYTES - min(offset, REGION_BYTES)) if p.odd(128) else p.uint(1) + 1
        rows.append((region, offset, length))
        raw += struct.pack("<I4sQQ", region, p.take(4) if p.odd(240) else b"\0" * 4, offset, length)
    return bytes(raw), rows


def _inside(t: Target, rows: list[tuple[int, int, int]], writing: bool) -> bool:
    allowed = {t.rw.id} if writing else {t.rw.id, t.ro.id}
    return all(r in allowed and o <= REGION_BYTES and n <= REGION_BYTES - o for r, o, n in rows)


def _requests(t: Target, p: Bytes) -> tuple[bytes, dict[int, int] | None]:
    """A stream of requests built from the rest of the input; and, while
    every frame is left intact, what each request id must get."""
    out = bytearray()
    expect: dict[int, int] | None = {}
    request_id = 0
    while p.left() and len(out) < 256 * 1024:
        request_id += 1
        kind = p.uint(1) % 10
        if kind <= 2:  # READ_REQ
            body, rows = _descs(t, p, p.uint(1) % 20)
            frame, intact = _frame(p, MsgType.READ_REQ, body, request_id)
            good = _inside(t, rows, False) and sum(n for _, _, n in rows) <= 64 * 1024 and len(rows) <= 64
            verdict = _GOOD_READ if good else _BAD_READ
        elif kind <= 5:  # WRITE_REQ, with a notification at times
            body, rows = _descs(t, p, p.uint(1) % 20)
            note = p.take(p.uint(1) % 64) if p.odd(200) else b""
            total = sum(n for _, _, n in rows)
            frame, intact = _frame(p, MsgType.WRITE_REQ, body + note, request_id, aux=len(note))
            if total > 64 * 1024:
                frame += p.take(p.uint(2) % 512)  # refused before its data is read: a few bytes at most
                intact = False
            else:
                frame += bytes([0xA5]) * total
            good = _inside(t, rows, True) and len(rows) <= 64
            verdict = _GOOD_WRITE if good else _BAD_WRITE
        elif kind == 6:  # NOTIFY
            frame, intact = _frame(p, MsgType.NOTIFY, p.take(p.uint(1) % 64), request_id)
            verdict = -1
        elif kind == 7:  # SHM_PIN (read, write, IPC, keep), then maybe SHM_UNPIN / SHM_RELEASE
            ids = b"".join(struct.pack("<I", t.ids[p.uint(1) % len(t.ids)]) for _ in range(p.uint(1) % 4))
            frame, intact = _frame(p, MsgType.SHM_PIN, ids, request_id, aux=p.uint(1) % 16)
            if p.odd(128):
                unpin = MsgType.SHM_UNPIN if p.odd(128) else MsgType.SHM_RELEASE
                frame += _wire.pack(unpin, request_id if p.odd(64) else t.ids[p.uint(1) % 3])
            verdict = -1
        elif kind == 8:  # VERIFY, SEG_TOKEN, a backend's type, or any type
            msg_type = (MsgType.VERIFY, MsgType.SEG_TOKEN, 64 + p.uint(1) % 64, p.uint(2))[p.uint(1) % 4]
            if msg_type in (MsgType.READ_REQ, MsgType.WRITE_REQ):  # those are built above, checked
                msg_type = 0
            frame, intact = _frame(p, msg_type, p.take(p.uint(1) % 40), request_id, aux=p.uint(1) % 4)
            verdict = -1
        else:  # raw bytes: the framing is anyone's guess from here
            frame, intact, verdict = p.take(p.uint(1)), False, -1
        out += frame
        if not intact:
            expect = None
        if expect is not None and verdict >= 0:
            expect[request_id] = verdict
    return bytes(out), expect


def _check_answers(messages: list[tuple[int, int, int, bytes, bytes]], expect: dict[int, int]) -> None:
    """With the framing intact, each READ and WRITE got the answer its
    descriptors call for: data only for reads inside readable regions, an
    acknowledgement only for writes inside the writable one."""
    for msg_type, request_id, _, _, _ in messages:
        verdict = expect.get(request_id)
        if msg_type == MsgType.READ_RESP:
            check(verdict == _GOOD_READ, f"READ_RESP to request {request_id}, which was {verdict}")
            count("handshake.read_served")
        elif msg_type == MsgType.WRITE_RESP:
            check(verdict == _GOOD_WRITE, f"WRITE_RESP to request {request_id}, which was {verdict}")
            count("handshake.write_served")
        elif msg_type == MsgType.ERROR and verdict in (_BAD_READ, _BAD_WRITE):
            count("handshake.request_refused")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "header": header,
    "handshake": handshake,
    "descs": descs,
    "protobuf": protobuf,
}


def seeds(name: str) -> list[bytes]:
    """Starting inputs: one that takes each target's deepest valid path, and a few more."""
    if name == "header":
        return [b"\0" * 40, b"\1" + _wire.pack(MsgType.READ_REQ, 1, 24) + b"\0\3\x20", b"\2" * 36]
    if name == "descs":
        return [bytes(64), bytes([3, 7, 2, 6, 0, 4, 5, 6, 20]) + bytes(range(200))]
    if name == "protobuf":
        hello = handshake_pb2.Hello(name="a", epoch=1, target_name="b", target_epoch=2, nonce=b"n" * 32)
        return [hello.SerializeToString(), handshake_pb2.Auth(proof=b"p" * 32).SerializeToString(), b""]
    if name == "handshake":
        return [
            b"\0" * 16,  # a valid handshake, nothing after
            b"\0" * 8 + bytes([0, 3, 0, 0, 0, 2]) + b"\0" * 20,  # then READ_REQs
            b"\0" * 8 + bytes([3, 2]) + b"\0" * 40,  # then WRITE_REQs
            b"\1" + _wire.pack(MsgType.HELLO, payload_len=4) + b"junk",
        ]
    raise KeyError(name)
