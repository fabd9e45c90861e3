"""A daemon's life: start, ready, serve, drain, stop.

- Start: bind the admin and API ports, start the engine (the synthetic one
  in this process; vLLM or SGLang as a child), publish the instance in the
  metadata service. Ready (``/readyz`` 200) once the engine answers and its
  agents are registered.
- Drain (SIGTERM, or ``POST /v1/drain``): publish ``draining=1`` (``kvx
  proxy`` stops routing here at its next refresh), keep serving what comes
  meanwhile, and stop once nothing is in flight, no lease is held and
  ``drain_grace_s`` has passed; at ``drain_timeout_s``, or at a second
  SIGTERM, stop at once. Then unregister, stop the engine, exit: 0 after a
  full drain, 1 when requests or leases were cut off.
- An engine that dies takes the daemon with it (exit 1, the reason logged):
  Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvx._http import MAX_HEADER_BYTES, deadline_protocol
from kvx._version import __version__
from kvx.config import read_file
from kvx.daemon.admin import build_admin
from kvx.daemon.engines import EngineProcess
from kvx.daemon.metrics import DaemonMetrics
from kvx.daemon.settings import DaemonSettings
from kvx.errors import ConfigError, KvxError

logger = logging.getLogger(__name__)

POLL_S = 0.2


def _bind(host: str, port: int, setting: str) -> socket.socket:
    """A listening socket, or a ConfigError naming the setting to change (``admin_port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on the connections of such a socket
    # only, and without it each answer's body waited for a delayed ACK of its head (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"setting {setting} (--{setting.replace('_', '-')} / KVX_{setting.upper()}): "
            f"cannot bind {host}:{port}: {exc.strerror}; choose another port, or stop what uses it"
        ) from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _read_setting(settings: DaemonSettings, field: str) -> bytes | None:
    """The stripped contents of the file a setting names (None when unset), or a
    ConfigError naming the setting."""
    path = getattr(settings, field)
    if path is None:
        return None
    try:
        return read_file(path).strip()
    except ConfigError as exc:
        raise ConfigError(
            f"setting {field} (--{field.replace('_', '-')} / KVX_{field.upper()}): {exc}"
        ) from None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the daemon handles its signals itself
            yield

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="off",
        http=deadline_protocol(),  # a client trickling its headers, or not reading, is cut off
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    return Server(config)


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.s = settings
        assert settings.name is not None and settings.advertise_host is not None
        self.name: str = settings.name
        self.metrics = DaemonMetrics(self.name, settings.role, settings.engine, __version__)
        # Every file a setting names is read now, so a wrong path fails at start and says which setting.
        for field in ("secret_file", "metadata_token_file"):
            _read_setting(settings, field)
        self.admin_token = _read_setting(settings, "admin_token_file")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError(
                f"setting admin_token_file: the token in {settings.admin_token_file} is shorter than 16 characters"
            )
        self.state = "starting"
        self.reason = "starting"
        self.started = time.monotonic()
        self.draining = threading.Event()
        self.drain_source = ""
        self.engine: Any = None  # SyntheticEngine or EngineProcess
        self._registration: Any = None
        self._client: Any = None
        self._epoch = secrets.randbits(64) or 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop_now = False
        self.api_url = self.admin_url = ""

    # What the admin API reads.

    def alive(self) -> tuple[bool, str]:
        if self.state in ("stopped", "failed"):
            return False, self.reason
        if isinstance(self.engine, EngineProcess) and self.engine.exit_code() is not None:
            return False, self.engine.died_reason()
        return True, ""

    def ready(self) -> tuple[bool, str]:
        if self.state != "ready":
            return False, self.reason if self.state == "starting" else self.state
        return True, ""

    def in_flight(self) -> int:
        if self.engine is None:
            return 0
        return self.engine.in_flight if self.s.engine == "synthetic" else self.engine.in_flight()

    def leases_held(self) -> int:
        return self.engine.leases_held if self.s.engine == "synthetic" and self.engine is not None else 0

    def status(self) -> dict[str, Any]:
        recent, totals = self.metrics.snapshot()
        out: dict[str, Any] = {
            "name": self.name,
            "role": self.s.role,
            "engine": self.s.engine,
            "state": self.state,
            "ready": self.state == "ready",
            "draining": self.draining.is_set(),
            "reason": "" if self.state == "ready" else self.reason,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "version": __version__,
            "api_url": self.api_url,
            "admin_url": self.admin_url,
            "metadata": self.s.metadata,
            "agent": None,
            "peers": [],
            "regions": [],
            "in_flight": {
                "requests": self.in_flight(),
                "transfers": int(self.metrics.transfers_in_flight._value.get()),
            },
            "recent_transfers": recent,
            "leases": {
                "held": self.leases_held(),
                "expired_total": int(self.metrics.leases_expired._value.get()),
            },
            "totals": totals,
        }
        if self.s.engine == "synthetic" and self.engine is not None:
            out.update(self.engine.status())
        return out

    def request_drain(self, source: str) -> None:
        """Thread-safe: start draining (a second call while draining changes nothing)."""
        if not self.draining.is_set():
            self.drain_source = source
            logger.info("drain requested (%s)", source)
        self.draining.set()
        self._poke()

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _on_signal(self, signum: int) -> None:
        if self.draining.is_set() or self.state == "starting":
            logger.warning("%s while %s: stopping now", signal.Signals(signum).name, self.state)
            self._stop_now = True
            self.draining.set()
            self._poke()
        else:
            self.request_drain(signal.Signals(signum).name)

    # The life.

    async def run(self) -> int:
        s = self.s
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(signum, self._on_signal, signum)
        assert s.admin_port is not None and s.api_port is not None and s.advertise_host is not None
        admin_sock = _bind(s.host, s.admin_port, "admin_port")
        api_sock = _bind(s.host, s.api_port, "api_port") if s.engine == "synthetic" else None
        api_port = api_sock.getsockname()[1] if api_sock else (s.api_port or _free_port(s.host))
        s.api_port = api_port
        self.admin_url = _url(s.advertise_host, admin_sock.getsockname()[1])
        self.api_url = _url(s.advertise_host, api_port)
        servers: list[tuple[Any, asyncio.Task]] = []
        admin = _server(build_admin(self))
        servers.append((admin, asyncio.create_task(admin.serve(sockets=[admin_sock]))))
        code = 1
        try:
            if s.engine == "synthetic":
                from kvx.daemon.synthetic import SyntheticEngine, build_api

                self.reason = "starting the agent and registering"
                self.engine = await asyncio.to_thread(
                    SyntheticEngine, s, self.metrics, self.api_url, self.admin_url
                )
                api = _server(build_api(self.engine, self.draining))
                servers.append((api, asyncio.create_task(api.serve(sockets=[api_sock]))))
                while not api.started and not self._stop_now:
                    await asyncio.sleep(0.01)
            else:
                if not await self._start_engine():
                    return 1
            if self._stop_now:
                return 1
            self.state, self.reason = "ready", ""
            self.metrics.ready.set(1)
            logger.info(
                "%s %s ready: API %s, admin %s, metadata %s",
                s.role,
                self.name,
                self.api_url,
                self.admin_url,
                s.metadata,
            )
            died = await self._serve_until_drain()
            if died:
                logger.error("%s", died)
                self.state, self.reason = "failed", died
                return 1
            code = await self._drain()
            return code
        except KvxError as exc:
            logger.error("%s %s: %s", s.role, self.name, exc)
            self.state, self.reason = "failed", str(exc)
            return 1
        finally:
            self.metrics.ready.set(0)
            await self._shutdown(servers)
            if self.state not in ("failed",):
                self.state = "stopped"

    async def _start_engine(self) -> bool:
        """vLLM or SGLang: start it, publish the instance, wait until it answers."""
        from kvx.metadata.client import MetadataClient, MetadataOptions, Registration

        s = self.s
        token = read_file(s.metadata_token_file).strip().decode() if s.metadata_token_file else None
        self._client = MetadataClient(s.metadata, MetadataOptions(token=token) if token else None)
        self.engine = EngineProcess(s, self.api_url)
        self._engine_info = {
            "engine": s.engine,
            "api_url": self.api_url,
            "admin_url": self.admin_url,
            "draining": "0",
        }
        self._registration = Registration(self._client, self._record)
        deadline = time.monotonic() + s.ready_timeout_s
        self.reason = f"waiting for {s.engine} to answer on {self.api_url}/health"
        while True:
            if self._stop_now:
                return False
            if self.engine.exit_code() is not None:
                logger.error("%s", self.engine.died_reason())
                self.state, self.reason = "failed", f"{s.engine} exited while starting"
                return False
            if time.monotonic() > deadline:
                logger.error(
                    "%s did not become ready within %.0f s (ready_timeout_s)", s.engine, s.ready_timeout_s
                )
                self.state, self.reason = "failed", "engine start timed out"
                return False
            answers = await asyncio.to_thread(self.engine.answers)
            if answers:
                self.reason = f"waiting for {s.engine}'s kvx agents to register"
                try:
                    registered = await asyncio.to_thread(self.engine.agents_registered, self._client)
                except KvxError as exc:
                    self.reason = f"metadata service: {exc}"
                    registered = False
                if registered:
                    await asyncio.to_thread(self._registration.start)
                    return True
            await asyncio.sleep(1.0)

    def _record(self) -> Any:
        from kvx.metadata.roles import ROLES
        from kvx.v1 import agent_pb2, metadata_pb2

        return metadata_pb2.AgentRecord(
            name=self.name,
            epoch=self._epoch,
            role=ROLES[self.s.role],
            labels={"kvx_daemon": "1"},
            metadata=agent_pb2.AgentMetadata(name=self.name, epoch=self._epoch),
            engine_info=self._engine_info,
            started_unix_ms=int(time.time() * 1000),
        )

    async def _serve_until_drain(self) -> str | None:
        """Until a drain is asked for: None; or why the engine died."""
        assert self._wake is not None
        while not self.draining.is_set():
            if isinstance(self.engine, EngineProcess) and self.engine.exit_code() is not None:
                return self.engine.died_reason()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
        return None

    async def _drain(self) -> int:
        s = self.s
        self.state, self.reason = "draining", f"draining ({self.drain_source})"
        self.metrics.ready.set(0)
        self.metrics.draining.set(1)
        try:
            await asyncio.to_thread(self._publish_draining)
        except KvxError as exc:
            logger.warning("could not mark %s draining in the metadata service: %s", self.name, exc)
        began = time.monotonic()
        deadline = began + s.drain_timeout_s
        while True:
            busy, leases = self.in_flight(), self.leases_held()
            if self._stop_now:
                logger.warning("stopping with %d request(s) in flight and %d lease(s) held", busy, leases)
                return 1
            if busy == 0 and leases == 0 and time.monotonic() - began >= s.drain_grace_s:
                logger.info("drained in %.1f s", time.monotonic() - began)
                self.state = "drained"
                return 0
            if time.monotonic() >= deadline:
                logger.warning(
                    "drain_timeout_s (%.0f s) passed with %d request(s) in flight and %d lease(s) held: stopping",
                    s.drain_timeout_s,
                    busy,
                    leases,
                )
                return 1
            await asyncio.sleep(POLL_S)

    def _publish_draining(self) -> None:
        if self.s.engine == "synthetic":
            self.engine.set_draining()
        elif self._registration is not None:
            self._engine_info["draining"] = "1"
            self._registration.update()

    async def _shutdown(self, servers: list[tuple[Any, asyncio.Task]]) -> None:
        for server, _ in reversed(servers):
            server.should_exit = True
        for _, task in servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        if self.engine is not None:
            if self.s.engine == "synthetic":
                await asyncio.to_thread(self.engine.close)
            else:
                if self._registration is not None:
                    await asyncio.to_thread(self._registration.stop)
                await asyncio.to_thread(self.engine.stop)
        if self._client is not None:
            self._client.close()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def main(settings: DaemonSettings) -> int:
    return asyncio.run(Daemon(settings).run())
