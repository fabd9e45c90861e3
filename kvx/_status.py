"""``kvx agents``, ``kvx status`` and ``kvx drain``: looking at a running cluster.

- ``agents``: the records of the metadata service as a table.
- ``status``: every daemon (``kvx prefill``, ``kvx decode``: a record whose
  ``engine_info`` has ``admin_url``) asked for ``GET /v1/status`` and, twice,
  ``GET /metrics``, all at once and under one deadline.
- ``drain``: ``POST /v1/drain`` to one daemon, then optionally waiting for it
  to finish draining (the helm chart's preStop hook).

Records and daemons' answers are untrusted: an admin URL is followed only when
it is ``http://`` or ``https://``, no answer may exceed ``MAX_BODY_BYTES`` or
the deadline, and every string shown on a terminal is stripped of control
characters. HTTP needs httpx (``pip install kvx[proxy]``), imported lazily.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvx.errors import ConfigError, ConnectError, KvxError, ProtocolError
from kvx.v1 import agent_pb2, metadata_pb2

# No answer from a daemon is read past this: a /metrics page of a busy daemon is tens of KiB.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_URL_CHARS = 2048
# Strings from records and daemons are cut to this on a terminal (and in --json).
MAX_TEXT_CHARS = 256
# Peers of one daemon kept from its /v1/status.
MAX_PEERS = 256
# Daemons asked at once; the rest wait for a connection (within the same deadline).
MAX_CONNECTIONS = 64
ADMIN_URL_KEY = "admin_url"
API_URL_KEY = "api_url"
# Daemon states of /v1/status, in the order a daemon goes through them.
STATES = ("starting", "ready", "draining", "drained", "stopped")
_ROLE_ORDER = {"prefill": 0, "decode": 1, "other": 2}


def require_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ConfigError(
            "kvx status and kvx drain need httpx: pip install 'kvx[proxy]' (or pip install httpx)"
        ) from exc
    return httpx


def show(value: object, limit: int = MAX_TEXT_CHARS) -> str:
    """``value`` as one line safe for a terminal: control characters (escape
    sequences a hostile record or daemon could carry) become '?', long text is cut."""
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return "".join(c if c.isprintable() else "?" for c in text)


def render_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A plain table, columns aligned on the widest cell; cells are already ``show``n."""
    table = [list(headers), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


def role_name(role: int) -> str:
    try:
        return metadata_pb2.Role.Name(role).removeprefix("ROLE_").lower()
    except ValueError:
        return str(role)


def backend_name(backend: int) -> str:
    try:
        return agent_pb2.Backend.Name(backend).removeprefix("BACKEND_").lower()
    except ValueError:
        return str(backend)


def format_age(seconds: float) -> str:
    if seconds < 0:
        return "-"  # a clock ahead of ours
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{s // 60 % 60:02d}m"
    return f"{s // 86400}d{s // 3600 % 24:02d}h"


def format_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "-"
    value = float(bytes_per_s)
    for unit in ("B/s", "KiB/s", "MiB/s", "GiB/s"):
        if value < 1024 or unit == "GiB/s":
            return f"{value:.0f} {unit}" if unit == "B/s" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --- kvx agents --------------------------------------------------------------------------------


def agent_view(record: metadata_pb2.AgentRecord, now_ms: int) -> dict[str, Any]:
    """One record as ``kvx agents --json`` prints it."""
    info = dict(record.engine_info)
    return {
        "name": record.name,
        "role": role_name(record.role),
        "epoch": record.epoch,
        "endpoints": [
            {"backend": backend_name(e.backend), "address": e.address} for e in record.metadata.endpoints
        ],
        "engine": info.get("engine", ""),
        "api_url": info.get(API_URL_KEY, ""),
        "admin_url": info.get(ADMIN_URL_KEY, ""),
        "draining": info.get("draining") == "1",
        "registered_unix_ms": record.registered_unix_ms,
        "age_s": round(max(0, now_ms - record.registered_unix_ms) / 1000, 3),
        "labels": dict(record.labels),
        "engine_info": info,
    }


def render_agents(views: list[dict[str, Any]], now_ms: int) -> str:
    if not views:
        return "no agents registered"
    rows = [
        [
            show(v["name"]),
            show(v["role"]),
            f"{v['epoch']:#x}",
            show(" ".join(f"{e['backend']}={e['address']}" for e in v["endpoints"]) or "-"),
            show(v["engine"] or "-"),
            show(v["api_url"] or "-"),
            "yes" if v["draining"] else "no",
            format_age((now_ms - v["registered_unix_ms"]) / 1000),
        ]
        for v in views
    ]
    return render_table(["NAME", "ROLE", "EPOCH", "ENDPOINTS", "ENGINE", "API_URL", "DRAINING", "AGE"], rows)


def list_agents(target: str, token: str | None, role: str | None, timeout_s: float) -> list[dict[str, Any]]:
    from kvx.metadata.client import MetadataClient, MetadataOptions

    client = MetadataClient(target, MetadataOptions(token=token, timeout_s=timeout_s))
    try:
        records = client.list(role=role)
    finally:
        client.close()
    now_ms = int(time.time() * 1000)
    views = [agent_view(r, now_ms) for r in records]
    views.sort(key=lambda v: (_ROLE_ORDER.get(v["role"], 9), v["name"]))
    return views


def run_agents(
    target: str, token: str | None, role: str | None, as_json: bool, timeout_s: float = 10.0
) -> str:
    views = list_agents(target, token, role, timeout_s)
    if as_json:
        return json.dumps({"metadata": target, "agents": views}, indent=2)
    return render_agents(views, int(time.time() * 1000))


# --- admin URLs and bounded HTTP ---------------------------------------------------------------


def check_admin_url(raw: str, what: str = "admin URL") -> str:
    """``raw`` without a trailing slash when it is an ``http(s)://host[:port][/prefix]``
    URL; a ConfigError that says why not otherwise (records are untrusted: a
    ``file://`` or any other scheme is never followed)."""
    if len(raw) > MAX_URL_CHARS:
        raise ConfigError(f"{what} is {len(raw)} characters long; at most {MAX_URL_CHARS}")
    if any(not c.isprintable() or c.isspace() for c in raw):
        raise ConfigError(f"{what} {show(raw)!r} holds spaces or control characters")
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ConfigError(f"{what} {show(raw)!r} is not a URL ({exc}); expected http://host:port") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(
            f"{what} {show(raw)!r} has scheme {show(parts.scheme or 'none')!r}: only http:// and https:// "
            "are followed; expected http://host:port"
        )
    if not parts.hostname:
        raise ConfigError(f"{what} {show(raw)!r} has no host; expected http://host:port")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{what} {show(raw)!r} carries a user name or password; expected http://host:port")
    if parts.query or parts.fragment:
        raise ConfigError(f"{what} {show(raw)!r} has a query or fragment; expected http://host:port")
    return raw.rstrip("/")


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


def _client(httpx: Any, timeout_s: float) -> Any:
    # trust_env=False: no proxy from the environment and no .netrc credentials sent to
    # URLs that came from records; redirects are not followed (the default) for the same reason.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS),
        trust_env=False,
        follow_redirects=False,
    )


async def fetch(
    client: Any, method: str, url: str, token: str | None = None, max_bytes: int = MAX_BODY_BYTES
) -> Answer:
    """One request; its body read up to ``max_bytes`` (ProtocolError beyond). The
    caller bounds the time (asyncio.timeout): a server that trickles bytes is
    cut off there, not by a per-read timeout it could keep resetting."""
    headers = {"Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with client.stream(method, url, headers=headers) as response:
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise ProtocolError(f"{url} answered with content-encoding {show(encoding, 40)!r}, not identity")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ProtocolError(f"{url} answered {int(declared)} bytes; at most {max_bytes} are read")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                raise ProtocolError(f"{url} answered more than {max_bytes} bytes; at most that is read")
        return Answer(response.status_code, bytes(body))


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no complete answer before the deadline"
    text = str(exc) or type(exc).__name__
    return show(f"{type(exc).__name__}: {text}" if not isinstance(exc, KvxError) else text)


# --- kvx status --------------------------------------------------------------------------------


def _text(value: object, default: str = "") -> str:
    return show(value) if isinstance(value, str) else default


def _count(value: object) -> int | None:
    """A non-negative whole number from JSON, or None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value >= 0 else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def parse_status(body: bytes) -> dict[str, Any]:
    """The fields of a daemon's ``GET /v1/status`` that status shows, each
    checked for its type; a ProtocolError when the answer is not such an object."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"/v1/status is not JSON ({show(exc, 80)})") from None
    if not isinstance(data, dict):
        raise ProtocolError("/v1/status is not a JSON object")
    state = data.get("state")
    if state not in STATES:
        raise ProtocolError(f"/v1/status state {show(state, 40)!r} is not one of {', '.join(STATES)}")
    peers = []
    raw_peers = data.get("peers")
    for peer in raw_peers[:MAX_PEERS] if isinstance(raw_peers, list) else []:
        if isinstance(peer, dict):
            peers.append(
                {
                    "name": _text(peer.get("name"), "?"),
                    "backend": _text(peer.get("backend"), "?"),
                    "alive": peer.get("alive") is True,
                }
            )
    totals = data.get("totals") if isinstance(data.get("totals"), dict) else {}
    in_flight = data.get("in_flight") if isinstance(data.get("in_flight"), dict) else {}
    assert isinstance(totals, dict) and isinstance(in_flight, dict)
    return {
        "state": state,
        "ready": data.get("ready") is True,
        "draining": data.get("draining") is True,
        "reason": _text(data.get("reason")),
        # Not its name and role: those of the record stand (a daemon could claim any).
        "engine": _text(data.get("engine")),
        "version": _text(data.get("version")),
        "uptime_s": _number(data.get("uptime_s")),
        "peers": peers,
        "in_flight": {k: _count(in_flight.get(k)) for k in ("requests", "transfers")},
        "totals": {
            k: _count(totals.get(k))
            for k in ("requests", "requests_failed", "transfers", "transfers_failed", "bytes")
        },
    }


# A /metrics page is read for kvx_transfer_bytes_total only. A daemon has a few dozen of
# its series (op, backend, peer role, outcome); a page with more, or with a longer
# line, is not believed.
_MAX_BYTES_SAMPLES = 4096
_MAX_SAMPLE_CHARS = 4096
_BYTES_LINE = re.compile(rb"^kvx_transfer_bytes_total[{ \t][^\n]*", re.MULTILINE)
# One sample: labels (quoted values may hold escaped quotes and braces), value, optional
# timestamp. The alternatives never overlap, so matching stays linear in the line's length.
_BYTES_SAMPLE = re.compile(
    rb'kvx_transfer_bytes_total(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
    rb"[ \t]+(?P<value>[^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*\r?"
)
_LABEL = re.compile(rb'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"(?P<value>(?:[^"\\]|\\.)*)"')


def transfer_bytes(text: bytes) -> float | None:
    """The sum of ``kvx_transfer_bytes_total`` (outcome ok) in a /metrics page;
    None when absent, malformed or not a finite count. A few regular expressions,
    not a full parser: a hostile 4 MiB page must cost milliseconds, not seconds."""
    total, seen = 0.0, False
    for count, line in enumerate(_BYTES_LINE.finditer(text)):
        if count >= _MAX_BYTES_SAMPLES or len(line[0]) > _MAX_SAMPLE_CHARS:
            return None
        sample = _BYTES_SAMPLE.fullmatch(line[0])
        if sample is None:
            return None
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(sample["labels"] or b"")}
        if labels.get(b"outcome", b"ok") != b"ok":
            continue
        try:
            value = float(sample["value"])
        except ValueError:
            return None
        if not math.isfinite(value) or value < 0:
            return None
        total += value
        seen = True
    return total if seen else None


@dataclasses.dataclass
class Instance:
    """One daemon as status reports it."""

    names: list[str]
    role: str
    admin_url: str
    health: str = "unreachable"  # a state of STATES, not-ready, unreachable or refused
    error: str = ""
    status: dict[str, Any] | None = None
    rate_bytes_per_s: float | None = None
    rate_source: str | None = None  # "metrics": two samples; "average": totals.bytes / uptime_s

    @property
    def name(self) -> str:
        return self.names[0]

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "names": self.names,
            "role": self.role,
            "admin_url": self.admin_url,
            "health": self.health,
            "error": self.error,
            "transfer_rate_bytes_per_s": self.rate_bytes_per_s,
            "transfer_rate_source": self.rate_source,
        }
        out.update(self.status or {})
        return out


