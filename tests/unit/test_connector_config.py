"""KvxConnector settings (``kv_connector_extra_config``): parsing and refusals."""

from __future__ import annotations

import pytest

from kvx.connectors.vllm.config import KvxConnectorConfig
from kvx.errors import ConfigError


def test_defaults() -> None:
    cfg = KvxConnectorConfig.from_extra(None)
    assert cfg.mode == "pull" and cfg.lease_s == 120 and cfg.host == "127.0.0.1"


def test_values_are_taken() -> None:
    cfg = KvxConnectorConfig.from_extra(
        {
            "lease_s": 5,
            "side_channel_port": 5600,
            "streams": 4,
            "metadata": "10.0.0.9:50051",
            "metadata_read": "10.0.0.9:50052",
            "api_url": "http://x:8100",
            "backend": "tcp",
        }
    )
    assert (cfg.lease_s, cfg.side_channel_port, cfg.streams, cfg.metadata) == (5, 5600, 4, "10.0.0.9:50051")
    assert cfg.backend == "tcp" and KvxConnectorConfig.from_extra({}).backend == "auto"
    assert cfg.metadata_read == "10.0.0.9:50052"


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"lease": 5}, "unknown"),
        ({"mode": "layerwise"}, 'not supported; use "pull" or "push"'),
        ({"lease_s": 0}, "positive"),
        ({"lease_s": float("inf")}, "positive"),
        ({"transfer_timeout_s": "10"}, "positive"),
        ({"side_channel_port": 70000}, "port"),
        ({"agent_port": -1}, "port"),
        ({"streams": 0}, "streams"),
        ({"backend": "udp"}, "backend must be one of auto, tcp, shm, cuda_ipc"),
        ({"metadata_read": "10.0.0.9:50052"}, "set metadata too"),
        ({"metadata": "m:1", "metadata_read": 50052}, "read replica"),
    ],
)
def test_bad_values_are_refused_with_the_key(extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        KvxConnectorConfig.from_extra(extra)


def test_secret(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVX_AUTH_SECRET", raising=False)
    assert KvxConnectorConfig().auth_secret() is None
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123\n")
    assert KvxConnectorConfig(auth_secret_file=str(path)).auth_secret() == b"0123456789abcdef0123"
    monkeypatch.setenv("KVX_AUTH_SECRET", "short")
    with pytest.raises(ConfigError, match="16 bytes"):
        KvxConnectorConfig().auth_secret()
    with pytest.raises(ConfigError):
        KvxConnectorConfig(auth_secret_file=str(tmp_path / "missing")).auth_secret()
