"""The cuda_ipc backend: same-host GPU-to-GPU copies through CUDA IPC.

Like shm, the initiator moves the bytes itself after the target has checked
and leased the regions over the control connection; the lease (a pin with
the ``PIN_IPC`` and ``PIN_KEEP`` flags) also answers each region's offset in
its CUDA allocation and the allocation's ``cudaIpcMemHandle``. The initiator
opens each handle once (``kvx._datapath.gpu.IpcMap``: CUDA refuses a second
open in one context); every transfer on leased regions is then checked
against the leased sizes and copied on the posting thread with one kernel
launch on its own GPU, which waits for the event: no round trip, no thread
hand-off. ``deregister`` on the target revokes the lease and waits until the
copies using it have ended. Handles travel only over the authenticated
connection, never in the metadata.

Host memory on the same link goes through cross-memory attach when the
kernel allows it (as on shm), else through shared segments or tcp; host
memory paired with GPU memory is staged through pinned host buffers.
"""

from __future__ import annotations

import array
import logging
import os
import threading
from typing import Any

import numpy as np

from kvx._datapath import gpu
from kvx._datapath import io as _io
from kvx.backends.base import Backend, Channel, Unreachable, same_host
from kvx.backends.control import wire as _wire
from kvx.backends.control.link import Link
from kvx.backends.control.pinned import PinnedCopy
from kvx.backends.shm import ShmChannel, cma_problem, lanes, map_segments, merge_ranges, prove
from kvx.backends.tcp import TcpChannel
from kvx.descs import Descs, total_bytes
from kvx.errors import KvxError, ProtocolError, TransferError
from kvx.memory import DEVICE, REMOTE_READ, REMOTE_WRITE
from kvx.transfer import Op, Transfer
from kvx.v1 import agent_pb2

logger = logging.getLogger(__name__)

# The largest transfer copied on the posting thread through a lease.
INLINE_COPY_BYTES = 64 << 20
# Words of a cuda_ipc lease: base, size, the offset in the allocation, the 64-byte handle.
_LEASE_WORDS = 2 + _wire.pin_extra_words(_wire.PIN_IPC)
# Leases whose leased_triples arguments a channel keeps (CudaIpcChannel._lease_args).
_LEASE_ARGS_KEPT = 1024


class CudaIpcBackend(Backend):
    name = "cuda_ipc"
    priority = 20

    @property
    def offered(self) -> bool:
        return self.ctx.setting in ("auto", "cuda_ipc")

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        if not self.offered:
            return
        for pb in md.regions:
            region = self.ctx.regions.get(pb.id)
            pb.cuda_ipc = region is not None and bool(region.ipc_handle)

    def applies(self, md: agent_pb2.AgentMetadata) -> bool:
        """Only when either side has registered GPU memory."""
        return self.ctx.regions.has_cuda or any(
            r.memory_kind == agent_pb2.MEMORY_KIND_CUDA for r in md.regions
        )

    def streams(self, md: agent_pb2.AgentMetadata, streams: int) -> int:
        return lanes(md, streams)

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        if not same_host(md):
            return f"peer {md.name!r} is on another host ({md.host_name or 'unknown'})", ""
        why = ipc_problem(md)
        if why is not None:
            return why, ""
        cma_why = cma_problem(md)
        if cma_why is None:
            return None, (
                f"same host ({md.host_name}, boot id {md.boot_id[:8]}), cross-memory attach to pid "
                f"{md.pid} permitted; GPU-to-GPU through CUDA IPC, host memory through cross-memory "
                "attach, host with GPU through pinned host buffers"
            )
        if not md.shm_probe_address:
            return cma_why, ""  # the peer serves no pins
        # CUDA IPC needs no attach: only the pins, over the authenticated connection.
        return (
            None,
            f"same host ({md.host_name}), GPU-to-GPU through CUDA IPC; host memory over tcp, as {cma_why}",
        )

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        cma = cma_problem(md) is None
        if cma or md.pid == os.getpid():
            # Attaching to md.pid, or (one process) using the peer's addresses as ours: only
            # once that process proved it is the one that answered the handshake.
            why = prove(md, link)
            if why is not None:
                raise Unreachable(why)
        if cma:
            return CudaIpcChannel(link, md.pid, ShmChannel(link, md.pid, cma=True)), ""
        maps = map_segments(md, link)
        if maps:
            return CudaIpcChannel(link, md.pid, ShmChannel(link, md.pid, cma=False, segment_maps=maps)), (
                f"; {len(maps)} region(s) allocated with kvx.alloc_shared are mapped through shared segments"
            )
        return CudaIpcChannel(link, md.pid, TcpChannel(link)), ""