def instances_from(records: Iterable[metadata_pb2.AgentRecord]) -> list[Instance]:
    """One instance per distinct admin URL (several records can name one daemon,
    e.g. one per rank); those whose URL is refused are kept, health "refused"."""
    by_url: dict[str, Instance] = {}
    for record in records:
        raw = record.engine_info.get(ADMIN_URL_KEY)
        if not raw:
            continue
        key = raw.rstrip("/")
        if key in by_url:
            by_url[key].names.append(record.name)
            continue
        instance = Instance([record.name], role_name(record.role), show(raw))
        try:
            instance.admin_url = check_admin_url(raw, f"agent {record.name}: engine_info[{ADMIN_URL_KEY!r}]")
        except ConfigError as exc:
            instance.health, instance.error = "refused", str(exc)
        by_url[key] = instance
    out = list(by_url.values())
    out.sort(key=lambda i: (_ROLE_ORDER.get(i.role, 9), i.name))
    return out


async def _metrics_sample(client: Any, url: str, token: str | None) -> tuple[float, float] | None:
    """(when, kvx_transfer_bytes_total) from the daemon's /metrics; None when it has no such answer."""
    try:
        answer = await fetch(client, "GET", url + "/metrics", token)
    except Exception:  # noqa: BLE001 - without metrics the rate falls back to /v1/status totals
        return None
    if answer.status != 200:
        return None
    value = transfer_bytes(answer.body)
    return None if value is None else (time.monotonic(), value)


