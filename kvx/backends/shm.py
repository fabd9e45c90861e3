"""The shm backend: same-host peers, host memory, no copy through a socket.

The initiator moves the bytes itself with cross-memory attach
(``process_vm_readv``/``process_vm_writev``, batched in C: kvx/_io.py), from
or into the target process's registered memory. The tcp connection to the
peer stays, for control only: it authenticates the peer (HMAC challenge,
epoch), and before each copy the target checks the remote descriptors
against its region table and pins them (``SHM_PIN``), exactly as it checks a
tcp READ or WRITE, so that a peer still touches only what was registered, and
``deregister`` waits until no copy can touch the region. See kvx/_wire.py.

Whether cross-memory attach is allowed between two processes is the
kernel's call (same user, Yama ``ptrace_scope``, capabilities, seccomp, pid
namespaces). ``probe`` finds out before a peer is bound to this backend, by
reading 8 bytes the target published for it, and says why not when not.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx import _io, _staging, _wire
from kvx._wire import MsgType
from kvx.backends.tcp import TcpChannel, _Part
from kvx.memory import VALID, check_descs
from kvx.errors import AccessError, KvxError, PeerLostError, ProtocolError, TransferError
from kvx.transfer import Op, Transfer

if TYPE_CHECKING:
    from kvx.v1 import agent_pb2

logger = logging.getLogger(__name__)

PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# Connections (each with its reader thread, which copies) to a peer on shm: a
# large transfer is copied in this many parts at once, so that one part's fixed
# costs (the pin round trip, the Python around it) overlap another's copy.
# Measured with `kvx bench` (benchmarks/RESULTS.md): 2 lanes reach the
# process_vm_readv limit, 1 lane about 83% of it.
LANES = 2
# A transfer is cut into requests of at most this many bytes only to spread it
# over several streams; the bytes themselves never pass through a message.
_NO_BYTE_LIMIT = 1 << 62


class ShmChannel(TcpChannel):
    """Control over the tcp connections; host bytes through cross-memory
    attach and, with ``ipc``, CUDA bytes between GPUs through CUDA IPC.
    Anything else (host and CUDA memory on either side) is staged over the
    connections, as over tcp."""

    def __init__(self, *args: Any, pid: int, ipc: bool = False, cma: bool = True,
                 segment_maps: dict[int, Any] | None = None) -> None:
        super().__init__(*args)
        self.pid = pid
        self.ipc = ipc
        self.cma = cma
        # Without cross-memory attach: the peer's shared segments, mapped here (kvx/segments.py).
        self.segment_maps = segment_maps or {}
        self._segment_ids = np.array(sorted(self.segment_maps), dtype=np.int64)
        self._ipc_maps: dict[int, Any] = {}  # local device -> kvx.gpu.IpcMap
        # Mappings close when the last reader (the threads that copy) has ended.
        self._readers_left = len(self.conns)
        self._maps_lock = threading.Lock()
        for conn in self.conns:
            conn.on_closed = self._reader_ended

    def post(self, transfer: Transfer, op: Op, local_addrs: Any, local_lens: Any, total: int,
             remote: np.ndarray, notify: bytes | None, local_device: int = -1, remote_device: int = -1,
             remote_ipc: bool = False) -> None:
        if local_device < 0 and remote_device < 0 and self.cma:
            move = _io.vm_writev if op is Op.WRITE else _io.vm_readv
            self._pinned(transfer, op, local_addrs, local_lens, total, remote, notify, 0,
                         lambda addrs, lens, wire, regions: _Copy(move, self.pid, self.peer, addrs, lens, wire,
                                                                  regions))
        elif local_device < 0 and remote_device < 0 and self._in_segments(remote):
            maps = self.segment_maps
            self._pinned(transfer, op, local_addrs, local_lens, total, remote, notify, 0,
                         lambda addrs, lens, wire, regions: _SegmentCopy(op, maps, self.peer, addrs, lens, wire,
                                                                         regions))
        elif self.ipc and local_device >= 0 and remote_device >= 0 and remote_ipc:
            ipc_map = self._ipc_map(local_device)
            self._pinned(transfer, op, local_addrs, local_lens, total, remote, notify, _wire.PIN_IPC,
                         lambda addrs, lens, wire, regions: _IpcCopy(op, local_device, ipc_map, self.pid, self.peer,
                                                                     addrs, lens, wire, regions))
        else:
            super().post(transfer, op, local_addrs, local_lens, total, remote, notify, local_device, remote_device)

    def _pinned(self, transfer: Transfer, op: Op, local_addrs: Any, local_lens: Any, total: int,
                remote: np.ndarray, notify: bytes | None, flags: int, make_copy: Any) -> None:
        parts = self.split(local_addrs, local_lens, total, remote, _NO_BYTE_LIMIT)
        if notify is not None:  # after every byte has landed, as over tcp
            transfer._on_parts_done = lambda t: self.notify(t, notify)
        transfer._parts_left = len(parts)
        aux = (_wire.PIN_WRITE if op is Op.WRITE else _wire.PIN_READ) | flags
        for wire, addrs, lens, nbytes in parts:
            conn = self._conn()
            request_id = next(conn.ids)
            ids = wire["region"]
            regions = (ids[:1] if (ids == ids[0]).all() else np.unique(ids)).astype("<u4")
            payload = regions.tobytes()
            part = _Part(transfer, MsgType.SHM_PIN, addrs, lens, nbytes)
            part.copy = make_copy(addrs, lens, wire, regions)
            prefix = _wire.pack(MsgType.SHM_PIN, request_id, payload_len=len(payload), aux=aux) + payload
            conn.submit(part, prefix, request_id)

    def _in_segments(self, remote: np.ndarray) -> bool:
        if not len(self._segment_ids):
            return False
        ids = remote["region"]
        return bool(np.isin(ids, self._segment_ids).all())

    def _ipc_map(self, device: int) -> Any:
        with self._maps_lock:
            found = self._ipc_maps.get(device)
            if found is None:
                from kvx import gpu

                found = self._ipc_maps[device] = gpu.IpcMap(device)
            return found

    def _reader_ended(self, conn: Any) -> None:
        """A connection's reader has ended; after the last one no copy can run."""
        with self._maps_lock:
            self._readers_left -= 1
            if self._readers_left:
                return
            ipc_maps, self._ipc_maps = list(self._ipc_maps.values()), {}
        for ipc_map in ipc_maps:
            try:
                ipc_map.close()
            except Exception:  # noqa: BLE001 - a reader thread must end cleanly
                logger.exception("closing CUDA IPC mappings of peer %s failed", self.peer)
        if self.segment_maps:
            from kvx import segments

            segments.close_all(self.segment_maps)