def ipc_problem(md: agent_pb2.AgentMetadata) -> str | None:
    """None when GPU memory can move to and from the peer through CUDA IPC; else why not."""
    if md.pid == os.getpid():
        return None  # one process: the peer's device addresses are valid here
    if not gpu.available():
        return "this process has no CUDA device, or no CuPy (" + gpu.EXTRA + ")"
    if any(r.memory_kind == agent_pb2.MEMORY_KIND_CUDA for r in md.regions) and not any(
        r.cuda_ipc for r in md.regions
    ):
        return f"peer {md.name!r} offers none of its GPU memory through CUDA IPC"
    return None


class CudaIpcChannel(Channel):
    """GPU-to-GPU bytes through CUDA IPC; everything else through ``host``."""

    # The agent leaves merging to post: the copy kernel takes the blocks as they
    # are (pairing equal blocks costs nothing; merging one side only makes the
    # two lists cut each other), and the host channel merges as it needs.
    merges_ranges = True
    # copy_inline takes transfers to peers with GPU regions: it copies GPU to GPU
    # through CUDA IPC leases, and leaves everything else to the full path.
    inline_gpu = True

    def __init__(self, link: Link, pid: int, host: Channel) -> None:
        super().__init__(link)
        self.pid = pid
        self.host = host
        self._maps: dict[int, Any] = {}  # local device -> gpu.IpcMap
        self._lock = threading.Lock()
        # Per (local device, leased region, direction): the lease's answer and
        # what leased_triples takes for it (the region id; where the region
        # lies in this process, and its leased size), built once per lease.
        self._lease_args: dict[tuple[int, int, bool], tuple[tuple[int, ...], array.array, array.array]] = {}
        try:
            self._inline_kernel = gpu.copy_method() == "kernel"
        except KvxError:  # a bad KVX_CUDA_COPY: the full path names it
            self._inline_kernel = False
        self.copy_inline = self._copy_inline
        link.when_closed(self._close_maps)  # after the last reader: no copy can run
        link.hook_revoked(self._revoked)

    @property
    def cma(self) -> bool:
        return isinstance(self.host, ShmChannel) and self.host.cma

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
        if local_device >= 0 and remote_device >= 0 and remote_ipc:
            link = self._link
            ipc_map, pid, peer = self._map(local_device), self.pid, link.peer
            make_copy: Any = lambda *part: IpcCopy(local_device, ipc_map, pid, op, peer, *part)  # noqa: E731
            # Through a lease, the copy runs here and now: the GPU moves the bytes, this
            # thread launches and waits (tens of microseconds for a few MiB over NVLink;
            # milliseconds for INLINE_COPY_BYTES over PCIe), and no message goes to the target. Larger transfers, and the
            # first on these regions (which asks for the lease), are copied on the
            # connections' readers, so that the caller does not wait for them.
            if total > INLINE_COPY_BYTES or not link.copy_leased(
                transfer, op, local_addrs, local_lens, remote, notify, make_copy
            ):
                link.post_pinned(
                    transfer,
                    op,
                    local_addrs,
                    local_lens,
                    total,
                    remote,
                    notify,
                    _wire.PIN_IPC,
                    make_copy,
                    keep=True,
                )
        else:
            if not self.host.merges_ranges:
                local_addrs, local_lens = merge_ranges(local_addrs, local_lens)
                if len(remote) > 1:
                    remote = Descs(remote).coalesce().array
            self.host.post(
                transfer,
                op,
                local_addrs,
                local_lens,
                total,
                remote,
                notify,
                local_device,
                remote_device,
                remote_ipc,
            )

    def _copy_inline(
        self,
        writing: bool,
        local: np.ndarray,
        pin: tuple[Any, ...],
        need: int,
        remote: np.ndarray,
        max_bytes: int,
    ) -> int | BaseException | None:
        """A whole small GPU-to-GPU transfer through a lease, on this thread:
        a C call (leased_triples; a second one when the argument buffer must
        grow) checks the local descriptors against this agent's pinned region
        table (``pin``, as ``RegionTable.pin_table`` gives it: GPU memory on
        one device, with ``need``) and the remote ones against the lease, and
        writes the copy kernel's arguments; then one launch, and a wait for
        it. The bytes moved; the error of a copy that failed; None when
        nothing was done (host memory, a remote list over more than one
        region, a region not leased yet, KVX_CUDA_COPY=memcpy, anything
        refused): the caller then takes the full path, which names any
        error."""
        _, bases, sizes, flags, devices = pin
        if not self._inline_kernel or not len(local) or not len(remote):
            return None
        first = int(local["region"][0])
        if first >= len(flags) or not flags[first] & DEVICE:
            return None  # host memory: the full path (it picks cross-memory attach or tcp)
        # One remote region, the first's: leased_triples refuses a descriptor of
        # any other (the full path then checks that the regions share one device).
        rid = int(remote["region"][0])
        device = int(devices[first])
        conn = self._link.conns[0]
        pinned = conn.lease([rid], writing)  # counts a use: a revoke waits for unlease
        if pinned is None:
            return None
        launched: Any = None  # the copy's event, once it was launched
        try:
            args = self._leased_args(device, rid, writing, pinned)
            if args is None:
                return None  # host memory there, or a mapping the full path reports on
            engine = gpu.engine(device)
            granted = REMOTE_WRITE if writing else REMOTE_READ
            limit = min(max_bytes, INLINE_COPY_BYTES)
            event = engine.copy_packed(
                lambda out, words: _io.leased_triples(
                    writing,
                    local,
                    bases,
                    sizes,
                    flags,
                    devices,
                    device,
                    need | DEVICE,
                    need | DEVICE,
                    remote,
                    args[1],
                    args[2],
                    granted,
                    limit,
                    gpu.PIECE_BYTES,
                    out,
                    words,
                )
            )
            if isinstance(event, tuple):
                return None
            launched = event
            engine.wait(event)
        except KvxError as exc:
            return exc
        except Exception as exc:  # CuPy's CUDA errors, or a bug: the transfer must still finish
            logger.exception("CUDA IPC copy with peer %s failed", self._link.peer)
            return TransferError(f"CUDA IPC copy with peer {self._link.peer!r} failed: {exc!r}")
        except BaseException:
            # A KeyboardInterrupt between the launch and the wait: the copy must end before
            # the lease is given back below (Engine.wait itself always waits for it).
            if launched is not None:
                launched.synchronize()
            raise
        finally:
            conn.unlease([rid])
        return total_bytes(remote)

    def _leased_args(
        self, device: int, rid: int, writing: bool, pinned: tuple[int, ...]
    ) -> tuple[tuple[int, ...], array.array, array.array] | None:
        """leased_triples' region and lease arrays for a CUDA IPC lease on
        ``rid``: where the region lies in this process (its allocation,
        opened once, plus its offset) and its leased size. None when the
        lease is not one of CUDA IPC (host memory), or the mapping fails or
        the peer placed the region outside its allocation: the full path
        then reports it."""
        key = (device, rid, writing)
        found = self._lease_args.get(key)
        if found is not None and found[0] is pinned:  # one answer per lease for its life
            return found
        if len(pinned) != _LEASE_WORDS:
            return None
        size, offset = pinned[1], pinned[2]
        if self.pid == os.getpid():
            start = pinned[0]  # the same process: the peer's device address is ours
        else:
            try:
                address, length = self._map(device).open(_handle(pinned))
            except KvxError:
                return None
            if offset > length or size > length - offset:
                return None
            start = address + offset
        if len(self._lease_args) >= _LEASE_ARGS_KEPT:
            self._lease_args.clear()  # regions come and go: keep the cache small
        found = self._lease_args[key] = (pinned, array.array("I", [rid]), array.array("Q", [start, size]))
        return found

    def _map(self, device: int) -> Any:
        with self._lock:
            found = self._maps.get(device)
            if found is None:
                found = self._maps[device] = gpu.IpcMap(device)
            return found

    def _revoked(self, ended: list[tuple[int, ...]], left: list[tuple[int, ...]]) -> None:
        """A region's leases ended (no copy uses them): close the mappings of
        the allocations that no lease left on the connection names, so the
        target may free them. (With the connection's lock held, so no new
        lease can pick a mapping up meanwhile.)"""
        gone = {_handle(lease) for lease in ended if len(lease) == _LEASE_WORDS}
        gone -= {_handle(lease) for lease in left if len(lease) == _LEASE_WORDS}
        if not gone:
            return
        with self._lock:
            maps = list(self._maps.values())
        for ipc_map in maps:
            for handle in gone:
                ipc_map.release(handle)

    def _close_maps(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for ipc_map in maps:
            try:
                ipc_map.close()
            except Exception:  # one device's failure must not leak the others' mappings
                logger.exception("closing CUDA IPC mappings of peer %s failed", self._link.peer)


class IpcCopy(PinnedCopy):
    """Between GPUs, once the target has pinned its regions and sent their
    CUDA IPC handles: per region its uint64 offset in its allocation and the
    64-byte handle."""

    __slots__ = ("device", "ipc_map", "pid")
    extra_bytes = _wire.PIN_IPC_REPLY_BYTES - 16

    def __init__(self, device: int, ipc_map: Any, pid: int, *args: Any) -> None:
        super().__init__(*args)
        self.device = device
        self.ipc_map = ipc_map
        self.pid = pid

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        n = len(self.regions)
        tail = extra.reshape(n, 9)
        if self.pid == os.getpid():
            mapped = bases  # the same process: the peer's device addresses are ours
        else:
            # Where each region starts in this process: its allocation, opened once, plus its
            # offset. The peer says the offset and the size; the driver says how long the
            # allocation is, and the region must lie inside it, or a lying peer would steer
            # this GPU's copies into other memory of this process.
            starts = []
            for i in range(n):
                address, length = self.ipc_map.open(tail[i, 1:].tobytes())
                offset, size = int(tail[i, 0]), int(sizes[i])
                if offset > length or size > length - offset:
                    raise ProtocolError(
                        f"peer {self.peer!r} placed region {int(self.regions[i])} ({size} bytes) at offset "
                        f"{offset} of a CUDA allocation of {length} bytes"
                    )
                starts.append(address + offset)
            mapped = np.array(starts, np.uint64)
        dsts, srcs, lens = self.triples(mapped)
        try:
            engine = gpu.engine(self.device)
            engine.wait(engine.copy(dsts, srcs, lens))
        except KvxError:
            raise
        except Exception as exc:  # CuPy's CUDA errors
            raise TransferError(f"CUDA IPC copy with peer {self.peer!r} failed: {exc}") from exc


def _handle(lease: tuple[int, ...]) -> bytes:
    """The CUDA IPC handle a cuda_ipc lease carries (its last eight words)."""
    return np.array(lease[3:_LEASE_WORDS], np.uint64).tobytes()
