"""KvxConnector settings, read from ``kv_connector_extra_config``."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from kvx.config import check_backend, read_file
from kvx.errors import ConfigError

_KEYS = {
    "mode",
    "lease_s",
    "host",
    "side_channel_port",
    "metadata",
    "metadata_token_file",
    "metadata_read",
    "auth_secret_file",
    "allow_insecure",
    "transfer_timeout_s",
    "connect_timeout_s",
    "streams",
    "api_url",
    "agent_port",
    "backend",
}


@dataclasses.dataclass(frozen=True)
class KvxConnectorConfig:
    """What ``kv_connector_extra_config`` may hold (all optional).

    mode:               "pull" (decode READs after prefill; the default) or
                        "push" (prefill WRITEs each layer into decode's
                        blocks as it is computed; pull requests still work).
    lease_s:            prefill holds a finished request's blocks this long
                        unless decode reads them or renews the lease.
    host:               the address this engine's agents and side channel
                        bind and advertise (default 127.0.0.1; a routable
                        address between hosts, with auth_secret_file).
    side_channel_port:  where the scheduler serves its agents' metadata to
                        decode engines (0: a free port, announced in
                        kv_transfer_params).
    agent_port:         first data port (rank r listens on agent_port + r;
                        0: free ports).
    metadata:           "host:port" of a kvx metadata service: agents
                        register there and decode finds prefill by name.
    metadata_token_file: bearer token for that service.
    metadata_read:      "host:port" of a read replica of that service
                        (``kvx metadata --store mirror://...``): lookups
                        and watches go there, registration to ``metadata``.
    auth_secret_file:   the cluster secret (>= 16 bytes); also $KVX_AUTH_SECRET.
    allow_insecure:     listen on a non-loopback host without a secret.
    transfer_timeout_s: a receive that has not finished by then fails.
    connect_timeout_s:  side channel fetch plus agent handshake.
    streams:            connections per peer.
    backend:            "auto" (default), "tcp", "shm" or "cuda_ipc": as
                        kvx.Agent's ``backend``.
    api_url:            this engine's OpenAI URL, published in the metadata
                        service so that ``kvx proxy --metadata`` finds it.
    """

    mode: str = "pull"
    lease_s: float = 120.0
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    agent_port: int = 0
    metadata: str | None = None
    metadata_token_file: str | None = None
    metadata_read: str | None = None
    auth_secret_file: str | None = None
    allow_insecure: bool = False
    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    streams: int = 1
    backend: str = "auto"
    api_url: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvxConnectorConfig:
        extra = dict(extra or {})
        unknown = set(extra) - _KEYS
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) for KvxConnector: {sorted(unknown)}; "
                f"known: {sorted(_KEYS)}"
            )
        try:
            cfg = cls(**{k: v for k, v in extra.items()})
        except TypeError as exc:
            raise ConfigError(f"bad kv_connector_extra_config: {exc}") from None
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ConfigError(f'KvxConnector mode {self.mode!r} is not supported; use "pull" or "push"')
        for name in ("lease_s", "transfer_timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"kv_connector_extra_config {name} must be a positive number, not {v!r}")
        for name in ("side_channel_port", "agent_port"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v <= 65535:
                raise ConfigError(f"kv_connector_extra_config {name} must be a port number, not {v!r}")
        if self.metadata_read is not None and (not isinstance(self.metadata_read, str) or not self.metadata):
            raise ConfigError(
                'kv_connector_extra_config metadata_read is the "host:port" of a read replica of the '
                "service named by metadata; set metadata too"
            )
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ConfigError(f"kv_connector_extra_config streams must be 1..64, not {self.streams!r}")
        try:
            check_backend(self.backend)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config {exc}") from None

    def auth_secret(self) -> bytes | None:
        secret: bytes | None
        if self.auth_secret_file:
            secret = read_file(self.auth_secret_file).strip()
        else:
            env = os.environ.get("KVX_AUTH_SECRET")
            secret = env.encode() if env else None
        if secret is not None and len(secret) < 16:
            raise ConfigError("the kvx auth secret must be at least 16 bytes")
        return secret
