"""The daemons' settings: flags, then ``KVX_*`` environment variables, then a
YAML file (``--config``), then the defaults.

Every setting has one name, written three ways: ``--drain-timeout-s`` on the
command line, ``KVX_DRAIN_TIMEOUT_S`` in the environment, ``drain_timeout_s:``
in the file. Validation is pydantic's; its errors are reworded to name the
setting all three ways, so a bad value in any source says where to fix it.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvx.config import BACKENDS, check_name
from kvx.daemon.shapes import DTYPE_BYTES, PRESETS, ModelShape
from kvx.errors import ConfigError

ROLE_PORTS = {"prefill": (8100, 9100, 7100), "decode": (8200, 9200, 7200)}  # api, admin, agent


class DaemonSettings(BaseSettings):
    """What ``kvx prefill`` and ``kvx decode`` take (the descriptions are the --help texts)."""

    model_config = SettingsConfigDict(env_prefix="KVX_", extra="forbid", validate_default=True)

    role: Literal["prefill", "decode"] = Field(description="set by the command")
    engine: Literal["synthetic", "vllm", "sglang"] = Field(
        "synthetic", description="the engine: synthetic (kvx's own, no model), vllm or sglang"
    )
    name: str | None = Field(
        None, description="instance name in the metadata service (default: ROLE-HOSTNAME)"
    )
    metadata: str = Field(description="HOST:PORT of the kvx metadata service (required)")
    metadata_token_file: str | None = Field(
        None, description="file holding the metadata service's bearer token"
    )
    metadata_read: str | None = Field(
        None,
        description="HOST:PORT of a read replica of the metadata service (kvx metadata --store "
        "mirror://): the engine's agents look their peers up and watch them there, and register "
        "at --metadata (synthetic and vllm engines)",
    )
    secret_file: str = Field(description="file holding the cluster secret, at least 16 bytes (required)")
    host: str = Field("127.0.0.1", description="address the daemon's servers bind (default: 127.0.0.1)")
    advertise_host: str | None = Field(
        None, description="host in the URLs published for others (default: --host, or this host's address)"
    )
    api_port: int | None = Field(
        None, ge=0, le=65535, description="the engine's OpenAI API port (default: 8100 prefill, 8200 decode)"
    )
    admin_port: int | None = Field(
        None, ge=0, le=65535, description="the admin API port (default: 9100 prefill, 9200 decode)"
    )
    agent_port: int | None = Field(
        None, ge=0, le=65535, description="the kvx agent's data port (default: 7100 prefill, 7200 decode)"
    )
    admin_token_file: str | None = Field(
        None, description="file holding the bearer token of POST /v1/drain (without it, only SIGTERM drains)"
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, le=86400, description="longest drain before stopping anyway (default: 30)"
    )
    drain_grace_s: float = Field(
        3.0,
        ge=0,
        le=3600,
        description="least time marked draining before stopping, so routers see it (default: 3)",
    )
    backend: str = Field("auto", description="kvx backend: auto, tcp or shm (default: auto)")
    lease_s: float = Field(
        120.0, gt=0, le=86400, description="how long prefill holds a request's KV for decode (default: 120)"
    )
    transfer_timeout_s: float = Field(30.0, gt=0, le=3600, description="longest KV transfer (default: 30)")
    # The synthetic engine.
    model_shape: str = Field("tiny", description=f"KV shape: {', '.join(PRESETS)} (default: tiny)")
    layers: int | None = Field(None, ge=1, le=4096, description="override the shape's layers")
    kv_heads: int | None = Field(None, ge=1, le=4096, description="override the shape's KV heads")
    head_dim: int | None = Field(None, ge=1, le=65536, description="override the shape's head dim")
    dtype: str | None = Field(None, description=f"override the shape's dtype: {', '.join(DTYPE_BYTES)}")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block (default: 16)")
    num_blocks: int | None = Field(
        None, ge=1, le=1 << 24, description="KV blocks in the pool (default: 256 MiB worth, 16..4096)"
    )
    prefill_tokens_per_s: float = Field(
        0.0,
        ge=0,
        description="simulated prefill compute, tokens per second, on one simulated accelerator: "
        "one request at a time, first come first served (default: 0, none)",
    )
    max_inflight: int = Field(
        64, ge=1, le=4096, description="requests served at once; more wait (default: 64)"
    )
    # vllm and sglang.
    engine_python: str | None = Field(
        None, description="the Python that has the engine installed (default: this one)"
    )
    ready_timeout_s: float = Field(
        900.0, gt=0, le=86400, description="longest wait for the engine to answer and register (default: 900)"
    )
    engine_args: list[str] = Field(default_factory=list, description="set by the arguments after --")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value)

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"must be one of {', '.join(BACKENDS)}")
        return value

    @field_validator("model_shape")
    @classmethod
    def _shape(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"must be one of {', '.join(PRESETS)}")
        return value

    @field_validator("metadata", "metadata_read")
    @classmethod
    def _target(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be HOST:PORT")
        return value

    @model_validator(mode="after")
    def _defaults(self) -> DaemonSettings:
        api, admin, agent = ROLE_PORTS[self.role]
        self.api_port = api if self.api_port is None else self.api_port
        self.admin_port = admin if self.admin_port is None else self.admin_port
        self.agent_port = agent if self.agent_port is None else self.agent_port
        if self.name is None:
            self.name = check_name(f"{self.role}-{socket.gethostname()}"[:128])
        if self.advertise_host is None:
            self.advertise_host = self.host if self.host not in ("0.0.0.0", "::", "") else _own_address()
        self.shape()  # a bad override fails here, at start
        if self.metadata_read and self.engine == "sglang":
            raise ValueError(
                "metadata_read: the sglang engine's agents find their peers through SGLang's "
                "bootstrap server, not the metadata service; leave it unset"
            )
        return self

    def shape(self) -> ModelShape:
        base = PRESETS[self.model_shape]
        return ModelShape(
            base.name if self.layers is self.kv_heads is self.head_dim is self.dtype is None else "custom",
            layers=self.layers or base.layers,
            kv_heads=self.kv_heads or base.kv_heads,
            head_dim=self.head_dim or base.head_dim,
            dtype=self.dtype or base.dtype,
            planes=base.planes,
        )


def _own_address() -> str:
    """This host's address as others see it (the pod IP in Kubernetes)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# Settings the command sets itself, never a flag.
