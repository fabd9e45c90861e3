"""The wire format of the control connection (and of the tcp backend's bytes).

Every message is a fixed 32-byte little-endian header, then ``payload_len``
bytes of payload (descriptors, a protobuf handshake message, a notification,
an error text), then ``data_len`` raw bytes that go straight to or from
registered memory::

    magic     4s   b"KVXF"
    version   u16  PROTOCOL_VERSION
    type      u16  MsgType
    request   u64  request id, echoed in the response
    payload   u32  payload length
    aux       u32  per type: notification length (WRITE_REQ), ErrorCode (ERROR)
    data      u64  raw data length

Descriptor payloads are arrays of kvx.descs.DESC_DTYPE (24 bytes each).

Protocol version history:
    1  first version: HELLO/HELLO_REPLY/AUTH handshake with HMAC-SHA256,
       READ, WRITE, NOTIFY; SHM_PIN/SHM_PIN_OK/SHM_UNPIN for same-host
       peers, sent only to an agent whose metadata offers shm.
    2  PROBE/PROBE_OK: before a same-host initiator attaches to the process
       a peer's metadata names, it proves that process is the one that
       answered the handshake (a forged pid could otherwise send its
       copies into any process it may attach to).
    3  Leases: SHM_PIN with aux bit 8 (PIN_KEEP) keeps its pins after the
       transfer; SHM_REVOKE and SHM_RELEASE end them.
    4  PROBE/PROBE_OK (types 17 and 18) removed: a peer that could get the
       nonce into a third process by other means passed it. A same-host
       initiator now learns from the kernel the inode of its connection's
       far end (/proc/PID/net/tcp) and the pid listening on the peer's local
       socket (SO_PEERCRED), and asks that process whether it serves the
       connection. Requests on the local socket start with a kind byte ("S"
       segments, "O" which connections it serves); segment answers say per
       region whether its descriptor is read-only (status 2), at most 253
       regions a request, and the segments are sealed against resizing.
       VERIFY/VERIFY_OK: end-to-end checksums of a transfer (verify=True).
    5  SHM_PIN may lease CUDA IPC handles (PIN_IPC with PIN_KEEP): a
       same-host GPU copy then needs no round trip. A version 4 target
       closes the connection on that combination, hence the new version
       (versions must match: agents of 4 and 5 do not talk at all).

The shm backend uses the same authenticated connection for control only:
SHM_PIN (aux: 1 read, 2 write) carries the uint32 ids of the regions a
transfer touches; the target checks that each exists and allows the access,
pins them and answers SHM_PIN_OK with (uint64 base address, uint64 size) per
region; the initiator checks every descriptor against those sizes, moves the
bytes itself (process_vm_readv/writev) and sends SHM_UNPIN with the pin's
request id (no answer). A connection that ends releases its pins.

So that a same-host copy needs no round trip, the initiator asks for pins
that outlive the transfer: SHM_PIN with aux bit 8 (PIN_KEEP) added. The
target then holds one pin per region (a lease) for the connection, answers
as above, and expects no SHM_UNPIN; the initiator keeps the (base, size)
pairs and copies later transfers on those regions at once, checking every
descriptor against them as before. When a region is deregistered the target
sends SHM_REVOKE (request id: the region id; nothing else) on each
connection that leases it; the initiator forgets the lease, waits for its
copies that use it to end, and answers SHM_RELEASE (request id: the region
id), after which the target lets the region go. Deregistration waits for
that answer like it waits for a transfer in flight; a connection that ends
releases its leases.

The cuda_ipc backend pins the same way, with aux bit 4 (PIN_IPC) added: the
answer then carries, after the (base, size) pairs, per region its uint64
offset inside its CUDA allocation and that allocation's 64-byte
cudaIpcMemHandle. The initiator opens each handle once, caches the mapping
for the life of the connection to that epoch, and copies with its own GPU.
Its pins are leases (PIN_IPC with PIN_KEEP), revoked and released as above:
the handle and offset are kept with the lease's (base, size) pair, and later
copies on those regions check their descriptors against the leased size and
start at once, with no message to the target.

The rdma backend (kvx/backends/rdma) pins the same way, leases included,
with aux bit 16 (PIN_RDMA) added: the answer then carries, after the (base,
size) pairs, per region the uint64 key of its memory registration with the
target's rdma endpoint, and the initiator's NIC reads or writes the ranges
itself (one-sided). Keys travel only over the authenticated connection,
never in the metadata; the target closes a region's registration when it
is deregistered, after its pins and leases ended. Its connect exchange is
RDMA_CONNECT, answered by RDMA_CONNECT_OK: each carries a version byte, a
flags byte (answer bit 1: the target registers its GPU memory with its
NIC), a uint16 length and that many bytes (at most 1024) of the endpoint's
connection info; once per connection, no data. Both are sent only to an
agent whose metadata offers an rdma endpoint.

On software providers closing a registration does not stop an access a
peer already started, so the target resets that rail's endpoint when it
deregisters a region whose key it handed out (and an initiator resets its
own after a post timed out): the endpoint gets a new address and every
fabric connection to it is gone. The target then sends RDMA_RESET (request
id 0, aux: the index of the initiator's rail pair, no payload, no data) on
each connection that completed RDMA_CONNECT; the initiator answers nothing
and connects that pair again (RDMA_CONNECT with the reconnect flag) before
its next post on it. A malformed RDMA_RESET ends the connection.

Where cross-memory attach is refused, the shm backend maps the target's
shared segments (kvx/backends/shm/segments.py) instead: SEG_TOKEN (no payload) asks for a
single-use token, SEG_TOKEN_OK carries it (32 bytes), and the initiator
presents it on the target's Unix socket to receive the segments' file
descriptors. Sent only to an agent whose metadata names a segment socket.

Before it attaches (cross-memory attach, or CUDA IPC within one process), a
same-host initiator checks that the process the metadata names serves each
of its connections to the peer: the kernel gives the pid listening on the
peer's local socket (SO_PEERCRED) and each connection's far-end inode, and
that process answers for the inodes (kvx/backends/shm/__init__.py,
``prove``). The pin answers are trusted only as the sender's own memory.

A transfer posted with ``verify=True`` ends, once its bytes have moved and
before its notification, with VERIFY: aux is the notification's length, the
payload is the transfer's remote descriptors (n x 24 bytes, as the caller
gave them), then one uint32 CRC-32C per descriptor of the bytes on the
initiator's side (what landed for a READ, what was sent for a WRITE), then
the notification. The target checks the descriptors as for a read, computes
the same checksums over its memory, and answers VERIFY_OK (delivering the
notification) when all match, else an ERROR with code INTEGRITY that names
the first descriptor that differs (the notification is not delivered).

Types 64 to 127 (BACKEND_TYPES) are left to backends for their own control
requests (say, exchanging queue pairs); kvx's own types stay below 64. A
target that serves no handler for a type ends the connection with a
PROTOCOL error, so a backend sends its types only to peers whose metadata
offers it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct

PROTOCOL_VERSION = 5
MAGIC = b"KVXF"
HEADER = struct.Struct("<4sHHQIIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32

# Bounds on payloads that are not descriptor lists.
MAX_HANDSHAKE_BYTES = 4096
MAX_ERROR_TEXT_BYTES = 4096
NONCE_BYTES = 32
# SHM_PIN_OK: 16 bytes per region; a transfer names a few.
# Per region: base and size, plus (PIN_IPC) offset and handle.
PIN_REPLY_BYTES = 16
PIN_IPC_REPLY_BYTES = 16 + 8 + 64
PIN_RDMA_REPLY_BYTES = 16 + 8  # per rail of the target's: 8 more (at most 16 rails)
MAX_PIN_REPLY_BYTES = max(PIN_IPC_REPLY_BYTES, 16 + 8 * 16) * 65536


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_REPLY = 2
    AUTH = 3
    AUTH_OK = 4
    ERROR = 5
    READ_REQ = 6
    READ_RESP = 7
    WRITE_REQ = 8
    WRITE_RESP = 9
    NOTIFY = 10
    NOTIFY_ACK = 11
    SHM_PIN = 12
    SHM_PIN_OK = 13
    SHM_UNPIN = 14
    SEG_TOKEN = 15
    SEG_TOKEN_OK = 16
    # 17, 18: PROBE, PROBE_OK (versions 2 and 3); never reuse them.
    SHM_REVOKE = 19
    SHM_RELEASE = 20
    VERIFY = 21
    VERIFY_OK = 22
    RDMA_CONNECT = 23
    RDMA_CONNECT_OK = 24
    RDMA_RESET = 25


# Message types a backend may define for its own control requests (sent with
# Link.request, served through Backend.handlers); kvx's own stay below.
BACKEND_TYPES = range(64, 128)

# SHM_PIN aux values.
PIN_READ = 1
PIN_WRITE = 2
PIN_IPC = 4  # or'd with one of the two: answer with CUDA IPC handles too
PIN_KEEP = 8  # or'd with one of the two: the pins are leases, kept until revoked
PIN_RDMA = 16  # or'd with one of the two: answer with the regions' rdma keys too


def pin_extra_words(aux: int, rails: int = 1) -> int:
    """uint64 words per region that an SHM_PIN_OK adds after the (base, size)
    pairs, for a pin asked with ``aux``: a CUDA IPC offset and handle, an
    rdma key per rail of the target's, or nothing."""
    if aux & PIN_IPC:
        return (PIN_IPC_REPLY_BYTES - 16) // 8
    return rails if aux & PIN_RDMA else 0


