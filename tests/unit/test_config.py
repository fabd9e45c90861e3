import builtins

import pytest

import kvx
from kvx.config import parse_size


@pytest.mark.parametrize(
    "text,size",
    [("4096", 4096), ("32KiB", 32768), ("4k", 4096), ("1M", 1 << 20), ("2GiB", 2 << 30), ("1.5KiB", 1536)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "KiB", "-1", "0", "1.3", "12 parsecs", "1TiB"])
def test_parse_size_rejects(text):
    with pytest.raises(kvx.ConfigError):
        parse_size(text)


@pytest.mark.parametrize(
    "kwargs", [{"connect_s": 0}, {"io_s": -1}, {"transfer_s": float("inf")}, {"close_s": "5"}]
)
def test_timeouts_validate(kwargs):
    with pytest.raises(kvx.ConfigError):
        kvx.Timeouts(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"max_message_bytes": 0}, {"max_inflight_per_peer": True}, {"max_descs_per_message": 1 << 25}]
)
def test_limits_validate(kwargs):
    with pytest.raises(kvx.ConfigError):
        kvx.Limits(**kwargs)


def test_kvx_timeout_is_also_the_builtin():
    assert issubclass(kvx.TimeoutError, builtins.TimeoutError)
    assert issubclass(kvx.TimeoutError, kvx.TransferError)
    assert issubclass(kvx.ConfigError, ValueError)
