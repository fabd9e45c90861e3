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
whatever key it kept. On software providers (``tcp;ofi_rxm``, where
``ep.mr_close_is_final`` is False) a READ or WRITE a peer already started
keeps moving bytes after the registration is closed, so when the region's
keys ever went out in a pin's answer the rails' endpoints are reset as well
(``Endpoint.reset``: every connection to them ends) before ``deregister``
returns, and each connected initiator is told (RDMA_RESET) so that it
connects that rail again. An initiator whose post timed out resets its own
endpoint the same way, so that no byte of the READ it gave up on lands later.

Connecting is one exchange on the control link (RDMA_CONNECT): the
initiator sends its endpoint's connection info, the target completes its
side and answers with its own. The target forgets the peer when that
control connection ends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.backends.base import Backend, BackendContext, Channel, Unreachable, same_host
from kvx.backends.control import wire as _wire
from kvx.backends.control.link import Link
from kvx.backends.control.serve import Fatal, Handler, InboundConnection
from kvx.backends.control.sock import recv_exact
from kvx.backends.control.wire import MsgType
from kvx.backends.rdma import rails, topology
from kvx.backends.rdma.channel import (
    FAILURES_BEFORE_FALLBACK,
    INLINE_COPY_BYTES,
    RAIL_RETRY_S,
    VERBS,
    RdmaChannel,
)
from kvx.backends.rdma.rails import pack_connect, parse_connect
from kvx.errors import AccessError, ClosedError, ConfigError, PeerLostError, ProtocolError
from kvx.memory import MemoryKind
from kvx.v1 import agent_pb2

if TYPE_CHECKING:
    from kvx.memory import Region

__all__ = [
    "FAILURES_BEFORE_FALLBACK",
    "INLINE_COPY_BYTES",
    "RAIL_RETRY_S",
    "RdmaBackend",
    "RdmaChannel",
    "pack_connect",
    "parse_connect",
]

logger = logging.getLogger(__name__)

# Which provider the endpoints open: "verbs" (kvx._verbs, ibverbs) or a
# libfabric one, e.g. "tcp;ofi_rxm", "efa", "verbs;ofi_rxm".
PROVIDER_ENV = "KVX_RDMA_PROVIDER"
# Under backend="auto" without KVX_RDMA_PROVIDER: only these, best first
# ("verbs" is kvx._verbs, the others libfabric's). The tcp provider is never
# chosen by itself: kvx's own tcp backend is faster.
HARDWARE_PROVIDERS = ("efa", VERBS, "verbs;ofi_rxm")
SOFTWARE_PROVIDER = "tcp;ofi_rxm"
# libfabric providers that move bytes through the kernel's sockets, on a port of their own.
SOFTWARE_CORES = ("tcp", "sockets", "udp")
# Providers whose endpoint is first opened asking for GPU memory registration.
HMEM_PROVIDERS = ("efa", "verbs")
# sysfs and procfs are read under this root (tests build trees there).
SYSFS_ROOT_ENV = "KVX_SYSFS_ROOT"

# The connect exchange (wire.py): kvx's own types, as a built-in backend's.
RDMA_CONNECT = MsgType.RDMA_CONNECT
RDMA_CONNECT_OK = MsgType.RDMA_CONNECT_OK
RDMA_RESET = MsgType.RDMA_RESET


def load_fabric() -> tuple[Any, str | None]:
    """(the fabric module, None), or (None, why it cannot be used)."""
    try:
        fabric = importlib.import_module("kvx.backends.rdma.fabric")
    except ImportError as exc:
        return None, f"kvx was installed without the rdma backend's fabric layer ({exc})"
    why = fabric.available()
    return (fabric, None) if why is None else (None, why)


def load_verbs() -> tuple[Any, str | None]:
    """(the verbs module, None) when kvx._verbs loads and finds an RDMA
    device, or (None, why not)."""
    try:
        verbs = importlib.import_module("kvx.backends.rdma.verbs")
    except ImportError as exc:
        return None, f"kvx was installed without the rdma backend's verbs layer ({exc})"
    why = verbs.available()
    return (verbs, None) if why is None else (None, why)


def _core(provider: str) -> str:
    return provider.split(";")[0]


