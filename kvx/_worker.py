"""An agent in a child process, driven over a pipe.

``kvx demo`` and ``kvx bench`` run their remote side with it, and the
multi-process tests use it as the peer they kill, stop and restart. The
child fills its pool with bytes derived from a seed, so the parent can check
every byte it reads without a copy of the pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from typing import Any

import numpy as np

START_TIMEOUT_S = 60.0

# How workers start: a fresh interpreter each (spawn), unless use_forkserver() was called.
_context: Any = multiprocessing.get_context("spawn")


def use_forkserver() -> None:
    """Start later workers by forking a server process that has kvx imported already: a
    start then takes a fork and the agent's own setup, not a new interpreter importing
    kvx (about 0.4 s). The test suite starts hundreds of workers this way.

    The server is itself started by exec, never opens a gRPC channel (it imports grpc,
    which starts nothing) and runs no thread of kvx's, so nothing is forked that a forked
    child could not own (see tests/unit/test_spawn.py).

    Each worker's ``os.environ`` is its parent's as it is when the worker starts, as a
    spawned one's would be. What an interpreter or a library reads only as it loads
    (LD_PRELOAD, PYTHON* flags, OMP_*/OPENBLAS_*, gRPC's fork support) comes from the
    server's environment, the parent's when its first worker started; so do the working
    directory, umask, limits and ``sys.path``. Where these matter, spawn."""
    global _context
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvx._worker", "kvx"])
    _context = ctx


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The deterministic pool contents for ``seed``."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


@dataclasses.dataclass
class WorkerConfig:
    name: str
    pool_bytes: int
    seed: int = 1
    auth_secret: bytes | None = None
    listen: str = "127.0.0.1:0"
    native: str = ""  # KVX_NATIVE for the child: "1", "0" or "" (automatic)
    streams: int = 1
    timeouts: dict = dataclasses.field(default_factory=dict)
    limits: dict = dataclasses.field(default_factory=dict)
    remote_access: bool = True
    metadata: str | None = None  # "host:port" of a metadata service to register with
    role: str = "other"
    lease_ttl_s: int = 10
    backend: str = "auto"
    memory: str = "host"  # where the pool lives: "host", or "cuda" (CUDA device 0, needs kvx[gpu])
    shared: bool = False  # a host pool in a kvx shared segment (kvx.alloc_shared)


def _main(conn: Any, config: WorkerConfig, env: dict[str, str]) -> None:
    # A worker forked from the fork server would otherwise have the server's environment.
    os.environ.clear()
    os.environ.update(env)
    # A forked worker is handed the write end of the pipe whose end tells the fork server
    # that its parent is gone; held here, the server (and so this worker) would outlive
    # the parent. A worker starts no process: let it go.
    server: Any = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    # Die with the parent (a forked worker: with the fork server, which ends with the
    # parent): a test or benchmark that crashes leaves no agent behind. The pipe to the
    # parent ends too, unless a process the parent started still holds it.
    parent = os.getppid()
    from kvx._datapath import io as _io

    _io.use(config.native)
    import kvx

    pool = pattern(config.seed, config.pool_bytes).copy()
    if config.shared:
        shared = kvx.alloc_shared(config.pool_bytes)
        shared[:] = pool
        pool = shared
    if config.memory == "cuda":
        from kvx._datapath import gpu

        pool = gpu.cupy_module().asarray(pool)
    agent = kvx.Agent(
        config.name,
        listen=config.listen,
        auth_secret=config.auth_secret,
        streams=config.streams,
        timeouts=kvx.Timeouts(**config.timeouts),
        limits=kvx.Limits(**config.limits),
        metadata=config.metadata,
        role=config.role,
        metadata_options=kvx.MetadataOptions(lease_ttl_s=config.lease_ttl_s),
        backend=config.backend,
    )
    regions = {0: agent.register(pool, remote_access=config.remote_access)}
    conn.send(("ready", agent.metadata(), os.getpid(), regions[0].id))
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                break
            continue
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                break
            conn.send(("ok", _command(agent, pool, regions, cmd, args)))
        except Exception as exc:  # report to the parent, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    agent.close()


def _command(agent: Any, pool: np.ndarray, regions: dict, cmd: str, args: list) -> Any:
    if cmd == "metadata":
        return agent.metadata()
    if cmd == "getenv":
        return os.environ.get(args[0])
    if cmd == "peek":
        offset, length = args
        view = pool[offset : offset + length]
        return (view.get() if hasattr(view, "get") else view).tobytes()  # .get(): a CuPy array
    if cmd == "fill":
        pool[:] = args[0]
        return None
    if cmd == "notifications":
        return [(n.peer, n.data) for n in agent.notifications(args[0] if args else 0.0)]
    if cmd == "register":
        size, remote_access = args
        buf = np.zeros(size, np.uint8)
        region = agent.register(buf, remote_access=remote_access)
        regions[region.id] = region
        return region.id
    if cmd == "fill_region":  # every byte of a region registered with "register"
        rid, value = args
        region = regions[rid]
        np.frombuffer((ctypes.c_uint8 * region.size_bytes).from_address(region.address), np.uint8)[:] = value
        return None
    if cmd == "deregister":
        agent.deregister(regions.pop(args[0]))
        return None
    if cmd == "read_from":
        # The child as initiator: read from a peer into its own pool.
        peer_md, local_off, remote_id, remote_off, length = args
        peer = agent.add_peer(peer_md)
        peer.read(
            regions[0].descs(local_off, length), peer.region(remote_id).descs(remote_off, length)
        ).wait()
        return None
    raise ValueError(f"unknown command {cmd!r}")


class Worker:
    """The parent's handle on an agent running in a child process."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        ctx = _context
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_main,
            args=(child, config, dict(os.environ)),
            name=f"kvx-worker-{config.name}",
            daemon=True,
        )
        self.process.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"worker {config.name!r} did not start within {START_TIMEOUT_S}s")
        try:
            _, self.metadata, self.pid, self.region_id = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"worker {config.name!r} died while starting (exit code {self.process.exitcode})"
            ) from None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.config.name!r} did not answer {cmd!r} within {timeout_s}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self.config.name!r}: {value}")
        return value

    def expected(self, offset: int, length: int) -> np.ndarray:
        """What the worker's pool held at start, without asking it."""
        return pattern(self.config.seed, offset + length)[offset:]

    def signal(self, signum: int) -> None:
        if self._alive():
            pid = self.process.pid
            assert pid is not None  # started in __init__
            os.kill(pid, signum)

    def freeze(self) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{self.process.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.005)
        raise TimeoutError(f"worker {self.config.name!r} did not stop")

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def _alive(self) -> bool:
        try:
            return self.process.is_alive()
        except ValueError:  # closed by an earlier stop()
            return False

    def kill(self) -> None:
        if self._alive():
            self.process.kill()
            self.process.join(10)

    def stop(self) -> None:
        if self._alive():
            try:
                self.signal(signal.SIGCONT)
                self.call("stop", timeout_s=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.process.join(10)
        self.kill()
        self._conn.close()
        if not self._alive():
            with contextlib.suppress(ValueError):
                self.process.close()  # releases its sentinel descriptor
