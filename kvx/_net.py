"""Network addresses: the one place that parses "host:port", and the listener
the HTTP servers (admin API, proxy) bind."""

from __future__ import annotations

import errno
import ipaddress
import socket

from kvx.errors import ConfigError

# What a listen address without a host (":8000") binds to.
ANY_HOST = "0.0.0.0"


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ConfigError otherwise."""
    host, port = _split(text)
    if not host:
        raise ConfigError(f"address must be host:port, not {text!r}")
    return host, port


def parse_listen_address(text: str) -> tuple[str, int]:
    """Like ``parse_address``, but the host may be left out (":8000"): then it
    is "" and ``bind_listener`` listens on every IPv4 interface. Port 0 means any free port."""
    return _split(text)


def _split(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    # isascii: str.isdigit() also accepts digits such as "²", which int() refuses.
    if not sep or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536:
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


def bind_listener(listen: str, *, what: str, hint: str, backlog: int) -> socket.socket:
    """A non-blocking TCP socket listening on ``listen`` (see ``parse_listen_address``;
    a host name, or an IPv6 address in brackets, works too), for an asyncio server.

    A malformed address raises ConfigError. A failure to resolve or to bind
    raises OSError, its errno kept, reading "<what> cannot listen on <listen>:
    <reason> (<hint>)"; ``hint`` says how to pick another address, e.g.
    "pick another with --listen".
    """
    assert backlog > 0, backlog
    try:
        host, port = parse_listen_address(listen)
    except ConfigError:
        raise ConfigError(f"{what} listen address {listen!r}: expected host:port") from None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or ANY_HOST, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise _listen_error(exc, listen, what, hint) from None
    try:
        # A restarted server takes its port back while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise _listen_error(exc, listen, what, hint) from None
    return sock


def _listen_error(exc: OSError, listen: str, what: str, hint: str) -> OSError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        hint = f"is another process on that port? {hint}"
    return OSError(exc.errno, f"{what} cannot listen on {listen}: {reason} ({hint})")