def rdma_hardware() -> bool:
    """Whether sysfs lists an RDMA device (EFA's too), or a libibverbs library is named.
    Every hardware provider needs one: where there is none, ``auto`` does not load
    libfabric and list its providers (about 0.4 s of every agent's start) to learn so."""
    return bool(
        os.environ.get("KVX_IBVERBS_LIB") or topology.rdma_devices(os.environ.get(SYSFS_ROOT_ENV) or "/")
    )


def _candidates(forced: bool, explicit: str, fab: Any) -> list[str]:
    if explicit:
        return [explicit]
    have: set[str] = set()
    if fab is not None:
        try:
            have = {_core(info.provider) for info in fab.providers()}
        except Exception as exc:  # a broken libfabric install: say so, use the others
            logger.warning("listing libfabric providers failed: %s", exc)
    verbs = None
    # libibverbs is loaded only where sysfs lists an RDMA device (or a library is named):
    # a host without one (most) need not load it, nor its providers, into every agent.
    if rdma_hardware():
        verbs, _ = load_verbs()
    out = [
        p
        for p in HARDWARE_PROVIDERS
        if (p == VERBS and verbs is not None) or (p != VERBS and _core(p) in have)
    ]
    if forced and fab is not None:
        out.append(SOFTWARE_PROVIDER)
    return out


def _open_libfabric(
    fab: Any, provider: str, choice: rails.Choice, pinned: bool, node: str | None
) -> list[Any]:
    listed = []
    if choice.devices:
        try:
            listed = [info.domain for info in fab.providers() if info.provider == provider]
        except Exception:  # listing failed above already, with a warning
            listed = []
    eps: list[Any] = []
    failures = []
    for domain in rails.libfabric_domains(choice, listed, pinned):
        # GPU memory registration (FI_HMEM) where the NIC may offer it; without, where it does not.
        for hmem in (True, False) if _core(provider) in HMEM_PROVIDERS else (False,):
            try:
                eps.append(fab.Endpoint(provider=provider, node=node, domain=domain, hmem=hmem))
                break
            except Exception as exc:
                failures.append(
                    f"{provider}{' on ' + domain if domain else ''}{' with GPU memory' if hmem else ''}: {exc}"
                )
    return _opened(eps, failures, pinned)


def _open_verbs(verbs: Any, choice: rails.Choice, pinned: bool) -> list[Any]:
    eps: list[Any] = []
    failures = []
    for device in choice.devices or (None,):
        name, _, port = (device or "").partition(":")
        try:
            eps.append(verbs.Endpoint(name or None, int(port) if port.isdigit() else 1))
        except Exception as exc:
            failures.append(f"{VERBS} on {device or 'the first device'}: {exc}")
    return _opened(eps, failures, pinned)


def _opened(eps: list[Any], failures: list[str], pinned: bool) -> list[Any]:
    if failures and (pinned or not eps):
        for ep in eps:
            ep.close()
        raise ConfigError("; ".join(failures))
    for failure in failures:
        logger.warning("an rdma rail could not be opened, it is left out: %s", failure)
    return eps


def software_node(provider: str, listen_host: str) -> str | None:
    """Where a software provider's endpoint listens: on the agent's own
    control host, so that an agent listening on loopback (say, one without an
    auth_secret) opens no port on the network. Hardware providers (and an
    agent listening on every address) take the provider's choice."""
    if _core(provider) not in SOFTWARE_CORES or listen_host in ("", "0.0.0.0", "::"):
        return None
    return listen_host