class _SegmentCopy:
    """Moves one part's bytes through the peer's shared segments, mapped here,
    once the target has pinned its regions."""

    __slots__ = ("op", "maps", "peer", "addrs", "lens", "remote", "regions")

    def __init__(self, op: Op, maps: dict[int, Any], peer: str, addrs: Any, lens: Any, remote: np.ndarray,
                 regions: np.ndarray) -> None:
        self.op = op
        self.maps = maps
        self.peer = peer
        self.addrs = addrs
        self.lens = lens
        self.remote = remote
        self.regions = regions

    def __call__(self, pinned: np.ndarray) -> None:
        n = len(self.regions)
        if len(pinned) != 2 * n:
            raise ProtocolError(f"peer {self.peer!r} pinned {len(pinned) // 2} regions of {n}")
        sizes = pinned[1::2]
        _check_pinned(self.remote, self.regions, pinned[0::2], sizes, self.peer, self.op is Op.WRITE)
        mapped = [self.maps[int(rid)] for rid in self.regions.tolist()]
        if any(m.size != int(size) for m, size in zip(mapped, sizes.tolist())):
            raise ProtocolError(f"peer {self.peer!r} pinned a region whose size differs from its segment")
        bases = np.array([m.base for m in mapped], np.uint64)
        dsts, srcs, lens = _triples(self.op, self.regions, self.remote, bases, self.addrs, self.lens)
        _io.memcpyv(np.ascontiguousarray(dsts, np.uint64), np.ascontiguousarray(srcs, np.uint64),
                    np.ascontiguousarray(lens, np.uint64))


