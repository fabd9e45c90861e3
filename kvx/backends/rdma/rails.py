"""Rails: which NICs the rdma backend opens an endpoint on, the connect
exchange that pairs them with a peer's, and how a transfer is cut into
slices across them.

A rail is one endpoint on one NIC: a libfabric domain (``fi_info``'s domain
name: ``mlx5_0``, ``rdmap16s27-rdm``, ``lo``) or an ibverbs device port
(``kvx._verbs``). Which NICs (:func:`choose`):

1. ``KVX_RDMA_DEVICES`` when set (for libfabric, domain names, which may
   repeat: two endpoints on one NIC);
2. else, for an agent on a GPU (CuPy's or torch's current device, when one
   of them is imported already), the NIC(s) ``topology.for_gpu`` pairs with
   that GPU;
3. else every NIC with an ACTIVE port (``topology.usable``);
4. else (no sysfs device, e.g. libfabric's tcp provider) the provider's
   first domain: one rail.

Peers pair rails by index (``topology.peer_rail``): local rail *i* talks to
the peer's rail *i mod n*.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvx.backends.control import wire as _wire
from kvx.backends.rdma import topology
from kvx.errors import ConfigError, ProtocolError

# At most this many rails per agent (a DGX H100 has 8 NICs; a few spare).
MAX_RAILS = 16
# The libfabric providers whose domains are RDMA devices in sysfs.
SYSFS_PROVIDERS = ("efa", "verbs")

# The connect exchange (RDMA_CONNECT / RDMA_CONNECT_OK).
# Version history: 1, one endpoint's info; 2, one info per rail pair, the
# sender's rail count, and the reconnect of one pair (FLAG_RECONNECT).
CONNECT_VERSION = 2
_CONNECT = struct.Struct("<BBBBBB")  # version, flags, sender's rails, first pair, pairs, reserved (0)
_INFO = struct.Struct("<H")  # each pair's info: its length, then the bytes
MAX_INFO_BYTES = 1024
# A whole message fits a control request (wire.MAX_HANDSHAKE_BYTES): 16
# rails of the largest info any provider has (verbs: 32 bytes, efa: 32,
# tcp: 16 to 28) fit with room to spare.
MAX_CONNECT_BYTES = _wire.MAX_HANDSHAKE_BYTES
FLAG_GPU = 1  # (answer) this agent registers its CUDA memory with its NICs
FLAG_RECONNECT = 2  # (request) connect pair ``first`` again, its old connection is gone
_FLAGS = FLAG_GPU | FLAG_RECONNECT

# Transfers of at least two slices of this size are striped across the rail
# pairs. 1 MiB takes 21 µs at 400 Gb/s: against a post's few µs of setup and
# the completion's round trip, a slice smaller than that would let per-post
# costs eat the second rail's bandwidth; a larger one would leave small
# multi-MiB transfers on one rail.
SLICE_MIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Connect:
    """A parsed connect message."""

    flags: int
    rails: int  # the sender's rail count
    first: int  # the index of the first pair its infos are for
    infos: tuple[bytes, ...]


def pack_connect(flags: int, rails: int, infos: Sequence[bytes], first: int = 0) -> bytes:
    if not 0 < len(infos) <= MAX_RAILS or not 0 < rails <= MAX_RAILS or first + len(infos) > MAX_RAILS:
        raise ConfigError(f"an rdma connect message carries 1 to {MAX_RAILS} rails, not {len(infos)}")
    out = [_CONNECT.pack(CONNECT_VERSION, flags, rails, first, len(infos), 0)]
    for info in infos:
        if not 0 < len(info) <= MAX_INFO_BYTES:
            raise ConfigError(
                f"the endpoint's connection info is {len(info)} bytes; at most {MAX_INFO_BYTES}"
            )
        out += [_INFO.pack(len(info)), bytes(info)]
    message = b"".join(out)
    if len(message) > MAX_CONNECT_BYTES:
        raise ConfigError(f"an rdma connect message of {len(message)} bytes; at most {MAX_CONNECT_BYTES}")
    return message


def parse_connect(payload: bytes, peer: str) -> Connect:
    """The connect message ``payload``; ProtocolError when it is not one."""
    if len(payload) < _CONNECT.size:
        raise ProtocolError(f"peer {peer!r} sent a {len(payload)}-byte rdma connect message")
    version, flags, rails, first, pairs, reserved = _CONNECT.unpack_from(payload)
    if version != CONNECT_VERSION:
        raise ProtocolError(
            f"peer {peer!r} speaks rdma connect version {version}, this agent {CONNECT_VERSION}: "
            "run the same kvx release on both"
        )
    if (
        flags & ~_FLAGS
        or reserved
        or not 0 < rails <= MAX_RAILS
        or not 0 < pairs <= MAX_RAILS
        or first + pairs > MAX_RAILS
    ):
        raise ProtocolError(f"peer {peer!r} sent a malformed rdma connect message")
    infos, at = [], _CONNECT.size
    for _ in range(pairs):
        if at + _INFO.size > len(payload):
            raise ProtocolError(f"peer {peer!r} sent a truncated rdma connect message")
        (length,) = _INFO.unpack_from(payload, at)
        at += _INFO.size
        if not 0 < length <= MAX_INFO_BYTES or at + length > len(payload):
            raise ProtocolError(f"peer {peer!r} sent a malformed rdma connect message")
        infos.append(bytes(payload[at : at + length]))
        at += length
    if at != len(payload):
        raise ProtocolError(f"peer {peer!r} sent {len(payload) - at} stray bytes in an rdma connect message")
    return Connect(flags, rails, first, tuple(infos))


# Which NICs.


def current_gpu_pci() -> str | None:
    """The PCI address of the CUDA device this process uses, from CuPy or
    torch when either is imported already (never imported here: both are
    heavy and optional); None otherwise."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return str(cupy.cuda.Device().pci_bus_id)
        except Exception:  # no GPU, or no driver: a host agent
            return None
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        except Exception:  # an old torch without the PCI fields: a host agent
            return None
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The NICs an agent opens endpoints on, in rail order, and why."""

    devices: tuple[str, ...]  # device (verbs: "mlx5_0:1") or domain names; () = the provider's first
    reason: str


def choose(root: str = "/", env: Mapping[str, str] | None = None, gpu_pci: str | None = None) -> Choice:
    """The NICs (sysfs RDMA device ports) this agent's rails use; raises
    ConfigError on a bad ``KVX_RDMA_DEVICES``."""
    env = os.environ if env is None else env
    pinned = env.get(topology.DEVICES_ENV, "").strip()
    if pinned:
        items = [item.strip() for item in pinned.split(",") if item.strip()]
        if not items or len(items) > MAX_RAILS:
            raise ConfigError(f"{topology.DEVICES_ENV} names 1 to {MAX_RAILS} devices, not {len(items)}")
        return Choice(tuple(items), f"{topology.DEVICES_ENV}={pinned}")
    if gpu_pci is not None:
        try:
            found = topology.for_gpu(gpu_pci, root, env)
        except ConfigError as exc:
            found = None
            why = str(exc)
        if found is not None:
            devices = tuple(str(e) for e in found.endpoints[:MAX_RAILS])
            return Choice(devices, f"the NIC(s) nearest GPU {gpu_pci} ({found.level}: {found.reason})")
    else:
        why = "the agent is not on a GPU"
    nics = topology.usable(topology.rdma_devices(root))
    if nics:
        devices = tuple(str(topology._endpoint(d)) for d in nics[:MAX_RAILS])
        return Choice(devices, f"every usable RDMA NIC ({why})")
    return Choice((), "no RDMA device in sysfs: the provider's first domain")


def libfabric_domains(choice: Choice, listed: Sequence[str], pinned: bool) -> list[str | None]:
    """The libfabric domains to open, one per rail: those of ``choice``
    that the provider lists (``mlx5_0``, or efa's ``rdmap16s27-rdm``)."""
    if not choice.devices:
        return [None]
    out: list[str | None] = []
    for device in choice.devices:
        name = device if pinned else device.partition(":")[0]
        match = next((d for d in listed if d == name or d.startswith(name + "-")), None)
        if match is None:
            if pinned:
                raise ConfigError(
                    f"{topology.DEVICES_ENV} names {name!r}, which the libfabric provider does not list; "
                    f"it lists: {', '.join(sorted(set(listed))) or 'nothing'}"
                )
            continue
        out.append(match)
    return out or [None]


# Striping.


def cut(addrs: np.ndarray, lens: np.ndarray, bounds: Sequence[int], *carry: np.ndarray) -> list[tuple]:
    """Split a list of (addr, len) pieces at byte offsets ``bounds`` (the
    slices' ends, increasing, the last the total): per slice (addrs, lens,
    *carry) with ``carry`` (per piece values, e.g. keys) taken along."""
    ends = np.cumsum(lens, dtype=np.uint64)
    starts = ends - lens
    out = []
    lo = 0
    for hi in bounds:
        pick = (starts < hi) & (ends > lo)
        a = addrs[pick].copy()
        n = lens[pick].copy()
        s, e = starts[pick], ends[pick]
        if len(a):
            head = np.uint64(lo) - s[0] if s[0] < lo else np.uint64(0)
            a[0] += head
            n[0] -= head
            if e[-1] > hi:
                n[-1] -= e[-1] - np.uint64(hi)
        out.append((a, n, *(c[pick] for c in carry)))
        lo = hi
    return out


def slice_bounds(total: int, rails: int) -> list[int]:
    """Byte offsets where the slices of a ``total``-byte transfer end: one
    slice per rail, each at least SLICE_MIN_BYTES (so one when small)."""
    count = max(1, min(rails, total // SLICE_MIN_BYTES))
    step = -(-total // count)
    return [min(total, step * (i + 1)) for i in range(count)]


def describe(eps: Sequence[Any]) -> str:
    return ", ".join(f"rail {i}: {ep.provider} on {ep.domain}" for i, ep in enumerate(eps))