def open_endpoints(setting: str, listen_host: str = "") -> tuple[list[Any], str]:
    """The agent's endpoints, one per rail, and ""; or ([], why none).
    Raises ConfigError where the agent is set to rdma and cannot have one."""
    if setting not in ("auto", "rdma"):
        return [], f"this agent's backend setting is {setting!r}"
    forced = setting == "rdma"
    explicit = os.environ.get(PROVIDER_ENV, "").strip()
    if not forced and not explicit and not rdma_hardware():
        sysfs = os.path.join(os.environ.get(SYSFS_ROOT_ENV) or "/", "sys/class/infiniband")
        return [], f"no RDMA device is listed in {sysfs}; set {PROVIDER_ENV} to use a provider"
    fab, why = load_fabric()
    candidates = _candidates(forced, explicit, fab)
    if fab is None and (not candidates or (explicit and explicit != VERBS)):
        if forced or explicit:
            raise ConfigError(f"backend='rdma' needs libfabric: {why}")
        return [], why or ""
    if not candidates:
        return [], (
            f"no RDMA hardware provider ({', '.join(HARDWARE_PROVIDERS)}) is found; "
            f"set {PROVIDER_ENV} to use another"
        )
    env = os.environ
    pinned = bool(env.get(topology.DEVICES_ENV, "").strip())
    root = env.get(SYSFS_ROOT_ENV) or "/"
    failures = []
    for provider in candidates:
        try:
            choice = rails.choose(root, env, rails.current_gpu_pci())
            if provider == VERBS:
                verbs, why_verbs = load_verbs()
                if verbs is None:
                    raise ConfigError(why_verbs or "")
                eps = _open_verbs(verbs, choice, pinned)
            else:
                eps = _open_libfabric(fab, provider, choice, pinned, software_node(provider, listen_host))
        except ConfigError as exc:
            failures.append(f"{provider}: {exc}" if not str(exc).startswith(provider) else str(exc))
            continue
        logger.info("rdma rails (%s): %s", choice.reason, rails.describe(eps))
        return eps, ""
    why = f"no rdma endpoint could be opened ({'; '.join(failures)})"
    if forced or explicit:
        raise ConfigError(f"{why}; check {PROVIDER_ENV}, {topology.DEVICES_ENV} and the devices (kvx doctor)")
    logger.warning("%s; peers on other hosts will use tcp", why)
    return [], why


