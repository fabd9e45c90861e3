"""Agent roles: the names users and URLs spell, and the ``kvx.v1.Role`` values they stand for."""

from __future__ import annotations

from typing import Literal, get_args

from kvx.v1 import metadata_pb2

RoleName = Literal["prefill", "decode", "other"]

# Keyed by str, not RoleName: callers check names they were given (`role in ROLES`) first.
ROLES: dict[str, metadata_pb2.Role] = {
    "prefill": metadata_pb2.ROLE_PREFILL,
    "decode": metadata_pb2.ROLE_DECODE,
    "other": metadata_pb2.ROLE_OTHER,
}
assert tuple(ROLES) == get_args(RoleName), "RoleName and ROLES name the same roles, in one order"


def role_filter(name: str | None) -> metadata_pb2.Role:
    """The value of role ``name`` in a list or watch request; None: every role (ROLE_UNSPECIFIED)."""
    return ROLES[name] if name else metadata_pb2.ROLE_UNSPECIFIED