async def _probe(
    client: Any, instance: Instance, token: str | None, interval_s: float, deadline: float
) -> None:
    """Fills ``instance`` in; returns by ``deadline`` (loop time) whatever the daemon does."""
    url = instance.admin_url
    first_task = asyncio.ensure_future(_metrics_sample(client, url, token))
    try:
        async with asyncio.timeout_at(deadline):
            answer = await fetch(client, "GET", url + "/v1/status", token)
            if answer.status != 200:
                raise ProtocolError(f"GET {url}/v1/status answered HTTP {answer.status}")
            instance.status = status = parse_status(answer.body)
    except Exception as exc:  # noqa: BLE001 - any failure of an untrusted daemon is shown, not raised
        first_task.cancel()
        instance.health, instance.error = "unreachable", describe_error(exc)
        return
    instance.health = status["state"]
    if status["state"] == "ready" and not status["ready"]:
        instance.health = "not-ready"
    try:
        async with asyncio.timeout_at(deadline):
            first = await first_task
            if first is not None and interval_s > 0:
                await asyncio.sleep(interval_s)
                second = await _metrics_sample(client, url, token)
                if second is not None and second[1] >= first[1] and second[0] > first[0]:
                    instance.rate_bytes_per_s = (second[1] - first[1]) / (second[0] - first[0])
                    instance.rate_source = "metrics"
    except TimeoutError:
        pass  # the rate falls back to the average below
    if instance.rate_source is None:
        total, uptime_s = status["totals"]["bytes"], status["uptime_s"]
        if total is not None and uptime_s:
            instance.rate_bytes_per_s, instance.rate_source = total / uptime_s, "average"