def _check_pinned(remote: np.ndarray, regions: np.ndarray, bases: np.ndarray, sizes: np.ndarray,
                  peer: str, writing: bool) -> tuple[Any, Any]:
    """The pinned base of each remote descriptor's region, after checking that
    every descriptor lies inside the size the target pinned."""
    offsets, lengths = remote["offset"], remote["length"]
    if len(regions) == 1:
        base, size = bases[0], sizes[0]
    else:
        at = np.searchsorted(regions, remote["region"])
        base, size = bases[at], sizes[at]
    # The initiator checked against the sizes the peer published; these are the ones it pinned.
    if not ((offsets <= size) & (lengths <= size - np.minimum(offsets, size))).all():
        top = int(regions.max()) + 1
        flags = np.zeros(top, np.uint8)
        flags[regions] = VALID
        table = np.zeros(top, np.uint64)
        table[regions] = sizes
        check_descs(remote, flags, table, 0, f"peer {peer!r}: remote {'write' if writing else 'read'}")
        raise AccessError(f"peer {peer!r}: a descriptor lies outside the region it pinned")
    return base, size


def _triples(op: Op, regions: np.ndarray, remote: np.ndarray, bases: np.ndarray, addrs: Any,
             lens: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, len) triples of one part: the remote descriptors, where
    ``bases`` says each pinned region starts in this process, paired with the
    local ranges in the direction of ``op``."""
    at = 0 if len(regions) == 1 else np.searchsorted(regions, remote["region"])
    remote_addrs = np.asarray(bases[at] + remote["offset"], np.uint64)
    remote_lens = np.ascontiguousarray(remote["length"], np.uint64)
    local_addrs, local_lens = np.asarray(addrs, np.uint64), np.asarray(lens, np.uint64)
    if op is Op.WRITE:
        return _staging.pair(remote_addrs, remote_lens, local_addrs, local_lens)
    return _staging.pair(local_addrs, local_lens, remote_addrs, remote_lens)


class _IpcCopy:
    """Moves one part's bytes between GPUs once the target has pinned its
    regions and sent their CUDA IPC handles."""

    __slots__ = ("op", "device", "ipc_map", "pid", "peer", "addrs", "lens", "remote", "regions")

    def __init__(self, op: Op, device: int, ipc_map: Any, pid: int, peer: str, addrs: Any, lens: Any,
                 remote: np.ndarray, regions: np.ndarray) -> None:
        self.op = op
        self.device = device
        self.ipc_map = ipc_map
        self.pid = pid
        self.peer = peer
        self.addrs = addrs
        self.lens = lens
        self.remote = remote
        self.regions = regions

    def __call__(self, pinned: np.ndarray) -> None:
        from kvx import gpu

        n = len(self.regions)
        if len(pinned) * 8 != n * _wire.PIN_IPC_REPLY_BYTES:
            raise ProtocolError(f"peer {self.peer!r} answered a CUDA IPC pin of {n} regions with "
                                f"{len(pinned) * 8} bytes")
        bases, sizes = pinned[0:2 * n:2], pinned[1:2 * n:2]
        tail = pinned[2 * n:].reshape(n, 9)
        writing = self.op is Op.WRITE
        _check_pinned(self.remote, self.regions, bases, sizes, self.peer, writing)
        if self.pid == os.getpid():
            mapped = bases  # the same process: the peer's device addresses are ours
        else:
            # Where each region starts in this process: its allocation, opened once, plus its offset.
            mapped = np.array([self.ipc_map.open(tail[i, 1:].tobytes()) + int(tail[i, 0]) for i in range(n)],
                              np.uint64)
        dsts, srcs, lens = _triples(self.op, self.regions, self.remote, mapped, self.addrs, self.lens)
        try:
            gpu.engine(self.device).copy(dsts, srcs, lens).synchronize()
        except KvxError:
            raise
        except Exception as exc:  # CuPy's CUDA errors
            raise TransferError(f"CUDA IPC copy with peer {self.peer!r} failed: {exc}") from exc


class _Copy:
    """Moves one part's bytes once the target has pinned its regions."""

    __slots__ = ("move", "pid", "peer", "addrs", "lens", "remote", "regions")

    def __init__(self, move: Any, pid: int, peer: str, addrs: Any, lens: Any, remote: np.ndarray,
                 regions: np.ndarray) -> None:
        self.move = move
        self.pid = pid
        self.peer = peer
        self.addrs = addrs
        self.lens = lens
        self.remote = remote
        self.regions = regions

    def __call__(self, pinned: np.ndarray) -> None:
        """``pinned``: (base address, size) per region, as the target sent them."""
        if len(pinned) != 2 * len(self.regions):
            raise ProtocolError(f"peer {self.peer!r} pinned {len(pinned) // 2} regions of {len(self.regions)}")
        bases, sizes = pinned[0::2], pinned[1::2]
        base, _ = _check_pinned(self.remote, self.regions, bases, sizes, self.peer, self.move is _io.vm_writev)
        offsets, lengths = self.remote["offset"], self.remote["length"]
        try:
            self.move(self.pid, self.addrs, self.lens, np.ascontiguousarray(offsets + base, np.uint64),
                      np.ascontiguousarray(lengths))
        except OSError as exc:
            raise _copy_error(exc, self.pid, self.peer) from exc


