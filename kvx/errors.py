"""The kvx exception tree.

Every error kvx raises is a ``KvxError``. Low-level errors (OS, socket,
protobuf) are translated at the edge into the most specific class below, with
the original chained as ``__cause__``::

    KvxError
    ├── ConfigError            bad local configuration or argument (also a ValueError)
    ├── RegionError            registering or deregistering memory failed
    │   └── RegionBusyError    deregister timed out with transfers in flight
    ├── ConnectError           could not reach or handshake with a peer
    │   ├── AuthError          the HMAC challenge failed (no, or another, secret)
    │   ├── EpochError         the peer restarted: its epoch is not the one addressed
    │   └── VersionError       the peer speaks another kvx protocol version
    ├── MetadataError          the metadata service refused a request (``.code``: the gRPC status)
    ├── ProtocolError          a peer sent bytes that break the wire protocol
    ├── TransferError          one transfer failed; the agent and peer stay usable
    │   ├── AccessError        a descriptor left the registered memory, or named an
    │   │                      unknown region, or one without remote access
    │   ├── IntegrityError     verify=True: a descriptor's bytes differ on the two sides
    │   ├── LimitError         a request exceeds a configured limit
    │   ├── PeerLostError      the connection to the peer died mid-transfer
    │   └── TimeoutError       no progress within the timeout (also builtins.TimeoutError)
    └── ClosedError            the agent or peer was closed

``Transfer.wait()`` raises the error that failed the transfer: usually a
``TransferError``, a ``ProtocolError`` or ``ClosedError``.
"""

from __future__ import annotations

import builtins

__all__ = [
    "AccessError",
    "AuthError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "EpochError",
    "IntegrityError",
    "KvxError",
    "LimitError",
    "MetadataError",
    "PeerLostError",
    "ProtocolError",
    "RegionBusyError",
    "RegionError",
    "TimeoutError",
    "TransferError",
    "VersionError",
]


class KvxError(Exception):
    """Base of every kvx error."""


class ConfigError(KvxError, ValueError):
    """A local argument or setting is invalid; the message says which and why."""


class RegionError(KvxError):
    """Registering or deregistering memory failed."""


class RegionBusyError(RegionError):
    """A region could not be deregistered: transfers using it are still in flight."""


class ConnectError(KvxError):
    """A peer could not be reached, or refused the handshake."""


class AuthError(ConnectError):
    """Authentication failed: the peers do not share the same cluster secret."""


class EpochError(ConnectError):
    """The peer's epoch differs from the one in its metadata: it has restarted."""


class VersionError(ConnectError):
    """The peer speaks another kvx protocol version."""


class MetadataError(KvxError):
    """The metadata service refused a request; ``code`` is its gRPC status code.

    An unreachable service is a ConnectError instead.
    """

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        self.code = code


class ProtocolError(KvxError):
    """A peer sent a malformed or unexpected message."""


class TransferError(KvxError):
    """A transfer failed."""


class AccessError(TransferError):
    """A descriptor is outside registered memory, or the region forbids the access."""


class IntegrityError(TransferError):
    """A transfer with ``verify=True``: a descriptor's checksum where the bytes
    were read differs from where they landed; the message names it."""


class LimitError(TransferError):
    """A request exceeds a configured limit (size, descriptor count, queue length)."""


class PeerLostError(TransferError):
    """The connection to the peer died while a transfer was in flight."""


class TimeoutError(TransferError, builtins.TimeoutError):  # noqa: A001 - deliberate shadow
    """No progress within the configured timeout."""


class ClosedError(KvxError):
    """The agent or peer is closed."""