class RdmaBackend(Backend):
    name = "rdma"
    priority = 5  # below the same-host backends (shm 10, cuda_ipc 20), above tcp
    stages_gpu = True  # GPU memory the NIC cannot register goes over tcp, staged

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.eps, self.why_not = open_endpoints(ctx.setting, ctx.listen_host)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._posts = 0  # endpoint calls running: close() waits for them
        self._mrs: dict[int, list[Any]] = {}  # region id -> its registration on each rail
        # Connections that connected -> per rail pair (the local rail, its fabric peer).
        # A fabric peer of -1: the endpoint was reset since, the initiator connects again.
        self._inbound: dict[InboundConnection, list[tuple[int, int]]] = {}
        # Per rail its resets so far: fabric peers from an older one are gone.
        self.generations = [0] * len(self.eps)
        self._gpu_registered = 0
        self._gpu_failed: str | None = None
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        if len(self.eps) > 1:  # the slices of a striped transfer run on the rails at once
            self.pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=2 * len(self.eps), thread_name_prefix=f"kvx-rdma-{ctx.agent_name}"
            )
        if self.eps:
            logger.info(
                "agent %s: rdma over %s on %d rail(s): %s",
                ctx.agent_name,
                self.provider,
                len(self.eps),
                rails.describe(self.eps),
            )

    @property
    def ep(self) -> Any:
        """Rail 0's endpoint; None without rdma."""
        return self.eps[0] if self.eps else None

    @ep.setter
    def ep(self, ep: Any) -> None:
        self.eps[0] = ep

    @property
    def provider(self) -> str:
        return self.eps[0].provider if self.eps else ""

    @property
    def registers_gpu(self) -> bool:
        """Every CUDA region registered so far got a memory registration."""
        return self._gpu_registered > 0 and self._gpu_failed is None

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        if self.eps and not self._closed:
            # The provider's name only: the endpoints' addresses go over the authenticated link.
            md.endpoints.add(backend=agent_pb2.BACKEND_RDMA, address=self.provider)

    # Memory.

    def registered(self, region: Region) -> None:
        if not self.eps:
            return
        cuda = region.memory_kind is MemoryKind.CUDA
        mrs: list[Any] = []
        for rail, ep in enumerate(self.eps):  # every region on every rail: any rail may carry its slices
            try:
                mrs.append(
                    ep.register(
                        region.address,
                        region.size_bytes,
                        remote_read=region.remote_read,
                        remote_write=region.remote_write,
                        device=region.device if cuda else -1,
                    )
                )
            except Exception as exc:
                for mr in mrs:
                    mr.close()
                self._register_failed(region, rail, ep, exc)
                return
        with self._lock:
            if self._closed:
                for mr in mrs:
                    mr.close()
                return
            self._mrs[region.id] = mrs
            self._gpu_registered += cuda
        if region.remote_read or region.remote_write:
            self.ctx.regions.set_remote_keys(region.id, [mr.key for mr in mrs])

    def _register_failed(self, region: Region, rail: int, ep: Any, exc: Exception) -> None:
        where = f"{ep.provider} on {ep.domain} (rail {rail})"
        if region.memory_kind is MemoryKind.CUDA:
            with self._lock:
                self._gpu_failed = str(exc)
            logger.warning(
                "agent %s: %s cannot register CUDA region %d (%s); transfers on GPU memory go over "
                "tcp, staged through pinned host buffers",
                self.ctx.agent_name,
                where,
                region.id,
                exc,
            )
            return
        raise ConfigError(
            f"cannot register region {region.id} ({region.size_bytes} bytes) with the rdma endpoint "
            f"{where}: {exc}; if the locked-memory limit is low, raise it (ulimit -l "
            "unlimited; docker: --ulimit memlock=-1)"
        ) from exc

    def deregistered(self, region: Region) -> None:
        with self._lock:
            mrs = self._mrs.pop(region.id, None)
            if mrs is not None and region.memory_kind is MemoryKind.CUDA:
                self._gpu_registered -= 1
        keys_out = mrs is not None and self.ctx.regions.take_keys_out(region.id)
        for rail, mr in enumerate(mrs or ()):
            if keys_out and not getattr(self.eps[rail], "mr_close_is_final", True):
                # An access a peer started keeps moving bytes on software providers, also
                # after the registration closed: the reset ends the connections, then
                # closes the registration (in that order: the provider must not meet a
                # registration closed under a live transfer).
                self.reset_rail(rail, f"region {region.id} was deregistered", drop=[mr])
            else:
                mr.close()  # from here on no peer can start an access to the range, whatever key it kept

    def reset_rail(self, rail: int, reason: str, drop: Sequence[Any] = ()) -> None:
        """Reset rail ``rail``'s endpoint where closing a registration (or giving
        up on a post) does not stop the bytes already moving; tell the initiators
        connected to it. Returns once no byte moves through its old connections.
        ``drop``: registrations of that rail to close with the reset."""
        ep = self.eps[rail]
        if getattr(ep, "mr_close_is_final", True):
            for mr in drop:
                mr.close()
            return  # the NIC stops them itself
        with self._lock:
            closed = self._closed
            if not closed:
                self._posts += 1  # the endpoint stays open until the reset returns
                self.generations[rail] += 1
        if closed:
            for mr in drop:
                with contextlib.suppress(Exception):
                    mr.close()
            return  # ep.close() stops them
        try:
            ep.reset(reason, drop)
        except Exception as exc:
            # Fail safe: whatever went wrong (the provider did not open again,
            # callers did not leave in time), close the endpoint, so nothing
            # moves through it any more; the rail's peers go down and fall back.
            logger.error(
                "agent %s: resetting rdma rail %d failed (%s); the rail is closed",
                self.ctx.agent_name,
                rail,
                exc,
            )
            with contextlib.suppress(Exception):
                ep.close()
        finally:
            self._post_ended()
        notices: list[tuple[InboundConnection, int]] = []
        with self._lock:
            for conn, pairs in self._inbound.items():
                for index, (local, _) in enumerate(pairs):
                    if local == rail:
                        pairs[index] = (rail, -1)  # its number died with the old endpoint
                        notices.append((conn, index))
        for conn, index in notices:
            conn.send_oneway(_wire.pack(RDMA_RESET, 0, aux=index))

    # The target's side of the connect exchange.

    def handlers(self) -> dict[int, Handler]:
        return {RDMA_CONNECT: self._on_connect}

    def _on_connect(
        self, conn: InboundConnection, request_id: int, payload_len: int, aux: int, data_len: int
    ) -> None:
        if aux or data_len or payload_len > rails.MAX_CONNECT_BYTES:
            # Refused before a byte of it is read: the connection ends, the agent serves on.
            raise Fatal(
                ProtocolError(
                    f"RDMA_CONNECT carries at most {rails.MAX_CONNECT_BYTES} bytes of endpoint "
                    f"info and no data, not {payload_len} and {data_len}"
                ),
                request_id,
            )
        payload = bytes(recv_exact(conn.sock, payload_len))
        if not self.eps:
            conn.send_error(
                request_id, AccessError(f"agent {self.ctx.agent_name!r} offers no rdma: {self.why_not}")
            )
            return
        try:
            msg = rails.parse_connect(payload, conn.peer_name)
        except ProtocolError as exc:
            raise Fatal(exc, request_id) from None
        again = bool(msg.flags & rails.FLAG_RECONNECT)
        with self._lock:
            pairs = self._inbound.get(conn)
            if self._closed:
                raise PeerLostError("the agent is closing")
            if pairs is not None and not again:
                raise Fatal(ProtocolError("a second RDMA_CONNECT on one connection"), request_id)
            if again and (pairs is None or len(msg.infos) != 1 or msg.first >= len(pairs)):
                raise Fatal(ProtocolError("an rdma reconnect names a rail pair never connected"), request_id)
            if not again and (msg.first or len(msg.infos) != msg.rails):
                raise Fatal(ProtocolError("an rdma connect must carry one info per rail"), request_id)
        done: list[tuple[int, int]] = []
        mine: list[bytes] = []
        for i, info in enumerate(msg.infos):
            rail = topology.peer_rail(msg.first + i, len(self.eps))
            ep = self.eps[rail]
            prepared = False
            try:
                half, ours = ep.prepare()
                prepared = True
                done.append((rail, ep.complete(half, info)))
                mine.append(ours)
            except Exception as exc:
                self._disconnect_all(done)
                if prepared and isinstance(exc, ValueError):  # the peer's info: bad, short or oversized
                    raise Fatal(ProtocolError(f"malformed rdma endpoint info: {exc}"), request_id) from None
                # The fabric failed: the initiator falls back to tcp (or keeps the rail down).
                conn.send_error(
                    request_id,
                    AccessError(f"rdma endpoint {ep.provider} on {ep.domain} (rail {rail}) failed: {exc}"),
                )
                return
        replaced = (0, -1)
        with self._lock:
            if again:
                assert pairs is not None
                replaced, pairs[msg.first] = pairs[msg.first], done[0]
            else:
                self._inbound[conn] = done
        if again:
            # Only now, and once: a reconnect that failed above left the old
            # number in place, to be disconnected with its connection. (Its
            # number may be shared with another user of the same address.)
            self._disconnect(*replaced)
        else:
            conn.when_closed(lambda: self._forget(conn))
        flags = rails.FLAG_GPU if self.registers_gpu else 0
        answer = rails.pack_connect(flags, len(self.eps), mine, msg.first)
        try:
            conn.sock.sendall(_wire.pack(RDMA_CONNECT_OK, request_id, payload_len=len(answer)) + answer)
        except OSError:
            raise PeerLostError("connection lost while answering RDMA_CONNECT") from None

    def _forget(self, conn: InboundConnection) -> None:
        with self._lock:
            pairs = self._inbound.pop(conn, None)
            if pairs is None or self._closed:
                return
        self._disconnect_all(pairs)

    def _disconnect_all(self, pairs: list[tuple[int, int]]) -> None:
        for rail, fabric_peer in pairs:
            self._disconnect(rail, fabric_peer)

    def _disconnect(self, rail: int, fabric_peer: int) -> None:
        with self._lock:
            if self._closed or not self.eps or fabric_peer < 0:
                return  # ep.close() forgets every peer
            self._posts += 1  # the endpoint stays open until it returns
        try:
            self.eps[rail].disconnect(fabric_peer)
        except Exception as exc:
            logger.warning("forgetting rdma peer %d on rail %d failed: %s", fabric_peer, rail, exc)
        finally:
            self._post_ended()

    # The initiator's side.

    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        if not self.eps:
            return f"this agent offers no rdma: {self.why_not}", ""
        theirs = [e.address for e in md.endpoints if e.backend == agent_pb2.BACKEND_RDMA]
        if not theirs:
            return (
                f"peer {md.name!r} does not offer rdma (no RDMA provider there, a backend setting other "
                f"than auto or rdma, or a kvx built without libfabric)"
            ), ""
        if theirs[0] != self.provider:
            return (
                f"peer {md.name!r} offers rdma over {theirs[0]}, this agent over {self.provider}; "
                f"set {PROVIDER_ENV} alike on both"
            ), ""
        where = "this host" if same_host(md) else f"another host ({md.host_name or 'unknown'})"
        return None, f"peer {md.name!r} on {where} and this agent offer rdma over {self.provider}"

    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        assert self.eps  # reach said so
        fabric_peers: list[int] = []
        try:
            halves, infos = zip(*(ep.prepare() for ep in self.eps), strict=True)
            request = rails.pack_connect(0, len(self.eps), infos)
            answer = rails.parse_connect(link.request(RDMA_CONNECT, RDMA_CONNECT_OK, request), md.name)
            if answer.first or len(answer.infos) != len(self.eps) or answer.flags & rails.FLAG_RECONNECT:
                raise ProtocolError(f"peer {md.name!r} answered rdma connect for other rails than asked")
            for ep, half, info in zip(self.eps, halves, answer.infos, strict=True):
                fabric_peers.append(ep.complete(half, info))
        except Exception as exc:
            for rail, fabric_peer in enumerate(fabric_peers):
                self._disconnect(rail, fabric_peer)
            if not link.alive:
                raise  # the control connection broke: no backend can use it
            why = f"the rdma connect exchange with peer {md.name!r} failed ({exc})"
            logger.warning("%s; it is not used for this peer", why)
            raise Unreachable(why) from exc
        channel = RdmaChannel(
            link,
            self,
            fabric_peers,
            remote_rails=answer.rails,
            remote_gpu=bool(answer.flags & rails.FLAG_GPU),
        )
        link.when_closed(channel.disconnect)
        link.hook_peer_reset(channel.peer_reset)
        gpu = (
            ""
            if answer.flags & rails.FLAG_GPU
            else "; its GPU memory, if any, goes over tcp (not registered with its NIC)"
        )
        lanes = (
            f" on {len(self.eps)} rail(s) to its {answer.rails}"
            if max(len(self.eps), answer.rails) > 1
            else ""
        )
        return channel, f"; one-sided READ and WRITE through this agent's endpoint{lanes}{gpu}"

    def reconnect(self, link: Link, rail: int, old_peer: int) -> int:
        """Connect rail pair ``rail`` with the peer again (a new RDMA_CONNECT
        for that pair over the same link); returns the new fabric peer.
        ``old_peer`` -1: the old one died with a reset of this endpoint. The
        old one is disconnected only once the new one is connected: when
        connecting fails the caller keeps it, and disconnects it once, with
        its channel (another user of the same address keeps its own)."""
        ep = self.eps[rail]
        half, info = ep.prepare()
        request = rails.pack_connect(rails.FLAG_RECONNECT, len(self.eps), [info], rail)
        answer = rails.parse_connect(link.ask(RDMA_CONNECT, request), link.peer)
        if answer.first != rail or len(answer.infos) != 1:
            raise ProtocolError(f"peer {link.peer!r} answered an rdma reconnect of rail {rail} for another")
        new_peer = int(ep.complete(half, answer.infos[0]))
        self._disconnect(rail, old_peer)  # its QP (or address) is gone for good
        return new_peer

    def run_post(self, rail: int, fabric_peer: int, op: int, *arrays: np.ndarray, timeout_ms: int) -> None:
        """``ep.post`` on a rail, kept from overlapping ``close``."""
        with self._lock:
            if self._closed or not self.eps:
                raise ClosedError(f"agent {self.ctx.agent_name!r} was closed")
            self._posts += 1
        try:
            self.eps[rail].post(op, fabric_peer, *arrays, timeout_ms)
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
            # Posts end by their own timeout at the latest; the endpoints are freed only after them.
            idle = self._idle.wait_for(lambda: not self._posts, self.ctx.timeouts.close_s)
            mrs, self._mrs = [mr for group in self._mrs.values() for mr in group], {}
            self._inbound.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=idle)
        if not self.eps:
            return
        if not idle:
            logger.warning(
                "agent %s: rdma posts still running after %gs; the endpoints are left open",
                self.ctx.agent_name,
                self.ctx.timeouts.close_s,
            )
            return
        for mr in mrs:
            try:
                mr.close()
            except Exception as exc:
                logger.warning("closing a memory registration failed: %s", exc)
        for ep in self.eps:
            ep.close()
