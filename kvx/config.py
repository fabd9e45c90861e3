"""Small configuration objects; every field carries its unit."""

from __future__ import annotations

import dataclasses
import math
import re

from kvx import backends
from kvx.errors import ConfigError

# fullmatch: "$" would also accept a trailing newline. No "/": names are URL
# path segments of the admin API (/v1/agents/{name}) and etcd key suffixes.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def check_name(name: str) -> str:
    """An agent name: 1-128 ASCII letters, digits and ._:@-, starting with a letter or digit."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid agent name {name!r}: 1-128 characters of letters, digits and ._:@- "
            "starting with a letter or digit"
        )
    return name


# Agent(backend=...): "auto" picks per peer; the built-in backends (kvx.backends registers more).
BACKENDS = ("auto", "tcp", "shm", "cuda_ipc", "rdma")


def check_backend(backend: str) -> str:
    if backend != "auto" and backend not in backends.names():
        raise ConfigError(f"backend must be one of auto, {', '.join(backends.names())}, not {backend!r}")
    return backend


def read_file(path: str) -> bytes:
    """A configuration file's bytes (certificates, keys), or a ConfigError that names it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """How long kvx waits before it gives up.

    connect_s:  TCP connect plus the whole handshake with a peer.
    io_s:       a socket with work outstanding that moves no byte for this
                long is declared dead (the peer hangs or vanished); its
                transfers fail with TimeoutError.
    transfer_s: the default of ``Transfer.wait()``, and how long posting waits
                for an in-flight slot.
    close_s:    how long ``Agent.close()`` waits for its threads.
    """

    connect_s: float = 5.0
    io_s: float = 10.0
    transfer_s: float = 60.0
    close_s: float = 5.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"Timeouts.{field.name} must be a positive number of seconds, not {value!r}"
                )


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on everything a peer or the application can ask for.

    max_message_bytes:      data bytes in one request on the wire; larger
                            transfers are split into several requests.
    max_descs_per_message:  descriptors in one request; likewise split.
    max_transfer_bytes:     bytes in one transfer (as a target: in one VERIFY
                            a peer asks of it).
    max_inflight_per_peer:  transfers in flight to one peer; posting waits
                            for a slot (up to Timeouts.transfer_s).
    max_notify_bytes:       size of one notification.
    max_pending_notifications: notifications queued for the application;
                            past it the sending peer's transfer fails with
                            LimitError rather than losing one.
    max_regions:            registered regions.
    max_connections:        authenticated inbound connections the agent serves at
                            once (those still in their handshake have their own,
                            fixed bound: kvx/backends/control/serve.py).
    """

    max_message_bytes: int = 256 * MiB
    max_descs_per_message: int = 65536
    max_transfer_bytes: int = 64 * GiB
    max_inflight_per_peer: int = 64
    max_notify_bytes: int = 64 * KiB
    max_pending_notifications: int = 65536
    max_regions: int = 65536
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"Limits.{field.name} must be a positive integer, not {value!r}")
        if self.max_descs_per_message > 1 << 24:
            raise ConfigError("Limits.max_descs_per_message must be at most 16777216")


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KB": KiB,
    "KIB": KiB,
    "M": MiB,
    "MB": MiB,
    "MIB": MiB,
    "G": GiB,
    "GB": GiB,
    "GIB": GiB,
}


def parse_size(text: str) -> int:
    """Parse "32KiB", "4k", "1M", "4096" into bytes (binary units)."""
    s = str(text).strip().upper().replace(" ", "")
    digits = s.rstrip("KMGIB")
    unit = s[len(digits) :]
    if not digits or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 32KiB, 1MiB)")
    try:
        value = float(digits)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 32KiB, 1MiB)") from None
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0 or size != value * _SIZE_UNITS[unit]:
        raise ConfigError(f"size must be a positive whole number of bytes: {text!r}")
    return size