def _copy_error(exc: OSError, pid: int, peer: str) -> Exception:
    if exc.errno == errno.ESRCH:
        return PeerLostError(f"peer {peer!r} (pid {pid}) is gone")
    if exc.errno == errno.EPERM:
        return AccessError(f"cross-memory attach to peer {peer!r} (pid {pid}) is no longer permitted: {exc}")
    if exc.errno == errno.EFAULT:
        return TransferError(f"peer {peer!r} (pid {pid}): a pinned range is not mapped in its process (EFAULT); "
                             "was its memory freed without deregister()?")
    return TransferError(f"cross-memory attach to peer {peer!r} (pid {pid}) failed: {exc}")


def same_host(md: agent_pb2.AgentMetadata, host_name: str, boot_id: str) -> bool:
    """Same kernel: the same boot id, and the same host name (a guard against
    copied boot ids, e.g. two VMs from one image are told apart by it)."""
    return bool(md.boot_id) and md.boot_id == boot_id and md.host_name == host_name


def probe(md: agent_pb2.AgentMetadata) -> str | None:
    """None when this process may attach to the peer's; else why not, in words
    that say what to change."""
    if not md.shm_probe_address:
        return (f"peer {md.name!r} does not offer shm (its backend setting is tcp, or it runs a kvx "
                "without shm)")
    local = np.zeros(1, dtype="<u8")
    try:
        _io.vm_readv(md.pid, np.array([local.ctypes.data], np.uint64), np.array([8], np.uint64),
                     np.array([md.shm_probe_address], np.uint64), np.array([8], np.uint64))
    except OSError as exc:
        return explain(exc, md.pid)
    if int(local[0]) != md.epoch:
        return (f"pid {md.pid} in this process's pid namespace is not peer {md.name!r}: the agents run in "
                "different pid namespaces (containers); share one (Kubernetes: shareProcessNamespace or "
                "hostPID; docker: --pid=host)")
    return None


def explain(exc: OSError, pid: int) -> str:
    """Why process_vm_readv on ``pid`` failed, and what would allow it."""
    if exc.errno == errno.EPERM:
        scope = ptrace_scope()
        if scope is not None and scope >= 1:
            why = (f"kernel.yama.ptrace_scope is {scope}, which allows it only "
                   + ("on descendants" if scope == 1 else "with CAP_SYS_PTRACE" if scope == 2 else "never"))
            fix = ("set it to 0 (sysctl kernel.yama.ptrace_scope=0) or give the agents CAP_SYS_PTRACE"
                   if scope < 3 else "ptrace_scope 3 cannot be lowered without a reboot")
        else:
            why = "the processes run as different users, or a container lacks CAP_SYS_PTRACE"
            fix = "run both agents as one user, or add CAP_SYS_PTRACE (docker: --cap-add SYS_PTRACE)"
        return f"cross-memory attach to pid {pid} is not permitted (EPERM): {why}; {fix}"
    if exc.errno == errno.ESRCH:
        return (f"no process {pid} in this pid namespace: the peer runs in another pid namespace "
                "(container), or has exited; share the pid namespace (Kubernetes: shareProcessNamespace "
                "or hostPID; docker: --pid=host)")
    if exc.errno == errno.ENOSYS:
        return "process_vm_readv is not available (blocked by a seccomp profile, or an old kernel)"
    if exc.errno == errno.EFAULT:
        return f"pid {pid} has no probe at the published address: it is another process, not the peer"
    return f"cross-memory attach to pid {pid} failed: {exc}"


def ptrace_scope() -> int | None:
    try:
        with open(PTRACE_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def probe_buffer(epoch: int) -> np.ndarray:
    """The 8 bytes a peer reads to prove it may attach to this process."""
    return np.array([epoch], dtype="<u8")
