"""The rdma backend's copies: one-sided READ and WRITE through the endpoint,
run by the initiator once the target has pinned its regions and answered
their keys (``Link.post_pinned`` with ``PIN_RDMA``, or a lease)."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.backends.control.pinned import PinnedCopy
from kvx.errors import ClosedError, ConfigError, KvxError, PeerLostError, TimeoutError, TransferError
from kvx.transfer import Op

if TYPE_CHECKING:
    from kvx.backends.rdma import RdmaChannel

# Error completions that mean the peer's process or host is gone.
LOST = frozenset(
    {
        "FI_ENOTCONN",
        "FI_ECONNRESET",
        "FI_ECONNABORTED",
        "FI_ECONNREFUSED",
        "FI_EHOSTUNREACH",
        "FI_ENETUNREACH",
        "FI_ENETDOWN",
        "FI_ESHUTDOWN",
    }
)
# ep.post's op codes (kvx/backends/rdma/fabric.py).
OP_READ = 0
OP_WRITE = 1


class RdmaCopy(PinnedCopy):
    """Posts one part's bytes as work requests: per remote descriptor one (the
    endpoint splits at its message size), the local pieces gathered."""

    __slots__ = ("channel",)

    @property
    def extra_bytes(self) -> int:  # type: ignore[override]
        """Per region its key on each of the target's rails (the count its connect answer gave)."""
        return 8 * self.channel.remote_rails

    def __init__(self, channel: RdmaChannel, *args: Any) -> None:
        super().__init__(*args)
        self.channel = channel

    def move(self, bases: np.ndarray, sizes: np.ndarray, extra: np.ndarray) -> None:
        channel = self.channel
        at = 0 if len(self.regions) == 1 else np.searchsorted(self.regions, self.remote["region"])
        offsets = np.asarray(self.remote["offset"], np.uint64)
        remote_addrs = offsets + bases[at] if channel.virt_addr else offsets
        rails = channel.remote_rails
        # Per remote piece, its region's key on each of the target's rails.
        keys = np.asarray(extra, np.uint64).reshape(-1, rails)[np.broadcast_to(at, offsets.shape)]
        channel.run(
            OP_WRITE if self.op is Op.WRITE else OP_READ,
            np.ascontiguousarray(self.addrs, np.uint64),
            np.ascontiguousarray(self.lens, np.uint64),
            np.ascontiguousarray(remote_addrs, np.uint64),
            np.ascontiguousarray(self.remote["length"], np.uint64),
            keys,
        )


def post_error(exc: BaseException, op: int, peer: str, timeout_ms: int) -> KvxError:
    """What a failed ``ep.post`` means, as the kvx error that names the
    status and the peer."""
    what = "WRITE" if op == OP_WRITE else "READ"
    if isinstance(exc, (TimeoutError, builtins.TimeoutError)):
        return TimeoutError(
            f"rdma {what} with peer {peer!r} did not complete in {timeout_ms / 1000:g}s "
            f"(Timeouts.io_s): the peer hangs, or its NIC is unreachable"
        )
    if isinstance(exc, (ClosedError, ConfigError)):
        return exc
    status = getattr(exc, "status", None) or type(exc).__name__
    text = getattr(exc, "text", None) or str(exc)
    if status in LOST:
        return PeerLostError(f"rdma {what} with peer {peer!r} failed: {status}: the peer is gone ({text})")
    return TransferError(f"rdma {what} with peer {peer!r} failed: {status}: {text}")
