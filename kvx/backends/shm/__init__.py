"""The shm backend: same-host peers, host memory, no copy through a socket.

The initiator moves the bytes itself with cross-memory attach
(``process_vm_readv``/``process_vm_writev``, batched in C:
kvx/_datapath/io.py), from or into the target process's registered memory.
The control connection to the peer carries no bytes: it authenticated the
peer (HMAC challenge, epoch), and before each copy the target checks the
remote descriptors against its region table and pins them (``SHM_PIN``,
``Link.post_pinned``), exactly as it checks a tcp READ or WRITE, so that a
peer still touches only what was registered, and ``deregister`` waits until
no copy can touch the region. See kvx/backends/control/wire.py.

Whether cross-memory attach is allowed between two processes is the
kernel's call (same user, Yama ``ptrace_scope``, capabilities, seccomp, pid
namespaces). ``probe`` finds out before a peer is bound to this backend, by
reading 8 bytes the target published for it, and says why not when not.
Where it is refused, memory allocated with ``kvx.alloc_shared`` is copied
through shared segments instead (segments.py); other memory goes over tcp.
"""

from __future__ import annotations

import array
import errno
import logging
import threading
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx.backends.base import Backend, BackendContext, Channel, Unreachable, same_host
from kvx.backends.control import wire as _wire
from kvx.backends.control.link import Link, region_ids
from kvx.backends.control.serve import Fatal, Handler, InboundConnection
from kvx.backends.control.wire import MsgType
from kvx.backends.shm import owner, segments
from kvx.backends.shm.copy import CmaCopy, SegmentCopy, cma_copy, copy_error
from kvx.backends.tcp import TcpChannel
from kvx.descs import Descs
from kvx.errors import AccessError, KvxError, ProtocolError, TransferError
from kvx.memory import DEVICE, REMOTE_READ, REMOTE_WRITE, SMALL_LIST
from kvx.transfer import WRITE, Op, Transfer
from kvx.v1 import agent_pb2

logger = logging.getLogger(__name__)

PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# Connections (each with its reader thread, which copies) to a peer on shm: a
# large transfer is copied in this many parts at once, so that one part's fixed
# costs (the pin round trip, the Python around it) overlap another's copy.
# Measured with `kvx bench` (benchmarks/RESULTS.md): 2 lanes reach the
# process_vm_readv limit, 1 lane about 83% of it.
LANES = 2
# Transfers up to this size are copied on the thread that posts them, through
# the regions' leases (no round trip, no thread hand-off); larger ones in
# parts on the lanes' threads, where those costs are small against the copy.
INLINE_COPY_BYTES = 4 << 20