_INTERNAL = {"role", "engine_args"}


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, no defaults: pydantic decides what is missing."""
    parser.add_argument("--config", metavar="FILE.yaml", help="settings file (flags and KVX_* come first)")
    for field, info in DaemonSettings.model_fields.items():
        if field in _INTERNAL:
            continue
        kind = info.annotation
        metavar = "N" if "int" in str(kind) else ("S" if "float" in str(kind) else "VALUE")
        parser.add_argument(
            flag(field), dest=field, default=argparse.SUPPRESS, metavar=metavar, help=info.description
        )


def load(
    role: Literal["prefill", "decode"],
    flags: dict[str, Any],
    config_file: str | None = None,
    engine_args: list[str] | None = None,
) -> DaemonSettings:
    """The settings from flags > KVX_* > the YAML file > defaults, or a ConfigError
    naming each bad setting as a flag, a variable and a key."""
    if config_file is not None and not os.path.isfile(config_file):
        raise ConfigError(f"--config {config_file}: no such file")

    class _Settings(DaemonSettings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if config_file is not None:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
            return tuple(sources)

    given = {k: v for k, v in flags.items() if k in DaemonSettings.model_fields and k not in _INTERNAL}
    try:
        return _Settings(role=role, engine_args=list(engine_args or []), **given)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, config_file)) from None
    except ValueError as exc:  # a YAML file that does not parse, or is not a mapping
        raise ConfigError(f"--config {config_file}: {exc}") from None


def _explain(exc: ValidationError, config_file: str | None) -> str:
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        where = f"{flag(field)} / KVX_{field.upper()}" + (
            f" / {field}: in {config_file}" if config_file else ""
        )
        got = "" if error["type"] == "missing" else f" (got {error.get('input')!r})"
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown setting {field!r}{' in ' + config_file if config_file else ''}")
        else:
            lines.append(f"setting {field} ({where}): {error['msg']}{got}")
    return "bad settings:\n  " + "\n  ".join(lines)