async def probe_all(
    instances: list[Instance], token: str | None, interval_s: float, timeout_s: float
) -> None:
    httpx = require_httpx()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with _client(httpx, timeout_s) as client:
        await asyncio.gather(
            *(_probe(client, i, token, interval_s, deadline) for i in instances if i.health != "refused")
        )


def collect(
    target: str,
    metadata_token: str | None,
    admin_token: str | None,
    timeout_s: float,
    interval_s: float,
) -> dict[str, Any]:
    """The report ``kvx status --json`` prints."""
    from kvx.metadata.client import MetadataClient, MetadataOptions

    if interval_s >= timeout_s:
        raise ConfigError(
            f"--interval-s {interval_s:g} must be shorter than --timeout-s {timeout_s:g}: both "
            "/metrics samples are taken within the deadline"
        )
    client = MetadataClient(target, MetadataOptions(token=metadata_token, timeout_s=timeout_s))
    try:
        records = client.list()
    finally:
        client.close()
    instances = instances_from(records)
    if instances:
        asyncio.run(probe_all(instances, admin_token, interval_s, timeout_s))
    ready = sum(1 for i in instances if i.health == "ready")
    return {
        "metadata": target,
        "ok": bool(instances) and ready == len(instances),
        "summary": {"instances": len(instances), "ready": ready},
        "instances": [i.view() for i in instances],
    }


