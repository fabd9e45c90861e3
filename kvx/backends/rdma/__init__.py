"""The rdma backend: one-sided READ and WRITE through a NIC, no remote CPU.

Bytes move through libfabric (``kvx._fabric``, wrapped by ``fabric.py``):
EFA or verbs (InfiniBand, RoCE) on hardware, and its ``tcp;ofi_rxm``
provider, which does real one-sided RMA between processes over sockets, in
CI. Like shm, the initiator moves the bytes itself once the target has
checked and pinned the regions over the authenticated control connection
(``SHM_PIN`` with ``PIN_RDMA``, leases with ``PIN_KEEP``); the pin's answer
carries each region's key, which never goes through the metadata service.

Every region is registered with the agent's endpoint (local access always,
remote read and write as the region allows). ``deregister`` waits for the
pins and leases on a region like it does for shm, then closes its
registration before it returns: from then on no peer can touch the range,
whatever key it kept.

Connecting is one exchange on the control link (RDMA_CONNECT): the
initiator sends its endpoint's connection info, the target completes its
side and answers with its own. The target forgets the peer when that
control connection ends.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.backends.base import Backend, BackendContext, Channel, Unreachable, same_host
from kvx.backends.control import wire as _wire
from kvx.backends.control.link import Link
from kvx.backends.control.serve import Fatal, Handler, InboundConnection
from kvx.backends.control.sock import recv_exact
from kvx.backends.control.wire import MsgType
from kvx.backends.rdma.copy import RdmaCopy, post_error
from kvx.backends.tcp import TcpChannel
from kvx.errors import (
    AccessError,
    ClosedError,
    ConfigError,
    KvxError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
)
from kvx.memory import MemoryKind
from kvx.transfer import Op, Transfer
from kvx.v1 import agent_pb2

if TYPE_CHECKING:
    from kvx.memory import Region

logger = logging.getLogger(__name__)

# Which libfabric provider the endpoint opens, e.g. "tcp;ofi_rxm", "efa", "verbs;ofi_rxm".
PROVIDER_ENV = "KVX_RDMA_PROVIDER"
# Under backend="auto" without KVX_RDMA_PROVIDER: only these, best first. The
# tcp provider is never chosen by itself: kvx's own tcp backend is faster.
HARDWARE_PROVIDERS = ("efa", "verbs;ofi_rxm")
SOFTWARE_PROVIDER = "tcp;ofi_rxm"
# Providers whose endpoint is first opened asking for GPU memory registration.
HMEM_PROVIDERS = ("efa", "verbs")

# The connect exchange (wire.py): kvx's own types, as a built-in backend's.
RDMA_CONNECT = MsgType.RDMA_CONNECT
RDMA_CONNECT_OK = MsgType.RDMA_CONNECT_OK
CONNECT_VERSION = 1
_CONNECT = struct.Struct("<BBH")  # version, flags, length of the endpoint's info that follows
MAX_INFO_BYTES = 1024
FLAG_GPU = 1  # (answer) this agent registers its CUDA memory with the NIC

# Transfers up to this size go through the regions' leases on the posting
# thread (no pin round trip); larger ones in parts on the connections' threads.
INLINE_COPY_BYTES = 4 << 20
# Failed posts in a row after which a peer's transfers go over tcp instead.
FAILURES_BEFORE_FALLBACK = 3


def load_fabric() -> tuple[Any, str | None]:
    """(the fabric module, None), or (None, why it cannot be used)."""
    try:
        fabric = importlib.import_module("kvx.backends.rdma.fabric")
    except ImportError as exc:
        return None, f"kvx was installed without the rdma backend's fabric layer ({exc})"
    why = fabric.available()
    return (fabric, None) if why is None else (None, why)


def _core(provider: str) -> str:
    return provider.split(";")[0]


def open_endpoint(setting: str) -> tuple[Any, str]:
    """The agent's endpoint and "", or (None, why none); raises ConfigError
    where the agent is set to rdma and cannot have one."""
    if setting not in ("auto", "rdma"):
        return None, f"this agent's backend setting is {setting!r}"
    forced = setting == "rdma"
    fab, why = load_fabric()
    if fab is None:
        if forced:
            raise ConfigError(f"backend='rdma' needs libfabric: {why}")
        return None, why or ""
    explicit = os.environ.get(PROVIDER_ENV, "").strip()
    if explicit:
        candidates = [explicit]
    else:
        try:
            have = {_core(info.provider) for info in fab.providers()}
        except Exception as exc:  # a broken libfabric install: say so, use tcp
            have = set()
            logger.warning("listing libfabric providers failed: %s", exc)
        candidates = [p for p in HARDWARE_PROVIDERS if _core(p) in have]
        if forced and not candidates:
            candidates = [SOFTWARE_PROVIDER]
        if not candidates:
            return None, (
                f"libfabric finds no RDMA hardware provider ({', '.join(HARDWARE_PROVIDERS)}); "
                f"set {PROVIDER_ENV} to use another"
            )
    failures = []
    for provider in candidates:
        # GPU memory registration (FI_HMEM) where the NIC may offer it; without, where it does not.
        for hmem in (True, False) if _core(provider) in HMEM_PROVIDERS else (False,):
            try:
                return fab.Endpoint(provider=provider, hmem=hmem), ""
            except Exception as exc:
                failures.append(f"{provider}{' with GPU memory' if hmem else ''}: {exc}")
    why = f"no rdma endpoint could be opened ({'; '.join(failures)})"
    if forced or explicit:
        raise ConfigError(f"{why}; check {PROVIDER_ENV} and the provider's devices (kvx doctor)")
    logger.warning("%s; peers on other hosts will use tcp", why)
    return None, why


def pack_connect(flags: int, info: bytes) -> bytes:
    if len(info) > MAX_INFO_BYTES:
        raise ConfigError(f"the endpoint's connection info is {len(info)} bytes; at most {MAX_INFO_BYTES}")
    return _CONNECT.pack(CONNECT_VERSION, flags, len(info)) + info


def parse_connect(payload: bytes, peer: str) -> tuple[int, bytes]:
    """(flags, the peer endpoint's info) of a connect message; ProtocolError
    when it is not one."""
    if len(payload) < _CONNECT.size:
        raise ProtocolError(f"peer {peer!r} sent a {len(payload)}-byte rdma connect message")
    version, flags, length = _CONNECT.unpack_from(payload)
    if version != CONNECT_VERSION:
        raise ProtocolError(
            f"peer {peer!r} speaks rdma connect version {version}, this agent {CONNECT_VERSION}"
        )
    if flags & ~FLAG_GPU or not 0 < length <= MAX_INFO_BYTES or len(payload) != _CONNECT.size + length:
        raise ProtocolError(f"peer {peer!r} sent a malformed rdma connect message")
    return flags, payload[_CONNECT.size :]


class RdmaBackend(Backend):
    name = "rdma"
    priority = 5  # below the same-host backends (shm 10, cuda_ipc 20), above tcp
    stages_gpu = True  # GPU memory the NIC cannot register goes over tcp, staged

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.ep, self.why_not = open_endpoint(ctx.setting)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._posts = 0  # ep.post calls running: close() waits for them
        self._mrs: dict[int, Any] = {}
        self._inbound: dict[InboundConnection, int] = {}  # connections that connected, their fabric peer
        self._gpu_registered = 0
        self._gpu_failed: str | None = None
        if self.ep is not None:
            logger.info(
                "agent %s: rdma endpoint on %s (fabric %s, domain %s)",
                ctx.agent_name,
                self.ep.provider,
                self.ep.fabric,
                self.ep.domain,
            )

    @property
    def provider(self) -> str:
        return self.ep.provider if self.ep is not None else ""

    @property
    def registers_gpu(self) -> bool:
        """Every CUDA region registered so far got a memory registration."""
        return self._gpu_registered > 0 and self._gpu_failed is None

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        if self.ep is not None and not self._closed:
            # The provider's name only: the endpoint's address goes over the authenticated link.
            md.endpoints.add(backend=agent_pb2.BACKEND_RDMA, address=self.ep.provider)

    # Memory.

    def registered(self, region: Region) -> None:
        ep = self.ep
        if ep is None:
            return
        cuda = region.memory_kind is MemoryKind.CUDA
        try:
            mr = ep.register(
                region.address,
                region.size_bytes,
                remote_read=region.remote_read,
                remote_write=region.remote_write,
                device=region.device if cuda else -1,
            )
        except Exception as exc:
            if cuda:
                with self._lock:
                    self._gpu_failed = str(exc)
                logger.warning(
                    "agent %s: %s cannot register CUDA region %d (%s); transfers on GPU memory go over "
                    "tcp, staged through pinned host buffers",
                    self.ctx.agent_name,
                    ep.provider,
                    region.id,
                    exc,
                )
                return
            raise ConfigError(
                f"cannot register region {region.id} ({region.size_bytes} bytes) with the rdma endpoint "
                f"({ep.provider}): {exc}; if the locked-memory limit is low, raise it (ulimit -l "
                "unlimited; docker: --ulimit memlock=-1)"
            ) from exc
        with self._lock:
            if self._closed:
                mr.close()
                return
            self._mrs[region.id] = mr
            self._gpu_registered += cuda
        if region.remote_read or region.remote_write:
            self.ctx.regions.set_remote_key(region.id, mr.key)

    def deregistered(self, region: Region) -> None:
        with self._lock:
            mr = self._mrs.pop(region.id, None)
            if mr is not None and region.memory_kind is MemoryKind.CUDA:
                self._gpu_registered -= 1
        if mr is not None:
            mr.close()  # from here on no peer reaches the range, whatever key it kept

    # The target's side of the connect exchange.

    def handlers(self) -> dict[int, Handler]:
        return {RDMA_CONNECT: self._on_connect}

    def _on_connect(
        self, conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int
    ) -> None:
        if aux or data_len or payload_len > _CONNECT.size + MAX_INFO_BYTES:
            # Refused before a byte of it is read: the connection ends, the agent serves on.
            raise Fatal(
                ProtocolError(
                    f"RDMA_CONNECT carries at most {_CONNECT.size + MAX_INFO_BYTES} bytes of endpoint "
                    f"info and no data, not {payload_len} and {data_len}"
                ),
                request_id,
            )
        payload = bytes(recv_exact(conn.sock, payload_len))
        ep = self.ep
        if ep is None:
            conn.send_error(
                request_id, AccessError(f"agent {self.ctx.agent_name!r} offers no rdma: {self.why_not}")
            )
            return
        try:
            _, info = parse_connect(payload, conn.peer_name)
        except ProtocolError as exc:
            raise Fatal(exc, request_id) from None
        with self._lock:
            if conn in self._inbound:
                raise Fatal(ProtocolError("a second RDMA_CONNECT on one connection"), request_id)
            if self._closed:
                raise PeerLostError("the agent is closing")
        try:
            half, mine = ep.prepare()
            fabric_peer = ep.complete(half, info)
        except ValueError as exc:  # the peer's info: bad, short or oversized
            raise Fatal(ProtocolError(f"malformed rdma endpoint info: {exc}"), request_id) from None
        except Exception as exc:  # the fabric failed: the initiator falls back to tcp
            conn.send_error(request_id, AccessError(f"rdma endpoint ({ep.provider}) failed: {exc}"))
            return
        with self._lock:
            self._inbound[conn] = fabric_peer
        conn.when_closed(lambda: self._forget(conn))
        answer = pack_connect(FLAG_GPU if self.registers_gpu else 0, mine)
        try:
            conn.sock.sendall(_wire.pack(RDMA_CONNECT_OK, request_id, payload_len=len(answer)) + answer)
        except OSError:
            raise PeerLostError("connection lost while answering RDMA_CONNECT") from None

    def _forget(self, conn: InboundConnection) -> None:
        with self._lock:
            fabric_peer = self._inbound.pop(conn, None)
            if fabric_peer is None or self._closed:
                return
        self._disconnect(fabric_peer)

    def _disconnect(self, fabric_peer: int) -> None:
        with self._lock:
            if self._closed or self.ep is None:
                return  # ep.close() forgets every peer
            self._posts += 1  # the endpoint stays open until it returns
        try:
            self.ep.disconnect(fabric_peer)
        except Exception as exc:
            logger.warning("forgetting rdma peer %d failed: %s", fabric_peer, exc)
        finally:
            self._post_ended()

    # The initiator's side.

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        if self.ep is None:
            return f"this agent offers no rdma: {self.why_not}", ""
        theirs = [e.address for e in md.endpoints if e.backend == agent_pb2.BACKEND_RDMA]
        if not theirs:
            return (
                f"peer {md.name!r} does not offer rdma (no RDMA provider there, a backend setting other "
                f"than auto or rdma, or a kvx built without libfabric)"
            ), ""
        if theirs[0] != self.ep.provider:
            return (
                f"peer {md.name!r} offers rdma over {theirs[0]}, this agent over {self.ep.provider}; "
                f"set {PROVIDER_ENV} alike on both"
            ), ""
        where = "this host" if same_host(md) else f"another host ({md.host_name or 'unknown'})"
        return None, f"peer {md.name!r} on {where} and this agent offer rdma over {self.ep.provider}"

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        ep = self.ep
        assert ep is not None  # reach said so
        try:
            half, info = ep.prepare()
            answer = link.request(RDMA_CONNECT, RDMA_CONNECT_OK, pack_connect(0, info))
            flags, theirs = parse_connect(answer, md.name)
            fabric_peer = ep.complete(half, theirs)
        except Exception as exc:
            if not link.alive:
                raise  # the control connection broke: no backend can use it
            why = f"the rdma connect exchange with peer {md.name!r} failed ({exc})"
            logger.warning("%s; it is not used for this peer", why)
            raise Unreachable(why) from exc
        link.when_closed(lambda: self._disconnect(fabric_peer))
        channel = RdmaChannel(link, self, fabric_peer, remote_gpu=bool(flags & FLAG_GPU))
        gpu = (
            ""
            if flags & FLAG_GPU
            else "; its GPU memory, if any, goes over tcp (not registered with its NIC)"
        )
        return channel, f"; one-sided READ and WRITE through this agent's endpoint{gpu}"

    def run_post(self, fabric_peer: int, op: int, *arrays: np.ndarray, timeout_ms: int) -> None:
        """``ep.post``, kept from overlapping ``close``."""
        with self._lock:
            if self._closed or self.ep is None:
                raise ClosedError(f"agent {self.ctx.agent_name!r} was closed")
            self._posts += 1
        try:
            self.ep.post(op, fabric_peer, *arrays, timeout_ms)
        finally:
            self._post_ended()

    def _post_ended(self) -> None:
        with self._lock:
            self._posts -= 1
            if not self._posts:
                self._idle.notify_all()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Posts end by their own timeout at the latest; the endpoint is freed only after them.
            idle = self._idle.wait_for(lambda: not self._posts, self.ctx.timeouts.close_s)
            mrs, self._mrs = list(self._mrs.values()), {}
            self._inbound.clear()
        ep = self.ep
        if ep is None:
            return
        if not idle:
            logger.warning(
                "agent %s: rdma posts still running after %gs; the endpoint is left open",
                self.ctx.agent_name,
                self.ctx.timeouts.close_s,
            )
            return
        for mr in mrs:
            try:
                mr.close()
            except Exception as exc:
                logger.warning("closing a memory registration failed: %s", exc)
        ep.close()


class RdmaChannel(Channel):
    """Host memory (and GPU memory both NICs registered) through the NIC;
    anything else over tcp on the same link, and everything once the fabric
    has failed for this peer."""

    def __init__(self, link: Link, backend: RdmaBackend, fabric_peer: int, *, remote_gpu: bool) -> None:
        super().__init__(link)
        self.tcp = TcpChannel(link)
        self.backend = backend
        self.fabric_peer = fabric_peer
        self.remote_gpu = remote_gpu
        assert backend.ep is not None
        self.virt_addr = bool(backend.ep.virt_addr)
        self.timeout_ms = backend.ctx.io_ms
        self._lock = threading.Lock()
        self._failures = 0
        self.fallback: str | None = None  # why this peer's transfers go over tcp now

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
        if (
            self.fallback is not None
            or (local_device >= 0 and not self.backend.registers_gpu)
            or (remote_device >= 0 and not self.remote_gpu)
        ):
            self.tcp.post(
                transfer, op, local_addrs, local_lens, total, remote, notify, local_device, remote_device
            )
            return
        link, peer = self._link, self._link.peer
        make_copy: Any = lambda *part: RdmaCopy(self, op, peer, *part)  # noqa: E731
        if total > INLINE_COPY_BYTES:  # posted in parts on the connections' threads
            link.post_pinned(
                transfer, op, local_addrs, local_lens, total, remote, notify, _wire.PIN_RDMA, make_copy
            )
        elif not link.copy_leased(transfer, op, local_addrs, local_lens, remote, notify, make_copy):
            # The first transfer on these regions: the target leases them (and their keys) to us.
            link.post_pinned(
                transfer,
                op,
                local_addrs,
                local_lens,
                total,
                remote,
                notify,
                _wire.PIN_RDMA,
                make_copy,
                keep=True,
            )

    def run(self, op: int, *arrays: np.ndarray) -> None:
        """Post one part's work requests and wait for them (RdmaCopy.move)."""
        try:
            self.backend.run_post(self.fabric_peer, op, *arrays, timeout_ms=self.timeout_ms)
        except Exception as exc:
            error = post_error(exc, op, self.link.peer, self.timeout_ms)
            if isinstance(error, TimeoutError):
                # The peer hangs, and the bytes of a READ that timed out may still land: the
                # link ends (as a stalled tcp connection does) and the fabric peer is forgotten.
                self.link.fail(error)
            elif not isinstance(error, (ClosedError, PeerLostError)):
                self._failed(error)
            raise error from exc
        if self._failures:
            with self._lock:
                self._failures = 0

    def _failed(self, error: KvxError) -> None:
        with self._lock:
            self._failures += 1
            if self._failures < FAILURES_BEFORE_FALLBACK or self.fallback is not None or not self.alive:
                return
            self.fallback = f"{self._failures} rdma posts in a row failed, the last with: {error}"
        logger.warning("peer %s: %s; its transfers go over tcp from now on", self.link.peer, self.fallback)
