"""Network addresses: the one place that parses "host:port" and binds listeners."""

from __future__ import annotations

import ipaddress

from kvx.errors import ConfigError


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port); ConfigError otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address must be host:port, not {text!r}")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """(host, port) -> "host:port", with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
