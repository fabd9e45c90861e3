"""One-sided READ and WRITE through kvx's posting layer (the C extension ``kvx._fabric``).

The rdma backend uses this module only; it turns the extension's errors into
kvx errors. The extension is built only where libfabric's headers are found
(Debian: ``libfabric-dev``; at run time ``libfabric1``); elsewhere
:func:`available` says why not and kvx works as before.

Design
------
The C side is one small posting interface (``csrc/kvx_post.h``): a provider
is a table of functions (open, register, prepare/complete/disconnect a peer,
post one work request = a local gather plus one remote range, poll
completions, cancel). Two providers exist:

* ``ofi`` (``csrc/kvx_post_ofi.c``): libfabric, ``FI_EP_RDM`` with
  ``FI_RMA`` (``tcp;ofi_rxm`` anywhere, ``efa``, ``verbs;ofi_rxm``). It asks
  for ``FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_ENDPOINT``
  and handles what is granted (descriptors, virtual or offset addressing,
  ``fi_mr_bind`` + ``fi_mr_enable``). It asks without ``FI_MR_PROV_KEY``
  first, so that keys are kvx's own: each is 64 bits from getrandom, since
  with offset addressing a key is all a process that reaches the libfabric
  port must guess. Providers that pick keys themselves get them on a second
  try. Writes ask for ``FI_DELIVERY_COMPLETE``: a WRITE completes when its
  bytes are in the target's memory, and a refused write is an error.
* ``null`` (``csrc/kvx_post_null.c``): moves no data and completes every
  work request at once. It measures the engine's posting and polling cost
  per work request (``benchmarks/rdma_post_rate.py``) and tests how chains
  are built (:meth:`Endpoint.counters`).

A verbs provider fits the same table in a file of its own. The engine
(``csrc/kvx_fabric.c``) is the same for all: :meth:`Endpoint.post` builds one
work request per remote piece (split at ``max_msg``), gathering up to
``max_sge`` local pieces, keeps at most ``max_outstanding`` in flight per
endpoint, and waits with the GIL released. Several threads may post on one
endpoint at once. A local piece must lie inside a region registered on the
endpoint (the C table is sorted by address, so ``FI_MR_LOCAL`` descriptors
are found by address); one that does not raises ``ConfigError`` naming it.

Each endpoint of the ``ofi`` provider runs a progress thread: libfabric's
``tcp;ofi_rxm`` progresses data manually, so the *target* of a READ or WRITE
must drive progress too. Completions are dispatched to reference-counted
batches: when a post times out it cancels what it can and forgets the rest;
a completion that arrives later still finds its batch, and the last one
frees it (batches nobody completes are freed when the endpoint closes). The
bytes of a timed-out READ may still land in the local buffer later: keep it
registered (or the endpoint open) until the peer is disconnected.

After an error completion, tcp;ofi_rxm's target drops the connection that
carried the refused request; posts to that peer fail with ``FI_ENOTCONN``
for the few milliseconds until this side has seen it close, and the next one
connects anew. The backend re-establishes the peer on next use.

``MemoryRegion.close`` waits for posts in flight on the endpoint (bounded by
their timeouts), then deregisters: after it returns no peer can *start* an
access to the range through the key. On software providers (``tcp;ofi_rxm``)
an access already started keeps moving bytes after ``fi_close(mr)``: a peer's
WRITE lands in the range, and a READ this side gave up on lands in the local
buffer, for seconds. Only closing the provider's endpoint stops them, which
is what :meth:`Endpoint.reset` does in place. :attr:`Endpoint.mr_close_is_final`
says whether a reset is needed: True where the provider picks keys and the
region lives in a NIC (``efa``, ``verbs;ofi_rxm``: closing it invalidates it
there), False for software providers and for ``null``.

GPU memory (``device >= 0``) is registered with ``fi_mr_regattr`` with iface
``FI_HMEM_CUDA`` and the device id, on an endpoint opened with
``hmem=True``. It compiles against libfabric 1.17's headers but has not run
on a GPU with an HMEM-capable provider.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvx.errors import ConfigError, ConnectError, ProtocolError, RegionError, TransferError
from kvx.errors import TimeoutError as KvxTimeoutError

__all__ = [
    "READ",
    "RESET",
    "WRITE",
    "Endpoint",
    "FabricError",
    "Info",
    "MemoryRegion",
    "PeerInfoError",
    "available",
    "providers",
]

log = logging.getLogger(__name__)

READ = 0
WRITE = 1

_MISSING = "kvx was built without libfabric (apt-get install libfabric-dev, then reinstall kvx)"


RESET = "RESET"


class FabricError(TransferError):
    """An error completion: ``status`` is the provider's name for it (``FI_EACCES``...).

    ``status == "RESET"``: the post was in flight (or started) while :meth:`Endpoint.reset`
    ran; nothing more of it moves. Connect again and retry.
    """

    def __init__(self, status: str, text: str, peer: int) -> None:
        super().__init__(f"{status} from peer {peer}: {text}")
        self.status = status
        self.text = text
        self.peer = peer


class PeerInfoError(ProtocolError, ValueError):
    """The info a peer sent for :meth:`Endpoint.complete` is malformed."""


class Info(NamedTuple):
    """One RMA-capable RDM provider on this host (what ``fi_info -c FI_RMA -t FI_EP_RDM`` lists)."""

    provider: str
    fabric: str
    domain: str
    max_msg: int
    max_sge: int
    max_outstanding: int
    mr_mode: int
    key_size: int


def _native() -> Any:
    mod = sys.modules.get("kvx._fabric")
    if mod is not None:
        return mod
    saved = _signal_dispositions()
    try:
        from kvx import _fabric  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ConfigError(f"{_MISSING} ({exc})") from exc
    finally:
        _restore_signal_dispositions(saved)
    return _fabric


# libfabric links libraries whose constructors install signal handlers when they
# are loaded (Debian's libinfinipath, under its PSM provider: SIGTERM, SIGSEGV and
# more, writing "*.btr" backtrace files and exiting with status 1). They would take
# SIGTERM from the application (a daemon's drain) and faulthandler's SIGSEGV from
# Python. Every disposition is saved before the import and put back after it.
_SIGACTION_BYTES = 256  # at least sizeof(struct sigaction) on every Linux libc
_HANDLER_BYTES = ctypes.sizeof(ctypes.c_void_p)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return libc


def _signal_dispositions() -> dict[int, bytes]:
    libc = _libc()
    saved = {}
    for sig in range(1, signal.NSIG):
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(sig, None, buf) == 0:
            saved[sig] = buf.raw
    return saved


def _restore_signal_dispositions(saved: dict[int, bytes]) -> None:
    libc = _libc()
    for sig, before in saved.items():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        now = ctypes.create_string_buffer(_SIGACTION_BYTES)
        # The handler is the struct's first member; the rest holds padding that varies.
        if libc.sigaction(sig, None, now) == 0 and now.raw[:_HANDLER_BYTES] != before[:_HANDLER_BYTES]:
            back = ctypes.create_string_buffer(before, _SIGACTION_BYTES)
            if libc.sigaction(sig, back, None) == 0:
                log.debug("kvx._fabric: signal %d's handler put back after loading libfabric", sig)


def available() -> str | None:
    """None when the posting layer can be used, else why not (and how to fix it)."""
    try:
        _native()
    except ConfigError as exc:
        return str(exc)
    return None


def providers(node: str | None = None) -> list[Info]:
    """The RMA-capable RDM providers (one per provider, fabric and domain), best first."""
    try:
        rows = _native().providers(node)
    except OSError as exc:
        raise ConfigError(f"listing libfabric providers failed: {exc}") from exc
    seen: set[tuple[str, str, str]] = set()
    out = []
    for row in rows:
        if tuple(row[:3]) in seen:
            continue
        seen.add(tuple(row[:3]))
        out.append(Info(*row))
    return out


def _u64(values: Any, name: str) -> np.ndarray:
    """A C-contiguous uint64 array (numpy arrays of that kind pass through without a copy)."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64 and values.flags.c_contiguous:
        return values
    try:
        return np.ascontiguousarray(values, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{name} must be unsigned 64-bit integers: {exc}") from exc


class MemoryRegion:
    """Memory registered on one endpoint; ``key`` is what a peer names it by."""

    def __init__(self, native: Any, remote_read: bool, remote_write: bool, device: int) -> None:
        self._mr = native
        self.remote_read = remote_read
        self.remote_write = remote_write
        self.device = device

    @property
    def key(self) -> int:
        return int(self._mr.key)

    @property
    def addr(self) -> int:
        return int(self._mr.addr)

    @property
    def length(self) -> int:
        return int(self._mr.length)

    @property
    def closed(self) -> bool:
        return bool(self._mr.closed)

    def close(self) -> None:
        """Deregister; after this returns no peer can touch the range through the key."""
        try:
            self._mr.close()
        except OSError as exc:
            raise RegionError(f"deregistering {self.length} bytes at {self.addr:#x} failed: {exc}") from exc

    def __repr__(self) -> str:
        return f"MemoryRegion(addr={self.addr:#x}, length={self.length}, closed={self.closed})"


class Endpoint:
    """One libfabric RDM endpoint (or the null provider's), with its progress thread.

    ``provider``: "tcp;ofi_rxm", "efa", "verbs;ofi_rxm", None (the best one) or
    "null". ``node``: the local address to bind; ``domain``: the NIC.
    ``hmem``: ask for GPU memory registration. ``max_sge``, ``max_msg`` and
    ``max_outstanding`` lower the provider's limits (0: as the provider says).
    """

    def __init__(
        self,
        provider: str | None = None,
        node: str | None = None,
        domain: str | None = None,
        *,
        hmem: bool = False,
        max_sge: int = 0,
        max_msg: int = 0,
        max_outstanding: int = 0,
    ) -> None:
        native = _native()
        try:
            self._ep = native.Endpoint(
                provider,
                node,
                domain,
                hmem=hmem,
                max_sge=max_sge,
                max_msg=max_msg,
                max_outstanding=max_outstanding,
            )
        except OSError as exc:
            raise ConfigError(f"opening a libfabric endpoint failed: {exc}") from exc
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._fabric_error = native.FabricError
        self.provider: str = self._ep.provider
        self.fabric: str = self._ep.fabric
        self.domain: str = self._ep.domain
        self.address: bytes = b""
        self.max_sge: int = 0
        self.max_msg: int = 0
        self.max_outstanding: int = 0
        self.virt_addr: bool = self._ep.virt_addr
        self.prov_key: bool = self._ep.prov_key
        self.mr_mode: int = self._ep.mr_mode
        self.key_size: int = self._ep.key_size
        self.mr_close_is_final: bool = self._ep.mr_close_is_final
        self._limits()

    def _limits(self) -> None:
        self.address = self._ep.address
        self.max_sge = self._ep.max_sge
        self.max_msg = self._ep.max_msg
        self.max_outstanding = self._ep.max_outstanding

    def register(
        self, addr: int, length: int, *, remote_read: bool, remote_write: bool, device: int = -1
    ) -> MemoryRegion:
        """Register ``length`` bytes at ``addr`` (GPU memory of CUDA device ``device`` when >= 0).

        The region lives as long as the returned object: keep it, and close it (or let it
        go) only when no transfer may use the range any more.
        """
        try:
            mr = self._ep.register(
                addr, length, remote_read=bool(remote_read), remote_write=bool(remote_write), device=device
            )
        except (ValueError, OverflowError) as exc:
            raise ConfigError(str(exc)) from exc
        except OSError as exc:
            raise RegionError(f"registering {length} bytes at {addr:#x} failed: {exc}") from exc
        return MemoryRegion(mr, bool(remote_read), bool(remote_write), device)

    def prepare(self) -> tuple[int, bytes]:
        """This side's half of a connection: (half, info); send ``info`` to the peer."""
        try:
            half, info = self._ep.prepare()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        except OSError as exc:
            raise ConnectError(f"preparing a connection failed: {exc}") from exc
        return int(half), bytes(info)

    def complete(self, half: int | None, remote_info: bytes) -> int:
        """Connect with the peer whose ``info`` came back; returns the peer number for :meth:`post`."""
        if not isinstance(remote_info, bytes | bytearray | memoryview):
            raise PeerInfoError(f"peer info must be bytes, not {type(remote_info).__name__}")
        try:
            return int(self._ep.complete(half, bytes(remote_info)))
        except ValueError as exc:
            raise PeerInfoError(f"{exc}; the peer sent info kvx cannot use") from exc
        except OSError as exc:
            raise ConnectError(f"connecting to the peer failed: {exc}") from exc

    def disconnect(self, peer: int) -> None:
        try:
            self._ep.disconnect(peer)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        except OSError as exc:
            raise ConnectError(f"disconnecting peer {peer} failed: {exc}") from exc

    def post(
        self,
        op: int,
        peer: int,
        local_addrs: Sequence[int] | np.ndarray,
        local_lens: Sequence[int] | np.ndarray,
        remote_addrs: Sequence[int] | np.ndarray,
        remote_lens: Sequence[int] | np.ndarray,
        remote_keys: Sequence[int] | np.ndarray,
        timeout_ms: int,
    ) -> None:
        """READ (0) or WRITE (1) the pieces; returns when every byte completed.

        Raises :class:`FabricError` on an error completion, ``kvx.errors.TimeoutError``
        when ``timeout_ms`` passes, ``ConfigError`` for bad arguments (a local piece
        outside registered memory, lists that do not pair up or cover different totals).
        """
        arrays = (
            _u64(local_addrs, "local_addrs"),
            _u64(local_lens, "local_lens"),
            _u64(remote_addrs, "remote_addrs"),
            _u64(remote_lens, "remote_lens"),
            _u64(remote_keys, "remote_keys"),
        )
        try:
            self._ep.post(op, peer, *arrays, timeout_ms)
        except self._fabric_error as exc:
            status, text, who = exc.args
            raise FabricError(status, text, who) from None
        except builtins.TimeoutError as exc:
            raise KvxTimeoutError(str(exc)) from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise ConfigError(str(exc)) from None

    def counters(self) -> dict[str, int]:
        """What the engine did: posts, work_requests, sges, completions, errors, eagain, timeouts,
        orphans, resets..."""
        return dict(self._ep.counters())

    def reset(self, reason: str = "", drop: Sequence[MemoryRegion] = ()) -> None:
        """Close the provider's endpoint and open a new one in its place.

        When this returns no byte moves through the old connections: a peer's WRITE into a
        region closed before, a READ that timed out. Posts in flight fail with
        :class:`FabricError` status ``"RESET"`` (``reason`` is in its text), and so do posts
        started while the reset runs; other calls wait for it. The endpoint gets a new
        :attr:`address` (a new port): every peer number is forgotten (a post to one raises
        ``ConfigError`` "not connected") and each peer must be connected again with
        :meth:`prepare`/:meth:`complete`. Every region still open is registered again under
        the key it had, so keys handed out stay valid; regions closed before stay closed.

        Raises ``ConfigError`` where the provider picks MR keys (``prov_key``): a reset
        could not keep them, and there closing a region is final (:attr:`mr_close_is_final`).
        Raises ``ConnectError`` when the provider could not be opened again (the endpoint
        is closed then) and ``RegionError`` when a region could not be registered again
        (that region is unreachable).

        ``drop``: regions of this endpoint to close with the reset, after its connections
        (closing one first, while a peer's transfer into it still runs, is what a reset
        is for; the provider must not meet a registration closed under a live transfer).
        """
        try:
            self._ep.reset(reason, [mr._mr for mr in drop])
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        except OSError as exc:
            with contextlib.suppress(ValueError):
                self._limits()
            if "could not be registered again" in str(exc):
                raise RegionError(str(exc)) from exc
            raise ConnectError(str(exc)) from exc
        self._limits()
        log.info("endpoint %s reset (%s): new address", self.provider, reason or "no reason given")

    def close(self) -> None:
        """Wait for posts in flight, stop the progress thread, deregister everything, close."""
        self._ep.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Endpoint(provider={self.provider!r}, fabric={self.fabric!r}, domain={self.domain!r})"