def render_status(report: dict[str, Any]) -> str:
    summary = report["summary"]
    lines = [
        f"metadata service {show(report['metadata'])}: {summary['instances']} instances, {summary['ready']} ready"
    ]
    if not report["instances"]:
        lines.append("no daemons registered (no agent publishes engine_info admin_url)")
        return "\n".join(lines)

    def count(view: dict[str, Any], key: str) -> str:
        value = (view.get("totals") or {}).get(key)
        return "-" if value is None else str(value)

    rows = []
    for view in report["instances"]:
        peers = view.get("peers") or []
        backends = " ".join(f"{p['name']}={p['backend']}" + ("" if p["alive"] else "(down)") for p in peers)
        rate = format_rate(view["transfer_rate_bytes_per_s"])
        if view["transfer_rate_source"] == "average":
            rate += " avg"
        rows.append(
            [
                show(view["role"]),
                show(view["name"]),
                show(view["health"]),
                show(view.get("engine") or "-"),
                show(backends or "-"),
                rate,
                count(view, "transfers_failed"),
                count(view, "requests_failed"),
                show(view["admin_url"]),
            ]
        )
    headers = ["ROLE", "NAME", "HEALTH", "ENGINE", "PEERS", "RATE", "XFER_FAIL", "REQ_FAIL", "ADMIN_URL"]
    lines.append(render_table(headers, rows))
    for view in report["instances"]:
        note = view["error"] or (view.get("reason") if view["health"] != "ready" else "")
        if note:
            lines.append(f"  {show(view['name'])}: {show(note, 400)}")
    return "\n".join(lines)


# --- kvx drain ---------------------------------------------------------------------------------

DRAIN_POLL_S = 0.5


def _refused_connection(httpx: Any, exc: BaseException) -> bool:
    """The daemon is gone: nothing listens (or its host is gone) any more."""
    return isinstance(exc, httpx.ConnectError)


async def _drain(url: str, token: str, wait: bool, timeout_s: float) -> str:
    httpx = require_httpx()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with _client(httpx, min(timeout_s, 10.0)) as client:
        try:
            async with asyncio.timeout_at(deadline):
                answer = await fetch(client, "POST", url + "/v1/drain", token, max_bytes=64 * 1024)
        except TimeoutError:
            raise ConnectError(f"POST {url}/v1/drain: no answer within {timeout_s:g} s") from None
        except (httpx.HTTPError, ProtocolError) as exc:
            raise ConnectError(f"POST {url}/v1/drain failed: {describe_error(exc)}") from None
        if answer.status == 401:
            raise KvxError(
                f"{url} refused the admin token (HTTP 401): --token-file must hold the token the "
                "daemon was started with (its --admin-token-file)"
            )
        if answer.status == 403:
            raise KvxError(
                f"{url} has no admin token, so it refuses drain over HTTP (HTTP 403): start the "
                "daemon with --admin-token-file, or send it SIGTERM (which drains too)"
            )
        if answer.status not in (200, 202):
            excerpt = show(answer.body[:200].decode("utf-8", "replace"), 200)
            raise KvxError(f"POST {url}/v1/drain answered HTTP {answer.status}: {excerpt}")
        if not wait:
            return "draining"
        state = "draining"
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    poll = await fetch(client, "GET", url + "/v1/status")
                    if poll.status == 200:
                        state = parse_status(poll.body)["state"]
                        if state in ("drained", "stopped"):
                            return state
                    await asyncio.sleep(DRAIN_POLL_S)
            except TimeoutError:
                raise KvxError(
                    f"{url} is still {state} after {timeout_s:g} s; raise --timeout-s, or look at "
                    "the daemon's log for what keeps it busy"
                ) from None
            except httpx.HTTPError as exc:
                if _refused_connection(httpx, exc):
                    return "exited"
                await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))
            except ProtocolError:
                await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))


def run_drain(admin_url: str, token: str, wait: bool, timeout_s: float) -> str:
    """Drains the daemon at ``admin_url``; its state at the end: draining (no
    --wait), drained, stopped or exited. Raises KvxError on refusal or timeout."""
    url = check_admin_url(admin_url, "--admin")
    return asyncio.run(_drain(url, token, wait, timeout_s))
