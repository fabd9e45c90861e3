"""The transfer agent: one per worker process.

Lifecycle: ``Agent(...)`` starts listening; ``register`` memory;
``metadata()`` goes to peers (directly or through the metadata service);
``add_peer(their_metadata)`` connects; ``peer.read`` / ``peer.write`` post
transfers; ``close()`` ends it all. Everything posted is validated before a
byte moves: local descriptors against this agent's regions, remote ones
against the peer's published regions (and again by the peer itself).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, overload

import numpy as np

from kvx import backends
from kvx._datapath import checksum as _checksum
from kvx._datapath import io as _io
from kvx._net import is_loopback, parse_address
from kvx.backends.base import Backend, BackendContext, Channel, boot_id
from kvx.backends.control import Links, Listener
from kvx.backends.control.wire import PROTOCOL_VERSION
from kvx.backends.select import Selector
from kvx.config import Limits, Timeouts, check_backend, check_name
from kvx.descs import DESC_DTYPE, Descs, total_bytes
from kvx.errors import (
    AccessError,
    ClosedError,
    ConfigError,
    ConnectError,
    EpochError,
    LimitError,
    MetadataError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
    VersionError,
)
from kvx.memory import (
    DEVICE,
    LOCAL_WRITE,
    MAX_REGION_ID,
    REMOTE_IPC,
    REMOTE_READ,
    REMOTE_WRITE,
    VALID,
    MemoryKind,
    Region,
    RegionTable,
    RemoteRegion,
    check_descs,
    one_device,
)
from kvx.metadata.client import MetadataOptions
from kvx.metadata.directory import Directory
from kvx.transfer import READ, WRITE, Notification, Op, Transfer
from kvx.v1 import agent_pb2

logger = logging.getLogger(__name__)

# A transfer of at most this many descriptors on each side (whatever their
# lengths) takes the latency path of a channel that sends requests
# (Peer._post_small): one C call checks both lists. 64 is also what a tcp
# target serves in one call (kvx.backends.tcp.serve.SMALL_REQUEST_DESCS).
SMALL_POST_DESCS = 64
_U64_MAX = (1 << 64) - 1

_MEMORY_KINDS = {
    MemoryKind.HOST: agent_pb2.MEMORY_KIND_HOST,
    MemoryKind.CUDA: agent_pb2.MEMORY_KIND_CUDA,
}
_MEMORY_FROM_PB = {v: k for k, v in _MEMORY_KINDS.items()}


class Agent:
    """A transfer endpoint.

    name:           unique in the cluster (the metadata service keys on it).
    listen:         "host:port" for the tcp backend; port 0 picks a free one.
    advertise_host: the host peers should dial, when ``listen`` binds a
                    wildcard address.
    auth_secret:    the cluster secret; peers prove they know it (HMAC
                    challenge) before any transfer. Without one the agent
                    listens on loopback only, unless ``allow_insecure``.
    streams:        connections per peer; large transfers spread over them.
    on_notify:      ``fn(Notification)`` called from a kvx thread instead of
                    queueing for ``notifications()``.
    metadata:       "host:port" of a kvx metadata service: the agent registers
                    there (as ``role`` with ``labels`` and ``engine_info``),
                    keeps its lease alive, registers again by itself after
                    the service restarts, and unregisters on close; peers
                    are then found by name with ``connect(name)``.
    metadata_options: token, TLS files and lease for that service.
    backend:        "auto" (default): peers on the same host get ``shm`` when
                    the kernel allows cross-memory attach, and ``cuda_ipc``
                    when either side also has GPU memory (GPU-to-GPU bytes
                    then move through CUDA IPC); others get ``tcp``, which
                    stages GPU memory through pinned host buffers. "tcp",
                    "shm" or "cuda_ipc" (or a backend added with
                    ``kvx.backends.register``) forces one (a forced one
                    fails to connect to a peer it cannot use, saying why).
                    ``peer.backend`` and ``peer.backend_reason`` say what
                    was chosen.
    verify:         the default of ``verify`` for this agent's READs and
                    WRITEs (each can override it): end-to-end checksums, one
                    CRC-32C per remote descriptor on each side, compared
                    before the transfer is done and before its notification
                    goes; a difference fails it with ``IntegrityError``.
                    Host memory only; needs ``pip install 'kvx[verify]'``.
    """

    def __init__(
        self,
        name: str,
        *,
        listen: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        auth_secret: bytes | str | None = None,
        allow_insecure: bool = False,
        streams: int = 1,
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        on_notify: Callable[[Notification], Any] | None = None,
        metadata: str | None = None,
        role: str = "other",
        labels: dict[str, str] | None = None,
        engine_info: dict[str, str] | None = None,
        metadata_options: MetadataOptions | None = None,
        backend: str = "auto",
        verify: bool = False,
    ) -> None:
        self.name = check_name(name)
        if not isinstance(verify, bool):
            raise ConfigError(f"verify is True or False, not {verify!r}")
        if verify and not _checksum.available():
            raise ConfigError(f"verify=True needs the crc32c package: {_checksum.EXTRA}")
        self.verify = verify
        self.backend_setting = check_backend(backend)
        self.epoch = secrets.randbits(64) or 1
        self.timeouts = timeouts or Timeouts()
        self.limits = limits or Limits()
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise ConfigError(f"streams must be between 1 and 64, not {streams!r}")
        self.streams = streams
        if isinstance(auth_secret, str):
            auth_secret = auth_secret.encode()
        if auth_secret is not None and len(auth_secret) < 16:
            raise ConfigError("auth_secret must be at least 16 bytes (e.g. secrets.token_hex(16))")
        self._secret: bytes | None = auth_secret
        host, port = parse_address(listen)
        if self._secret is None:
            if not is_loopback(host) and not allow_insecure:
                raise ConfigError(
                    f"agent {name!r} would listen on {listen} without an auth_secret, so any host could "
                    "read and write its registered memory; set auth_secret (recommended), listen on "
                    "loopback, or pass allow_insecure=True"
                )
            if not is_loopback(host):
                logger.warning(
                    "agent %s listens on %s WITHOUT authentication (allow_insecure=True)", name, listen
                )
            else:
                logger.info("agent %s has no auth_secret: any local process may connect as a peer", name)
        if advertise_host is None and host in ("0.0.0.0", "::", ""):
            advertise_host = socket.gethostname()
        self._on_notify = on_notify
        self._notifications: collections.deque[Notification] = collections.deque()
        self._notify_cv = threading.Condition()
        self._regions = RegionTable(self.limits.max_regions)
        self._peers: dict[str, Peer] = {}
        # Per peer name: [a lock that lets one add_peer at a time connect, callers using it].
        self._connecting: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        # What the backends see of this agent, and nothing more.
        ctx = BackendContext(
            self.name,
            self.epoch,
            self.backend_setting,
            self._regions,
            self._secret,
            self.limits,
            self.timeouts,
            self._deliver,
            lambda inode: self._listener.serves(inode),
            host,
        )
        self._links = Links(ctx)  # before the backends: it may refuse the environment's settings
        self._backends = _load_backends(ctx)
        self._selector = Selector(self._backends)
        handlers = {name: b.handlers() for name, b in self._backends.items()}
        try:
            self._listener = Listener(ctx, host, port, advertise_host, handlers)
        except BaseException:
            self._close_backends()
            raise
        self._regions.on_remove = self._listener.revoke  # peers give their leases back
        logger.info("agent %s epoch %#x listening on %s", name, self.epoch, self._listener.endpoint)
        self._directory: Directory | None = None
        if metadata is not None:
            try:
                self._directory = Directory(self, metadata, role, labels, engine_info, metadata_options)
                self._directory.start()
            except BaseException:
                self._directory = None
                self._stop()
                raise

    # Lifecycle.

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Agent {self.name!r} epoch={self.epoch:#x} {self.endpoint}>"

    @property
    def endpoint(self) -> str:
        """Where peers reach this agent's control connections: "host:port"."""
        return self._listener.endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop serving; transfers in flight fail with ClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        if self._directory is not None:
            self._directory.close()  # unregisters first: peers stop finding us
        for peer in peers:
            peer._close(ClosedError(f"agent {self.name!r} was closed"))
        self._stop()
        with self._notify_cv:
            self._notify_cv.notify_all()

    def _stop(self) -> None:
        """End the listener, every connection and the backends; wait for the threads."""
        deadline = time.monotonic() + self.timeouts.close_s
        threads = self._listener.close() + self._links.close()
        self._close_backends()
        for thread in threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            logger.warning("threads still running after close: %s", ", ".join(stuck))

    def _close_backends(self) -> None:
        for backend in self._backends.values():
            try:
                backend.close()
            except Exception:  # one backend must not keep the others open
                logger.exception("closing backend %s failed", backend.name)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"agent {self.name!r} is closed")

    # Memory.

    def register(self, obj: Any, *, remote_access: bool = True, device: int | None = None) -> Region:
        """Register memory.

        Host memory: a numpy array, bytearray, memoryview, mmap, torch CPU
        tensor, or an ``(address, size_bytes)`` tuple. GPU memory (needs the
        kvx[gpu] extra): a CuPy array, a torch CUDA tensor, anything with
        ``__cuda_array_interface__`` or a CUDA DLPack capsule, or an
        ``(address, size_bytes)`` tuple with ``device`` (the CUDA device
        index). GPU memory must be one contiguous range.

        With ``remote_access`` peers may read it, and write it when it is
        writable. The agent keeps ``obj`` alive until ``deregister``.
        """
        self._check_open()
        region = self._regions.add(obj, remote_access=remote_access, device=device)
        told: list[Backend] = []
        try:
            for backend in self._backends.values():
                backend.registered(region)
                told.append(backend)
        except BaseException:
            self._forget(region, told)  # refused (say, a NIC could not register it): not registered
            raise
        if self._directory is not None and remote_access:
            try:
                self._directory.regions_changed()
            except MetadataError:
                self._forget(region, told)  # refused (say, too many regions): not registered
                raise
        return region

    def _forget(self, region: Region, backends: list[Backend]) -> None:
        """Take a region that no peer has seen yet out again."""
        self._regions.remove(region, 0)
        for backend in backends:
            try:
                backend.deregistered(region)
            except Exception:
                logger.exception("backend %s failed to let go of region %d", backend.name, region.id)
        self._regions.let_go(region)

    def deregister(self, region: Region | int, *, timeout_s: float | None = None) -> None:
        """Remove a region. Waits for transfers that may touch it (up to
        ``timeout_s``, default Timeouts.transfer_s), then raises RegionBusyError."""
        removed = self._regions.remove(region, self.timeouts.transfer_s if timeout_s is None else timeout_s)
        # Pins and leases have ended: backends close what lets a peer reach
        # the memory (a NIC's registration) before deregister returns.
        for backend in self._backends.values():
            try:
                backend.deregistered(removed)
            except Exception:  # one backend must not keep the others' registrations open
                logger.exception("backend %s failed to let go of region %d", backend.name, removed.id)
        # Only now may the memory go: until the registrations closed, a peer could still reach it.
        self._regions.let_go(removed)
        if self._directory is not None:
            self._directory.regions_changed()

    def update_engine_info(self, info: dict[str, str]) -> None:
        """Add to the engine facts published in the metadata service (no-op without one)."""
        if self._directory is not None:
            self._directory.engine_info.update(info)
            self._directory.regions_changed()

    @property
    def regions(self) -> list[Region]:
        return self._regions.regions()

    # Metadata and peers.

    def metadata(self) -> bytes:
        """This agent's metadata (kvx.v1.AgentMetadata) for its peers."""
        return self.metadata_message().SerializeToString()

    def metadata_message(self) -> agent_pb2.AgentMetadata:
        """The same, as the protobuf message (for embedding in other messages)."""
        md = agent_pb2.AgentMetadata(
            protocol_version=PROTOCOL_VERSION,
            name=self.name,
            epoch=self.epoch,
            host_name=socket.gethostname(),
            boot_id=boot_id(),
            pid=os.getpid(),
            auth_required=self._secret is not None,
        )
        md.endpoints.add(backend=agent_pb2.BACKEND_TCP, address=self.endpoint)  # the control endpoint
        for r in self._regions.regions():
            if r.remote_read or r.remote_write:
                md.regions.add(
                    id=r.id,
                    size_bytes=r.size_bytes,
                    memory_kind=_MEMORY_KINDS[r.memory_kind],
                    device=r.device,
                    address=r.address,
                    remote_read=r.remote_read,
                    remote_write=r.remote_write,
                )
        for backend in self._backends.values():
            backend.offer(md)
        return md

    def add_peer(self, metadata: bytes, *, streams: int | None = None, backend: str | None = None) -> Peer:
        """Connect to the agent that ``metadata`` describes.

        A peer of the same name is replaced when the epoch differs (it
        restarted); with the same epoch the live peer is returned, or a dead
        one reconnected. ``backend`` overrides the agent's setting for this
        peer. Safe to call from several threads: one of them connects, the
        others get its peer.
        """
        self._check_open()
        md = parse_metadata(metadata)
        with self._lock:
            entry = self._connecting.setdefault(md.name, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                return self._add_peer(md, streams, backend)
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:  # the last caller for this name: the table stays as small as the work
                    del self._connecting[md.name]

    def _add_peer(self, md: agent_pb2.AgentMetadata, streams: int | None, backend: str | None) -> Peer:
        with self._lock:
            old = self._peers.get(md.name)
        if old is not None and old.epoch == md.epoch and old.alive:
            old._set_regions(md)  # it may have registered or removed regions since
            return old
        tcp = [e.address for e in md.endpoints if e.backend == agent_pb2.BACKEND_TCP]
        if not tcp:
            raise ConnectError(f"peer {md.name!r} publishes no tcp endpoint")
        setting = check_backend(backend or self.backend_setting)
        streams = self._selector.streams(md, setting, streams or self.streams)
        link = self._links.open(md.name, md.epoch, tcp[0], streams)
        try:
            # After the handshake: the peer is who the metadata says (name, epoch, secret).
            uses_gpu = self._regions.has_cuda or any(
                r.memory_kind == agent_pb2.MEMORY_KIND_CUDA for r in md.regions
            )
            choice = self._selector.choose(md, setting, link, uses_gpu)
            peer = Peer(self, md, choice.channel, choice.backend, choice.reason)
        except BaseException:
            link.abandon()
            raise
        link.start()
        with self._lock:
            if self._closed:
                choice.channel.close()
                raise ClosedError(f"agent {self.name!r} is closed")
            self._peers[md.name] = peer
        if old is not None:
            # Only now: metadata alone (say, a forged new epoch) must not end a live peer;
            # a peer that answered the handshake as that name and epoch replaces it.
            old._close(
                EpochError(f"peer {md.name!r} restarted (epoch {old.epoch:#x} -> {md.epoch:#x})")
                if old.epoch != md.epoch
                else PeerLostError(f"peer {md.name!r} reconnected")
            )
        logger.info(
            "agent %s: peer %s epoch %#x over %s (%s), %d stream(s): %s",
            self.name,
            md.name,
            md.epoch,
            choice.backend,
            tcp[0],
            len(link.conns),
            choice.reason,
        )
        return peer

    def connect(self, name: str, *, streams: int | None = None) -> Peer:
        """The peer named ``name``, resolved through the metadata service.

        Served from the local cache while it is current; a peer that
        restarted (new epoch) or changed its regions is looked up again.
        """
        self._check_open()
        if self._directory is None:
            raise ConfigError(
                "connect(name) needs a metadata service: Agent(..., metadata='host:port'); "
                "without one, use add_peer(their_metadata)"
            )
        with self._lock:
            cached = self._peers.get(name)
        return self._directory.resolve(name, cached, streams)

    def _replace_stale_peer(self, name: str, new_epoch: int) -> None:
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.epoch == new_epoch:
                return
            del self._peers[name]
        peer._close(EpochError(f"peer {name!r} restarted (epoch {peer.epoch:#x} -> {new_epoch:#x})"))

    def peer(self, name: str) -> Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise ConnectError(f"no peer named {name!r}; add_peer() it first")
        return peer

    @property
    def peers(self) -> list[Peer]:
        with self._lock:
            return list(self._peers.values())

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
        if peer is not None:
            peer._close(ClosedError(f"peer {name!r} was removed"))

    # Notifications.

    def notifications(self, timeout_s: float = 0.0) -> list[Notification]:
        """Take the queued notifications; waits up to ``timeout_s`` for one."""
        with self._notify_cv:
            if not self._notifications and timeout_s > 0 and not self._closed:
                self._notify_cv.wait_for(lambda: self._notifications or self._closed, timeout_s)
            out = list(self._notifications)
            self._notifications.clear()
            self._notify_cv.notify_all()
            return out

    def _deliver(self, peer: str, data: bytes) -> bool:
        """Called by a serving thread once a notification's data has landed."""
        note = Notification(peer, data)
        if self._on_notify is not None:
            try:
                self._on_notify(note)
            except Exception:
                logger.exception("on_notify callback failed for a notification from %s", peer)
            return True
        limit = self.limits.max_pending_notifications
        with self._notify_cv:
            if len(self._notifications) >= limit:
                # Briefly: well inside the initiator's io_s, so it gets a LimitError, not a dead connection.
                self._notify_cv.wait_for(
                    lambda: len(self._notifications) < limit or self._closed, min(1.0, self.timeouts.io_s / 4)
                )
            if len(self._notifications) >= limit or self._closed:
                return False
            self._notifications.append(note)
            self._notify_cv.notify_all()
            return True


def parse_metadata(metadata: bytes) -> agent_pb2.AgentMetadata:
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise ConfigError("add_peer takes the bytes of the peer's agent.metadata()")
    try:
        md = agent_pb2.AgentMetadata.FromString(bytes(metadata))
    except Exception as exc:
        raise ProtocolError(f"malformed agent metadata: {exc}") from None
    if md.protocol_version != PROTOCOL_VERSION:
        raise VersionError(
            f"peer {md.name!r} speaks kvx protocol version {md.protocol_version}, this "
            f"agent {PROTOCOL_VERSION}; run the same kvx version on both sides"
        )
    try:
        check_name(md.name)
    except ConfigError as exc:
        raise ProtocolError(f"agent metadata: {exc}") from None
    return md


def _load_backends(ctx: BackendContext) -> dict[str, Backend]:
    """Every registered backend, made with the agent's context. One that fails
    to load is left out with a warning, unless the agent is set to use it."""
    loaded: dict[str, Backend] = {}
    for name in backends.names():
        try:
            loaded[name] = backends.load(name)(ctx)
        except Exception as exc:
            if name == ctx.setting:
                for backend in loaded.values():
                    backend.close()
                raise ConfigError(f"backend {name!r} failed to load: {exc}") from exc
            logger.warning(
                "agent %s: backend %s failed to load and is left out: %s", ctx.agent_name, name, exc
            )
    return loaded


class Peer:
    """A connected remote agent."""

    def __init__(
        self,
        agent: Agent,
        md: agent_pb2.AgentMetadata,
        channel: Channel,
        backend: str = "tcp",
        backend_reason: str = "",
    ) -> None:
        self.agent = agent
        self.name = md.name
        self.epoch = md.epoch
        self.backend = backend  # the transport chosen for this peer: "tcp", "shm", "cuda_ipc", ...
        self.backend_reason = backend_reason  # why, in words
        self.host_name = md.host_name
        self._channel = channel
        self._closed_error: Exception | None = None
        self._set_regions(md)
        self._slots = threading.Condition(threading.Lock())  # guards _inflight
        # The channel's copy on the posting thread (shm through leases), or None.
        self._inline = channel.copy_inline
        # The channel takes small transfers checked in one call (tcp: _post_small).
        self._small = channel.small_posts
        self._inflight = 0

    def _set_regions(self, md: agent_pb2.AgentMetadata) -> None:
        regions = [
            RemoteRegion(
                r.id,
                r.size_bytes,
                _MEMORY_FROM_PB.get(r.memory_kind, MemoryKind.HOST),
                r.device,
                r.address,
                r.remote_read,
                r.remote_write,
            )
            for r in md.regions
        ]
        # Vectorised view of the published regions, to refuse bad descriptors
        # before anything goes on the wire (the peer checks again).
        if any(r.id >= MAX_REGION_ID for r in regions):
            raise ProtocolError(f"peer {md.name!r} publishes a region id of {MAX_REGION_ID} or more")
        top = max((r.id for r in regions), default=0) + 1
        sizes = np.zeros(top, np.uint64)
        flags = np.zeros(top, np.uint8)
        devices = np.full(top, -1, np.int32)
        for r, pb in zip(regions, md.regions, strict=True):
            sizes[r.id] = r.size_bytes
            flags[r.id] = (
                VALID
                | (REMOTE_READ if r.remote_read else 0)
                | (REMOTE_WRITE if r.remote_write else 0)
                | (DEVICE if r.memory_kind is MemoryKind.CUDA else 0)
                | (REMOTE_IPC if pb.cuda_ipc else 0)
            )
            if r.memory_kind is MemoryKind.CUDA:
                devices[r.id] = max(r.device, 0)
        # One reference, swapped at once: a post in another thread sees all old or all new.
        self._table = (sizes, flags, devices if (devices >= 0).any() else None)
        self.regions = regions

    def __repr__(self) -> str:
        return f"<Peer {self.name!r} epoch={self.epoch:#x} backend={self.backend} alive={self.alive}>"

    @property
    def alive(self) -> bool:
        return self._closed_error is None and self._channel.alive

    @property
    def streams(self) -> int:
        """Connections to the peer (on shm, each copies a part of a large transfer)."""
        return len(self._channel.link.conns)

    def region(self, region_id: int) -> RemoteRegion:
        for r in self.regions:
            if r.id == region_id:
                return r
        raise AccessError(f"peer {self.name!r} has no region {region_id}")

    def read(
        self,
        local: Descs | np.ndarray,
        remote: Descs | np.ndarray,
        notify: bytes | None = None,
        *,
        verify: bool | None = None,
    ) -> Transfer:
        """Copy ``remote`` (the peer's memory) into ``local``; one-sided.
        ``verify`` (default: the agent's setting) checks every descriptor's
        bytes end to end before the transfer is done (``Agent``)."""
        return self._post(READ, local, remote, notify, verify)

    def write(
        self,
        local: Descs | np.ndarray,
        remote: Descs | np.ndarray,
        notify: bytes | None = None,
        *,
        verify: bool | None = None,
    ) -> Transfer:
        """Copy ``local`` into ``remote`` (the peer's memory); one-sided.
        ``verify`` as for ``read``."""
        return self._post(WRITE, local, remote, notify, verify)

    def notify(self, data: bytes) -> Transfer:
        """Send a notification with no data."""
        data = self._check_notify(data)
        self._check_alive()
        transfer = self._start(Op.WRITE, 0, 1, None)
        self._channel.notify(transfer, data)
        return transfer

    @overload
    def _check_notify(self, notify: bytes) -> bytes: ...
    @overload
    def _check_notify(self, notify: None) -> None: ...
    def _check_notify(self, notify: bytes | None) -> bytes | None:
        if notify is None:
            return None
        if not isinstance(notify, (bytes, bytearray, memoryview)):
            raise ConfigError("notify must be bytes")
        notify = bytes(notify)
        if len(notify) > self.agent.limits.max_notify_bytes:
            raise LimitError(
                f"notification of {len(notify)} bytes; at most {self.agent.limits.max_notify_bytes}"
            )
        return notify

    def _check_alive(self) -> None:
        self.agent._check_open()
        if self._closed_error is not None:
            raise type(self._closed_error)(str(self._closed_error))
        error = self._channel.error
        if error is not None:
            raise PeerLostError(f"peer {self.name!r} is lost ({error}); add_peer() its metadata again")

    def _post(self, op: Op, local: Any, remote: Any, notify: bytes | None, verify: bool | None) -> Transfer:
        # The hot path: a few microseconds of Python for a short list.
        if notify is None and verify is None and type(local) is Descs and type(remote) is Descs:
            # A channel's latency path: a copy on this thread (shm), or one call's checks (tcp).
            if self._inline is not None:
                transfer = self._post_inline(op, local.array, remote.array)
            elif self._small:
                transfer = self._post_small(op, local.array, remote.array)
            else:
                transfer = None
            if transfer is not None:
                return transfer
        if notify is not None:
            notify = self._check_notify(notify)
        local_a = local.array if type(local) is Descs else Descs(local).array
        remote_a = remote.array if type(remote) is Descs else Descs(remote).array
        if not len(local_a) or not len(remote_a):
            raise ConfigError("empty descriptor list; use peer.notify() to send only a notification")
        remote_device, remote_ipc = self._check_remote(
            remote_a, REMOTE_READ if op is READ else REMOTE_WRITE, op
        )
        self._check_alive()
        merges = self._channel.merges_ranges
        if len(local_a) > 1 and not merges:
            local_a = Descs(local_a).coalesce().array
        addrs, lens, total, token = self.agent._regions.resolve(
            local_a,
            LOCAL_WRITE if op is READ else 0,
            "local destination" if op is READ else "local source",
        )
        try:
            remote_total = total_bytes(remote_a)
            if remote_total != total:
                raise ConfigError(f"local descriptors cover {total} bytes, remote ones {remote_total}")
            if total == 0:
                raise ConfigError(
                    "the descriptors cover 0 bytes; use peer.notify() to send only a notification"
                )
            if total > self.agent.limits.max_transfer_bytes:
                raise LimitError(
                    f"transfer of {total} bytes; at most {self.agent.limits.max_transfer_bytes} "
                    "(Limits.max_transfer_bytes)"
                )
            local_device = self.agent._regions.device_of(local_a, "local descriptors")
            if verify is not None and not isinstance(verify, bool):
                raise ConfigError(f"verify is True or False, not {verify!r}")
            if verify or (verify is None and self.agent.verify):
                self._check_verify(remote_a, local_device, remote_device)
                checked = remote_a  # the caller's descriptors, one checksum each
            else:
                checked = None
            transfer = self._start(op, total, 0, token)
        except BaseException:
            self.agent._regions.release(token)
            raise
        if checked is not None:
            transfer._verify = self._verifier(addrs, lens, checked, notify)
            notify = None  # it goes with the VERIFY, once the checksums match
        if len(remote_a) > 1 and not merges:
            remote_a = Descs(remote_a).coalesce().array
        try:
            self._channel.post(
                transfer, op, addrs, lens, total, remote_a, notify, local_device, remote_device, remote_ipc
            )
        except BaseException as exc:
            transfer.fail_unposted(exc)  # releases its slot and its hold on the regions
            raise
        return transfer

    def _post_inline(self, op: Op, local_a: np.ndarray, remote_a: np.ndarray) -> Transfer | None:
        """The latency path of a small transfer on a channel that copies on
        this thread through leases it holds (shm; cuda_ipc between GPUs):
        one C call checks the local descriptors against this agent's regions
        (pinned meanwhile, so ``deregister`` waits) and the remote ones
        against the lease, and copies (or, for the GPU, writes the copy
        kernel's arguments). None when it does not apply or refuses something, with
        nothing moved: ``_post`` then takes the full path, which checks
        again and names the error."""
        agent = self.agent
        if (
            agent._closed
            or self._closed_error is not None
            or agent.verify
            # The peer has GPU regions: the full path sorts them out, unless the channel does.
            or (self._table[2] is not None and not self._channel.inline_gpu)
            or not local_a.flags.c_contiguous
            or not remote_a.flags.c_contiguous
        ):
            return None
        if self._inflight >= agent.limits.max_inflight_per_peer:
            return None  # the full path waits for a slot
        # No slot taken: the transfer is finished before this returns, so
        # the posting threads themselves bound the copies under way here.
        posted_at = time.monotonic()
        regions = agent._regions
        pin = regions.pin_table()
        try:
            got = self._inline(  # type: ignore[misc]
                op is WRITE,
                local_a,
                pin,
                LOCAL_WRITE | VALID if op is READ else VALID,
                remote_a,
                agent.limits.max_transfer_bytes,
            )
        finally:
            regions.release(pin[0])
        if got is None:
            return None
        if type(got) is int:
            return Transfer.finished(op, self.name, got, posted_at, None)
        return Transfer.finished(op, self.name, total_bytes(local_a), posted_at, got)

    def _post_small(self, op: Op, local_a: np.ndarray, remote_a: np.ndarray) -> Transfer | None:
        """The latency path of a host transfer of at most SMALL_POST_DESCS
        descriptors a side on a channel that sends requests (tcp): one C call
        (``post_check``) resolves the local descriptors against this agent's
        region table, pinned from here until the transfer finishes as
        ``_post`` pins it, and checks the remote ones against the peer's
        published regions and both totals; then the transfer goes out as
        ``_post`` sends it, with the lists as given rather than coalesced
        (no more remote descriptors than the target takes in one request, so
        it is cut into as many requests as ``_post`` would cut it). None, with
        nothing pinned, when it does not apply or refuses something:
        ``_post`` then takes the full path, which checks again and names the
        error."""
        agent = self.agent
        sizes, flags, devices = self._table
        if (
            agent._closed
            or self._closed_error is not None
            or self._channel.error is not None
            or agent.verify
            or devices is not None  # the peer has GPU regions: the full path sorts them out
            or len(local_a) > SMALL_POST_DESCS
            or len(remote_a) > SMALL_POST_DESCS
            or len(remote_a) > self._channel.link.max_descs  # one request, as the full path would send
            or local_a.dtype is not DESC_DTYPE
            or remote_a.dtype is not DESC_DTYPE
            or not local_a.flags.c_contiguous
            or not remote_a.flags.c_contiguous
        ):
            return None
        reading = op is READ
        need = LOCAL_WRITE | VALID if reading else VALID
        regions = agent._regions
        # Only the regions named: a peer slow to answer holds back no other's deregistration.
        pin = regions.pin_table(local_a["region"].tolist())
        try:
            got = _io.post_check(
                local_a,
                pin[1],
                pin[2],
                pin[3],
                need,
                need | DEVICE,  # host memory only
                remote_a,
                sizes,
                flags,
                (REMOTE_READ if reading else REMOTE_WRITE) | VALID,
                min(agent.limits.max_transfer_bytes, _U64_MAX),
            )
            transfer = None if got is None else self._start(op, got[2], 0, pin[0])
        except BaseException:
            regions.release(pin[0])
            raise
        if transfer is None or got is None:
            regions.release(pin[0])
            return None
        try:
            self._channel.post(transfer, op, got[0], got[1], got[2], remote_a, None, -1, -1, False)
        except BaseException as exc:
            transfer.fail_unposted(exc)  # releases its slot and its hold on the regions
            raise
        return transfer

    def _check_verify(self, remote: np.ndarray, local_device: int, remote_device: int) -> None:
        if local_device >= 0 or remote_device >= 0:
            raise ConfigError("verify=True covers host memory only; this transfer touches GPU memory")
        limit = self._channel.link.max_descs
        if len(remote) > limit:
            raise LimitError(
                f"verify=True: {len(remote)} remote descriptors; peer {self.name!r} checks at most {limit} "
                "in one transfer (its Limits.max_descs_per_message)"
            )
        if not _checksum.available():
            raise ConfigError(f"verify=True needs the crc32c package: {_checksum.EXTRA}")

    def _verifier(
        self, addrs: Any, lens: Any, remote: np.ndarray, notify: bytes | None
    ) -> Callable[[Transfer], None]:
        """The trailing part of a verified transfer: once its bytes moved,
        the checksums of this side go to the peer with the notification."""
        link = self._channel.link

        def verify(transfer: Transfer) -> None:
            try:
                sums = _checksum.segments(addrs, lens, remote["length"])
            except BaseException as exc:  # the part must finish, or the transfer never does
                transfer.part_finished(exc)
                return
            link.verify(transfer, remote, sums, notify)

        return verify

    def _start(self, op: Op, nbytes: int, parts: int, token: int | None) -> Transfer:
        timeout_s = self.agent.timeouts.transfer_s
        limit = self.agent.limits.max_inflight_per_peer
        with self._slots:
            if self._inflight >= limit and not self._slots.wait_for(
                lambda: self._inflight < limit, timeout_s
            ):
                raise TimeoutError(
                    f"{limit} transfers to peer {self.name!r} still in flight after "
                    f"{timeout_s}s (Limits.max_inflight_per_peer)"
                )
            self._inflight += 1
        transfer = Transfer(op, self.name, nbytes, parts, timeout_s)
        transfer._cleanup = lambda: self._finished(token)
        return transfer

    def _finished(self, token: int | None) -> None:
        if token is not None:
            self.agent._regions.release(token)
        with self._slots:
            self._inflight -= 1
            self._slots.notify()  # no-op without waiters

    def _check_remote(self, descs: np.ndarray, need: int, op: Op) -> tuple[int, bool]:
        """Check remote descriptors against the published regions: (CUDA device
        of the memory they name or -1 for host memory, CUDA IPC possible)."""
        sizes, flags, devices = self._table
        check_descs(descs, flags, sizes, need, lambda: f"peer {self.name!r} {op.value}")
        if devices is None:
            return -1, False
        ids = descs["region"]
        device = one_device(devices[ids], f"peer {self.name!r} {op.value}")
        return device, bool(device >= 0 and (flags[ids] & REMOTE_IPC).all())

    def close(self) -> None:
        self.agent.remove_peer(self.name)

    def _close(self, error: Exception) -> None:
        if self._closed_error is None:
            self._closed_error = error
        self._channel.close()
