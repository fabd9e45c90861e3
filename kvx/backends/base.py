"""The transport interface: what a backend implements and what it may see.

A backend is a package under ``kvx/backends/`` with one class that
implements ``Backend`` and one line in the registry (``kvx/backends/__init__.py``).
The agent never reaches into a backend, and a backend never sees the agent:
it gets a ``BackendContext`` (the region table, the secret, limits,
timeouts, where notifications go), and builds on the shared control
connection (``kvx.backends.control``): the handshake, authentication, epochs,
pins and set-up requests are done once, there, for every backend.

Per peer the selector (``select.py``) asks each candidate whether it can
reach the peer (``reach``), and the first that can ``connect``s a
``Channel`` over the peer's authenticated control ``Link``. Posting a
transfer is then ``channel.post(...)``: the backend moves the bytes and
reports each part through the ``Transfer``'s part interface.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvx.config import Limits, Timeouts
from kvx.memory import RegionTable
from kvx.transfer import Op, Transfer

if TYPE_CHECKING:
    from kvx.backends.control.link import Link
    from kvx.backends.control.serve import Handler
    from kvx.memory import Region
    from kvx.v1 import agent_pb2


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """What a backend may use of its agent; nothing more.

    deliver: ``fn(peer name, data) -> bool`` hands a notification to the
    application once its data has landed; False when its queue is full (the
    sender then gets a LimitError).
    serves: ``fn(inode) -> bool``: the socket with this inode is one of the
    authenticated inbound control connections this agent serves (a
    same-host initiator asks, to learn which process serves its link).
    """

    agent_name: str
    epoch: int
    setting: str  # the agent's backend setting: "auto" or a backend's name
    regions: RegionTable
    secret: bytes | None
    limits: Limits
    timeouts: Timeouts
    deliver: Callable[[str, bytes], bool]
    serves: Callable[[int], bool] = lambda inode: False
    # The host the agent's control port listens on: a backend that opens a
    # port of its own (libfabric's software providers) binds it there too.
    listen_host: str = ""

    @property
    def io_ms(self) -> int:
        return max(1, int(self.timeouts.io_s * 1000))

    @property
    def serves_pins(self) -> bool:
        """Peers may pin regions to copy them directly (same-host backends);
        not when the agent was told to use tcp only."""
        return self.setting != "tcp"


class Unreachable(Exception):
    """Raised by ``Backend.connect`` when the peer turns out unreachable after
    all (say, no shared segment could be mapped): the selector tries the next."""


class Channel(abc.ABC):
    """A connected peer, over one backend, built on the peer's control link."""

    # True when ``post`` merges adjacent ranges itself (shm does, in C): the
    # agent then skips coalescing the descriptor lists before posting (as it
    # does for a small transfer on a ``small_posts`` channel).
    merges_ranges = False
    # Set by a channel that can move a small transfer at once, on the posting
    # thread, through what the peer already leased (shm's ``copy_inline`` for
    # host memory, cuda_ipc's between GPUs), called as
    # ``copy_inline(writing, local, pin, need, remote, max_bytes)`` with
    # ``pin`` the agent's ``RegionTable.pin_table()``; None sends every
    # transfer through ``post``.
    copy_inline: Callable[..., Any] | None = None
    # True when ``post`` takes small host transfers whose descriptors the agent
    # checked and resolved in one call (``Peer._post_small``, ``post_check``):
    # a channel that sends each transfer as requests on the link (tcp).
    small_posts = False
    # True when ``copy_inline`` takes transfers to a peer that has GPU regions
    # (cuda_ipc: it sorts out which leases it can copy through itself).
    inline_gpu = False

    def __init__(self, link: Link) -> None:
        self._link = link

    @property
    def link(self) -> Link:
        """The control connections to the peer this channel builds on."""
        return self._link

    @property
    def alive(self) -> bool:
        """False once the channel failed or was closed; posting then fails."""
        return self.link.alive

    @property
    def error(self) -> BaseException | None:
        """What broke the channel, or None."""
        return self.link.error

    @abc.abstractmethod
    def post(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        local_device: int,
        remote_device: int,
        remote_ipc: bool,
    ) -> None:
        """Start moving ``total`` bytes between local (address, length) pairs
        (uint64 buffers) and ``remote`` descriptors, then deliver ``notify``.
        Completion and errors arrive through ``transfer``'s parts.
        ``local_device``/``remote_device``: the CUDA device of either side's
        memory, -1 for host memory; ``remote_ipc``: the remote CUDA regions
        can be opened through CUDA IPC."""

    def notify(self, transfer: Transfer, data: bytes) -> None:
        """Deliver a notification with no data."""
        self.link.notify(transfer, data)

    def close(self) -> None:
        """Close; transfers still in flight fail with ClosedError."""
        self.link.close()


class Backend(abc.ABC):
    """A transport. One instance per agent, made with the agent's context.

    ``priority`` orders the candidates under ``backend="auto"`` (highest
    first); a backend with ``auto = False`` is used only when configured by
    name. ``stages_gpu``: GPU memory it does not move itself goes through
    pinned host buffers (the selector says so in the reason).
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    auto: ClassVar[bool] = True
    stages_gpu: ClassVar[bool] = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    def offer(self, md: agent_pb2.AgentMetadata) -> None:
        """Add what this backend offers peers to the agent's metadata."""

    def registered(self, region: Region) -> None:
        """A region was registered, with or without remote access (its
        ``remote_read``/``remote_write`` say which); raising refuses the
        registration (the agent removes the region again)."""

    def deregistered(self, region: Region) -> None:
        """A region left the table: every pin and lease on it has ended. What
        the backend set up for it (a NIC's memory registration) must be gone
        when this returns, so that no peer can touch the memory any more."""

    def handlers(self) -> dict[int, Handler]:
        """Message types this backend serves on inbound control connections."""
        return {}

    def applies(self, md: agent_pb2.AgentMetadata) -> bool:
        """Under ``backend="auto"``: whether this backend is worth considering
        for the peer at all (say, only when there is GPU memory to move)."""
        return True

    def streams(self, md: agent_pb2.AgentMetadata, streams: int) -> int:
        """How many control connections to open to a peer it may serve."""
        return streams

    @abc.abstractmethod
    def reach(self, md: agent_pb2.AgentMetadata) -> tuple[str | None, str]:
        """(None, why it can) when it can reach the peer that ``md`` describes,
        else (why not, ""). Called after the handshake: the peer is who its
        metadata says. Cheap and side-effect free; ``connect`` does the work."""

    @abc.abstractmethod
    def connect(self, md: agent_pb2.AgentMetadata, link: Link) -> tuple[Channel, str]:
        """A channel over ``link`` (authenticated, readers not started yet) and
        anything to add to the reason; raises Unreachable to let the selector
        try the next backend."""

    def close(self) -> None:
        """Stop serving; called once when the agent closes."""


@functools.cache
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def same_host(md: agent_pb2.AgentMetadata) -> bool:
    """Same kernel: the same boot id, and the same host name (a guard against
    copied boot ids, e.g. two VMs from one image are told apart by it)."""
    return bool(md.boot_id) and md.boot_id == boot_id() and md.host_name == socket.gethostname()