class ErrorCode(enum.IntEnum):
    UNSPECIFIED = 0
    ACCESS = 1
    LIMIT = 2
    PROTOCOL = 3
    VERSION = 4
    EPOCH = 5
    AUTH = 6
    INTERNAL = 7
    INTEGRITY = 8


def pack(msg_type: int, request_id: int = 0, payload_len: int = 0, aux: int = 0, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, request_id, payload_len, aux, data_len)


def unpack(header: bytes | bytearray | memoryview) -> tuple[bytes, int, int, int, int, int, int]:
    """(magic, version, type, request id, payload len, aux, data len); no checks."""
    return HEADER.unpack(header)


def _transcript(
    label: bytes,
    first: bytes,
    second: bytes,
    initiator: str,
    target: str,
    initiator_epoch: int,
    target_epoch: int,
) -> bytes:
    # Every field length-prefixed: no two different transcripts encode alike.
    fields = [
        label,
        first,
        second,
        initiator.encode(),
        target.encode(),
        initiator_epoch.to_bytes(8, "little"),
        target_epoch.to_bytes(8, "little"),
        PROTOCOL_VERSION.to_bytes(2, "little"),
    ]
    return b"".join(len(f).to_bytes(4, "little") + f for f in fields)


def target_proof(
    secret: bytes,
    initiator_nonce: bytes,
    target_nonce: bytes,
    initiator: str,
    target: str,
    initiator_epoch: int,
    target_epoch: int,
) -> bytes:
    """The target's answer to the initiator's challenge."""
    msg = _transcript(
        b"kvx-target", initiator_nonce, target_nonce, initiator, target, initiator_epoch, target_epoch
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def initiator_proof(
    secret: bytes,
    initiator_nonce: bytes,
    target_nonce: bytes,
    initiator: str,
    target: str,
    initiator_epoch: int,
    target_epoch: int,
) -> bytes:
    """The initiator's answer to the target's challenge."""
    msg = _transcript(
        b"kvx-initiator", target_nonce, initiator_nonce, initiator, target, initiator_epoch, target_epoch
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()
