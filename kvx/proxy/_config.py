"""``ProxyConfig``: what ``kvx proxy`` routes to, and its limits."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from kvx._net import parse_address, parse_listen_address
from kvx.errors import ConfigError
from kvx.metadata.client import MetadataOptions
from kvx.proxy._zmtp import parse_endpoint

MiB = 1024 * 1024


def normalize_url(url: str, what: str = "instance URL") -> str:
    """``http://host:port`` without a trailing slash, or a ConfigError that says what is wrong."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r}: expected http://host:port (the vLLM server's base URL)")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{what} {url!r}: no query or fragment, only scheme, host, port (and a path prefix)"
        )
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise ConfigError(f"{what} {url!r}: the port is not a number between 0 and 65535") from None
    return text


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """How ``kvx proxy`` finds its vLLM instances and how long it waits for them.

    prefill_urls, decode_urls: base URLs of vLLM's OpenAI servers
                     (``http://host:port``), used as given.
    metadata_target: ``host:port`` of the kvx metadata service; when set,
                     instances are also discovered there from the records'
                     ``engine_info["api_url"]``, every ``refresh_s``.
    metadata_options: token, TLS and per-call timeout for the metadata service.
    listen:          ``host:port`` the proxy serves on (``serve`` only).
    timeout_s:       longest wait for one upstream read, write or free pooled
                     connection, for an answer's headers (with
                     connect_timeout_s, from sending), and for the whole of an
                     answer that is not a stream; a stream may last longer as
                     long as bytes keep coming.
    header_timeout_s: longest wait for a client's request line and headers,
                     from its first byte (or from connecting); then the
                     connection is closed. Ends slowloris clients.
    body_timeout_s:  longest wait for a client's whole request body (408 after).
    send_timeout_s:  while a client's buffers are full, it must take 64 KiB of
                     its answer in this time, else its connection is reset (a
                     client that stops reading a stream is cut off, and the
                     instance serving it released).
    connect_timeout_s: longest wait to open a connection to an upstream.
    cooldown_s:      an instance that could not be reached is skipped this long
                     while another one is available.
    max_body_bytes:  largest request body accepted from a client (413 beyond,
                     refused before it is read when Content-Length says so).
    max_answer_bytes: largest answer of an instance that is not a stream (a
                     prefill's, a /tokenize, a decode's without stream, an
                     error), read whole within ``timeout_s`` (502 beyond).
    max_json_depth:  deepest nesting of arrays and objects in a request body (400 beyond).
    max_connections: open upstream connections, all instances together.
    mode:            "pull" (prefill, then decode pulls) or "push" (both legs
                     at once; prefill WRITEs into decode's blocks as it computes).
    prefill_kv_events: (prefill URL, ZMQ endpoint) pairs: subscribe to that
                     instance's vLLM KV cache events (``tcp://host:port`` or
                     ``ipc://path`` of its ``--kv-events-config`` publisher, then
                     optionally ``,`` and the same of its ``replay_endpoint``,
                     asked for missed batches) and route prefill by the prompt's cached
                     prefix there (KV-aware routing; off when empty).
    kv_alpha:        weight of an instance's queued prompt tokens against its
                     cached ones: score = cached_tokens - kv_alpha * queued_tokens.
    kv_max_blocks:   blocks remembered per instance; the oldest go first beyond.
    kv_max_message_bytes: largest KV event frame accepted (larger ones cut the
                     publisher off until it reconnects).
    decode_kv_usage: read each decode instance's ``vllm:kv_cache_usage_perc``
                     from its ``/metrics`` every ``refresh_s``; equally loaded
                     decode instances then go by free KV cache.
    kv_tokenize_timeout_s: longest wait for a prefill instance's ``/tokenize``
                     (then that request is routed by load).
    """

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    metadata_target: str | None = None
    metadata_options: MetadataOptions | None = None
    listen: str = "127.0.0.1:8000"
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    refresh_s: float = 2.0
    cooldown_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    # A 128k-token prompt is about 0.5 MiB of text, or 1 MiB as token ids in JSON.
    max_body_bytes: int = 8 * MiB
    max_answer_bytes: int = 64 * MiB
    # OpenAI requests nest a few levels; tool schemas a few more.
    max_json_depth: int = 64
    max_connections: int = 1024
    mode: str = "pull"
    prefill_kv_events: tuple[tuple[str, str], ...] = ()
    kv_alpha: float = 1.0
    # About 4 MiB of tokens at block size 16: ~64 bytes of key per block, a few hundred with overhead.
    kv_max_blocks: int = 262144
    kv_max_message_bytes: int = 16 * MiB
    kv_tokenize_timeout_s: float = 5.0
    decode_kv_usage: bool = False

    def __post_init__(self) -> None:
        # Normalized, deduplicated, in the order given: the first ones win ties at start.
        for field in ("prefill_urls", "decode_urls"):
            urls = getattr(self, field)
            if isinstance(urls, str):
                raise ConfigError(f"ProxyConfig.{field}: a sequence of URLs, not one string")
            normalized = tuple(dict.fromkeys(normalize_url(u) for u in urls))
            object.__setattr__(self, field, normalized)
        self._check_kv_events()
        for field in (
            "timeout_s",
            "connect_timeout_s",
            "refresh_s",
            "header_timeout_s",
            "body_timeout_s",
            "send_timeout_s",
            "kv_tokenize_timeout_s",
        ):
            if not getattr(self, field) > 0:
                raise ConfigError(f"ProxyConfig.{field} must be positive, not {getattr(self, field)!r}")
        if self.cooldown_s < 0:
            raise ConfigError(f"ProxyConfig.cooldown_s must not be negative, not {self.cooldown_s!r}")
        if not self.kv_alpha >= 0:
            raise ConfigError(f"ProxyConfig.kv_alpha must not be negative, not {self.kv_alpha!r}")
        for field in (
            "max_body_bytes",
            "max_answer_bytes",
            "max_json_depth",
            "max_connections",
            "kv_max_blocks",
            "kv_max_message_bytes",
        ):
            if not getattr(self, field) > 0:
                raise ConfigError(f"ProxyConfig.{field} must be positive, not {getattr(self, field)!r}")
        if self.mode not in ("pull", "push"):
            raise ConfigError(f'ProxyConfig.mode must be "pull" or "push", not {self.mode!r}')
        if self.metadata_target is not None:
            try:
                parse_address(self.metadata_target)
            except ConfigError:
                raise ConfigError(f"metadata service {self.metadata_target!r}: expected host:port") from None
        try:
            parse_listen_address(self.listen)
        except ConfigError:
            raise ConfigError(f"listen address {self.listen!r}: expected host:port") from None

    def _check_kv_events(self) -> None:
        pairs: dict[str, str] = {}
        for pair in self.prefill_kv_events:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ConfigError(f"ProxyConfig.prefill_kv_events: {pair!r} is not a (URL, endpoint) pair")
            url = normalize_url(pair[0], "--prefill-kv-events: prefill URL")
            endpoint = str(pair[1]).strip()
            if url not in self.prefill_urls:
                raise ConfigError(
                    f"--prefill-kv-events {url}: not a prefill instance; give it with --prefill {url} too"
                )
            if url in pairs:
                raise ConfigError(f"--prefill-kv-events {url}: given twice; one endpoint per instance")
            parts = endpoint.split(",")
            expected = (
                f"--prefill-kv-events {url}: endpoint {endpoint!r}: expected tcp://host:port or "
                "ipc://path (the instance's --kv-events-config endpoint, with its host for *), "
                "optionally followed by a comma and the same of its replay_endpoint"
            )
            if len(parts) > 2:
                raise ConfigError(expected)
            for part in parts:
                try:
                    parse_endpoint(part)
                except ConfigError as exc:
                    raise ConfigError(f"{expected}: {exc}") from None
            pairs[url] = endpoint
        object.__setattr__(self, "prefill_kv_events", tuple(pairs.items()))
