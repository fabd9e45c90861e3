"""kvx: KV-cache transfer between the prefill and decode workers of an LLM cluster.

A decode worker pulls a prefill worker's KV blocks into its own pool:

    import numpy as np, kvx

    with kvx.Agent("decode-0") as agent:
        pool = np.zeros(1 << 26, np.uint8)
        region = agent.register(pool)
        peer = agent.add_peer(prefill_metadata)      # bytes from the prefill agent
        remote = peer.regions[0]
        t = peer.read(region.descs(local_offsets, 32768), remote.descs(remote_offsets, 32768))
        t.wait()
"""

from kvx._datapath.shared import alloc_shared
from kvx._version import __version__ as __version__  # re-exported
from kvx.agent import Agent, Peer
from kvx.backends.control.wire import PROTOCOL_VERSION
from kvx.config import Limits, Timeouts
from kvx.descs import DESC_DTYPE, Descs
from kvx.errors import (
    AccessError,
    AuthError,
    ClosedError,
    ConfigError,
    ConnectError,
    EpochError,
    IntegrityError,
    KvxError,
    LimitError,
    MetadataError,
    PeerLostError,
    ProtocolError,
    RegionBusyError,
    RegionError,
    TimeoutError,
    TransferError,
    VersionError,
)
from kvx.layout import KVLayout
from kvx.memory import MemoryKind, Region, RemoteRegion
from kvx.metadata.client import MetadataOptions
from kvx.transfer import Notification, Op, Transfer, TransferState

__all__ = [
    "alloc_shared",
    "DESC_DTYPE",
    "PROTOCOL_VERSION",
    "AccessError",
    "Agent",
    "AuthError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "Descs",
    "EpochError",
    "KVLayout",
    "KvxError",
    "LimitError",
    "Limits",
    "MetadataError",
    "MetadataOptions",
    "MemoryKind",
    "Notification",
    "Op",
    "Peer",
    "PeerLostError",
    "ProtocolError",
    "Region",
    "RegionBusyError",
    "RegionError",
    "RemoteRegion",
    "TimeoutError",
    "Timeouts",
    "Transfer",
    "TransferError",
    "IntegrityError",
    "TransferState",
    "VersionError",
]