class ShmBackend(Backend):
    name = "shm"
    priority = 10
    stages_gpu = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        # Same-host peers read these 8 bytes (the epoch) to prove they may attach to this process.
        self._probe = probe_buffer(ctx.epoch)
        self._lock = threading.Lock()
        self._closed = False
        # The local socket: same-host initiators learn from it (and the
        # kernel) which process serves their connection, and receive shared
        # segments' descriptors.
        self._segment_server: segments.SegmentServer | None = None
        if self.offered:
            try:
                self._segment_server = segments.SegmentServer(ctx)
            except OSError as exc:
                logger.warning(
                    "agent %s: no local socket (%s); same-host peers will use tcp", ctx.agent_name, exc
                )

    @property
    def offered(self) -> bool:
        return self.ctx.serves_pins

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        if not self.offered:
            return
        md.shm_probe_address = self._probe.ctypes.data
        server = self._segment_server
        if server is None:
            return
        md.segment_socket = server.name
        for pb in md.regions:
            region = self.ctx.regions.get(pb.id)
            pb.shared_segment = region is not None and segments.whole_segment(region)

    def handlers(self) -> dict[int, Handler]:
        return {MsgType.SEG_TOKEN: self._on_seg_token}

    def _on_seg_token(
        self, conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int
    ) -> None:
        if payload_len or aux or data_len:
            raise Fatal(ProtocolError("SEG_TOKEN carries nothing"), request_id)
        server = self._segment_server
        if server is None:
            conn.send_error(
                request_id, AccessError(f"agent {self.ctx.agent_name!r} does not offer shared segments")
            )
            return
        try:
            token = server.issue(conn.peer_name)
        except AccessError as exc:
            conn.send_error(request_id, exc)
            return
        conn.sock.sendall(_wire.pack(MsgType.SEG_TOKEN_OK, request_id, payload_len=len(token)) + token)

    def streams(self, md: agent_pb2.AgentMetadata, streams: int) -> int:
        return lanes(md, streams)

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        why = cma_problem(md)
        if why is None:
            return None, (
                f"same host ({md.host_name}, boot id {md.boot_id[:8]}), cross-memory attach "
                f"to pid {md.pid} permitted"
            )
        if segments_offered(md):
            return None, why  # connect maps the segments, or finds it cannot
        return why, ""

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        if cma_problem(md) is None:
            why = prove(md, link)
            if why is not None:
                raise Unreachable(why)
            return ShmChannel(link, md.pid, cma=True), ""
        maps = map_segments(md, link)
        if not maps:
            raise Unreachable(
                f"{cma_problem(md)}; peer {md.name!r} offers no shared segment that could be mapped"
            )
        return ShmChannel(link, md.pid, cma=False, segment_maps=maps), (
            f"; instead, {len(maps)} region(s) allocated with kvx.alloc_shared are mapped through "
            "shared segments, other memory goes over tcp"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            server, self._segment_server = self._segment_server, None
        if server is not None:
            server.close()


class ShmChannel(Channel):
    """Host bytes through cross-memory attach (``cma``) or the peer's shared
    segments; anything else (GPU memory on either side, memory outside the
    segments) over tcp, on the same link."""

    # Cross-memory attach merges adjacent ranges in C (leased_copy), for
    # free; the other paths here merge them in post.
    merges_ranges = True

    def __init__(
        self, link: Link, pid: int, *, cma: bool, segment_maps: dict[int, Any] | None = None
    ) -> None:
        super().__init__(link)
        self.tcp = TcpChannel(link)
        self.pid = pid
        self.cma = cma
        self.segment_maps = segment_maps or {}
        self._segment_ids = np.array(sorted(self.segment_maps), dtype=np.int64)
        if cma:
            self.copy_inline = self._copy_inline
        if self.segment_maps:
            maps = self.segment_maps
            link.when_closed(lambda: segments.close_all(maps))  # no copy can run any more

    def post(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        local_device: int = -1,
        remote_device: int = -1,
        remote_ipc: bool = False,
    ) -> None:
        link = self._link
        if local_device < 0 and remote_device < 0 and (self.cma or self._in_segments(remote)):
            if self.cma:
                if total <= INLINE_COPY_BYTES and self._copy_leased(
                    transfer, op, local_addrs, local_lens, remote, notify
                ):
                    return
                if len(remote) > 1:  # fewer descriptors, fewer parts
                    remote = Descs(remote).coalesce().array
                pid, peer = self.pid, link.peer
                make_copy: Any = lambda *part: CmaCopy(pid, op, peer, *part)  # noqa: E731
            else:
                local_addrs, local_lens = merge_ranges(local_addrs, local_lens)
                if len(remote) > 1:
                    remote = Descs(remote).coalesce().array
                maps, peer = self.segment_maps, link.peer
                make_copy = lambda *part: SegmentCopy(maps, op, peer, *part)  # noqa: E731
            if total > INLINE_COPY_BYTES:  # copied in parts on the connections' threads
                link.post_pinned(transfer, op, local_addrs, local_lens, total, remote, notify, 0, make_copy)
            elif self.cma or not link.copy_leased(
                transfer, op, local_addrs, local_lens, remote, notify, make_copy
            ):
                # The first transfer on these regions: the target leases them to us.
                link.post_pinned(
                    transfer, op, local_addrs, local_lens, total, remote, notify, 0, make_copy, keep=True
                )
        else:
            # The agent left merging to this channel (merges_ranges); tcp wants it done.
            local_addrs, local_lens = merge_ranges(local_addrs, local_lens)
            if len(remote) > 1:
                remote = Descs(remote).coalesce().array
            self.tcp.post(
                transfer, op, local_addrs, local_lens, total, remote, notify, local_device, remote_device
            )

    def _copy_leased(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        remote: np.ndarray,
        notify: bytes | None,
    ) -> bool:
        """``Link.copy_leased`` for cross-memory attach, without the copy
        object: the latency path. False (nothing done) when a region is not
        leased yet."""
        link = self._link
        if len(remote) == 1:
            rids = [int(remote["region"][0])]
        elif len(remote) <= SMALL_LIST:
            rids = sorted(set(remote["region"].tolist()))
        else:
            rids = region_ids(remote).tolist()
        writing = op is WRITE
        conn = link.conns[0]
        pinned = conn.lease(rids, writing)  # counts a use: a revoke waits for unlease
        if pinned is None:
            return False
        error: KvxError | None = None
        try:
            transfer.expect_parts(1, link.notify_after(notify))
            cma_copy(
                self.pid, link.peer, writing, local_addrs, local_lens, remote, array.array("I", rids), pinned
            )
        except KvxError as exc:
            error = exc
        except Exception as exc:  # a bug: the transfer must still finish
            logger.exception("copy to peer %s failed", link.peer)
            error = TransferError(f"internal error: {exc!r}")
        finally:
            conn.unlease(rids)
        transfer.part_finished(error)
        return True

    def _copy_inline(
        self,
        writing: bool,
        local: np.ndarray,
        pin: tuple[Any, ...],
        need: int,
        remote: np.ndarray,
        max_bytes: int,
    ) -> int | BaseException | None:
        """A whole small host transfer in one C call (conn_leased_post): the
        regions of the remote descriptors leased (a use counted, so a revoke
        waits), the local descriptors resolved against this agent's pinned
        region table (``pin``, as ``RegionTable.pin_table`` gives it: token,
        bases, sizes, flags, devices; each region's flags carry ``need`` and
        no DEVICE), the remote ones checked against the lease, the bytes
        moved, the lease given back. The bytes moved; the error of a copy
        that failed; None when nothing was done (a region not leased yet, a
        descriptor refused, totals that differ or exceed ``max_bytes`` or
        INLINE_COPY_BYTES): the caller then takes the full path, which names
        any error."""
        try:
            got = _io.conn_leased_post(
                self._link.conns[0],
                self.pid,
                writing,
                local,
                pin[1],
                pin[2],
                pin[3],
                need,
                need | DEVICE,
                remote,
                REMOTE_WRITE if writing else REMOTE_READ,
                min(max_bytes, INLINE_COPY_BYTES),
            )
        except OSError as exc:
            return copy_error(exc, self.pid, self._link.peer)
        except Exception as exc:  # a bug: the transfer must still finish
            logger.exception("copy to peer %s failed", self._link.peer)
            return TransferError(f"internal error: {exc!r}")
        return got if type(got) is int else None

    def _in_segments(self, remote: np.ndarray) -> bool:
        if not len(self._segment_ids):
            return False
        return bool(np.isin(remote["region"], self._segment_ids).all())


def merge_ranges(addrs: Any, lens: Any) -> tuple[Any, Any]:
    """Join local ranges where one starts where the one before ends."""
    if len(addrs) < 2:
        return addrs, lens
    a, n = np.asarray(addrs, np.uint64), np.asarray(lens, np.uint64)
    joins = a[1:] == a[:-1] + n[:-1]
    if not joins.any():
        return addrs, lens
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return np.ascontiguousarray(a[starts]), np.add.reduceat(n, starts).astype(np.uint64)


def lanes(md: agent_pb2.AgentMetadata, streams: int) -> int:
    """Connections to a peer the same-host backends may serve: at least LANES,
    so that large transfers are copied on several threads."""
    if md.shm_probe_address and same_host(md):
        return max(streams, LANES)
    return streams


def segments_offered(md: agent_pb2.AgentMetadata) -> bool:
    """The peer offers shared segments of some region (kvx.alloc_shared memory)."""
    return bool(md.segment_socket) and same_host(md) and any(r.shared_segment for r in md.regions)


def map_segments(md: agent_pb2.AgentMetadata, link: Link) -> dict[int, Any]:
    """Map the peer's shared segments: a token over the authenticated link,
    presented on its segment socket. Empty when it fails (said in the log)."""
    if not segments_offered(md):
        return {}
    try:
        token = link.request(MsgType.SEG_TOKEN, MsgType.SEG_TOKEN_OK)
        if len(token) != segments.TOKEN_BYTES:
            raise ProtocolError(f"peer {md.name!r} sent a {len(token)}-byte segment token")
        shared = [r.id for r in md.regions if r.shared_segment]
        if len(shared) > segments.MAX_REGIONS_PER_REQUEST:
            logger.warning(
                "peer %s offers %d shared segments; the first %d are mapped, the others go over tcp",
                md.name,
                len(shared),
                segments.MAX_REGIONS_PER_REQUEST,
            )
        return segments.fetch(md.segment_socket, token, shared[: segments.MAX_REGIONS_PER_REQUEST], md.name)
    except (KvxError, OSError) as exc:
        if not link.alive:
            raise  # the control connection broke: nothing can use it
        logger.warning("peer %s offers shared segments, but mapping them failed: %s", md.name, exc)
        return {}


def cma_problem(md: agent_pb2.AgentMetadata) -> str | None:
    """None when this process may attach to the peer's; else why not."""
    if not same_host(md):
        return f"peer {md.name!r} is on another host ({md.host_name or 'unknown'})"
    return probe(md)


def probe(md: agent_pb2.AgentMetadata) -> str | None:
    """None when this process may attach to the peer's; else why not, in words
    that say what to change."""
    if not md.shm_probe_address:
        return (
            f"peer {md.name!r} does not offer shm (its backend setting is tcp, or it runs a kvx without shm)"
        )
    local = np.zeros(1, dtype="<u8")
    try:
        _io.vm_readv(
            md.pid,
            np.array([local.ctypes.data], np.uint64),
            np.array([8], np.uint64),
            np.array([md.shm_probe_address], np.uint64),
            np.array([8], np.uint64),
        )
    except OSError as exc:
        return explain(exc, md.pid)
    if int(local[0]) != md.epoch:
        return (
            f"pid {md.pid} in this process's pid namespace is not peer {md.name!r}: the agents run in "
            "different pid namespaces (containers); share one (Kubernetes: shareProcessNamespace or "
            "hostPID; docker: --pid=host)"
        )
    return None


def explain(exc: OSError, pid: int) -> str:
    """Why process_vm_readv on ``pid`` failed, and what would allow it."""
    if exc.errno == errno.EPERM:
        scope = ptrace_scope()
        if scope is not None and scope >= 1:
            why = f"kernel.yama.ptrace_scope is {scope}, which allows it only " + (
                "on descendants" if scope == 1 else "with CAP_SYS_PTRACE" if scope == 2 else "never"
            )
            fix = (
                "set it to 0 (sysctl kernel.yama.ptrace_scope=0) or give the agents CAP_SYS_PTRACE"
                if scope < 3
                else "ptrace_scope 3 cannot be lowered without a reboot"
            )
        else:
            why = "the processes run as different users, or a container lacks CAP_SYS_PTRACE"
            fix = "run both agents as one user, or add CAP_SYS_PTRACE (docker: --cap-add SYS_PTRACE)"
        return f"cross-memory attach to pid {pid} is not permitted (EPERM): {why}; {fix}"
    if exc.errno == errno.ESRCH:
        return (
            f"no process {pid} in this pid namespace: the peer runs in another pid namespace "
            "(container), or has exited; share the pid namespace (Kubernetes: shareProcessNamespace "
            "or hostPID; docker: --pid=host)"
        )
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


def prove(md: agent_pb2.AgentMetadata, link: Link) -> str | None:
    """None when the process ``md.pid`` serves every connection of ``link``,
    else why not. Called before anything attaches to ``md.pid`` or trusts the
    addresses its pin answers give: those are trusted only as the sender's
    own memory.

    Two facts from the kernel, and one answer from the process they name:
    the inode of each connection's far end (owner.py), the pid that listens
    on the peer's local socket (SO_PEERCRED: fixed at listen(), passing the
    socket on does not change it), and that process's word that it serves
    those connections. A third process named in the metadata either is no
    kvx agent (it has no such socket) or is an honest one, which serves none
    of them; only the attacker's own process can say yes for itself."""
    if not md.segment_socket:
        return f"peer {md.name!r} has no local socket (it runs an older kvx)"
    inodes = []
    for conn in link.conns:
        inode, why = owner.far_inode(conn.sock, md.pid)
        if inode is None:
            return f"pid {md.pid} is not the peer that answered the handshake ({why})"
        inodes.append(inode)
    refused = segments.serves(md.segment_socket, md.pid, inodes, md.name)
    if refused is not None:
        return f"pid {md.pid} is not the peer that answered the handshake ({refused})"
    return None
