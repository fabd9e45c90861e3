"""``kvx bench``: kvx against the limit of its path, side by side in one run.

The target agent runs in a child process. Over tcp the limit is a raw-socket
server in another child that moves the same number of bytes per request from
one contiguous buffer with plain send/recv; over shm it is one
process_vm_readv/writev call on exactly the same ranges of the target's
memory, with nothing around it (no check, no pin, no thread hand-off).
Over rdma (``--backend rdma``: both agents open the endpoint that
KVX_RDMA_PROVIDER names, else the best NIC, else libfabric's tcp provider)
the limit shown is the raw socket's.
Transfers alternate with the limit's, so noise on a shared machine hits both
alike.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

import numpy as np

from kvx._datapath import io as _io
from kvx._worker import Worker, WorkerConfig
from kvx.agent import Agent
from kvx.backends.control import link as _link
from kvx.backends.control import serve as _serve
from kvx.descs import Descs
from kvx.errors import ConfigError


def _raw_server(listen_conn: Any, nbytes: int) -> None:
    parent = os.getppid()
    srv = socket.create_server(("127.0.0.1", 0))
    listen_conn.send(srv.getsockname()[1])
    srv.settimeout(60)
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(5)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while True:
        try:
            req = sock.recv(9)
        except TimeoutError:
            if os.getppid() != parent:
                return
            continue
        if len(req) < 9:
            return
        op, n = struct.unpack("<BQ", req)
        if op == 0:  # read: send n bytes
            sock.sendall(view[:n])
        else:  # write: take n bytes, answer one
            got = 0
            while got < n:
                got += sock.recv_into(view[got:n])
            sock.sendall(b"\x01")


class RawClient:
    def __init__(self, nbytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_raw_server, args=(child_conn, nbytes), daemon=True)
        self.process.start()
        if not parent_conn.poll(60):
            raise RuntimeError("raw socket server did not start")
        port = parent_conn.recv()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(nbytes)
        self.view = memoryview(self.buf)

    def transfer(self, op: str, n: int) -> float:
        start = time.perf_counter()
        if op == "read":
            self.sock.sendall(struct.pack("<BQ", 0, n))
            got = 0
            while got < n:
                k = self.sock.recv_into(self.view[got:n])
                if not k:
                    raise RuntimeError("raw server closed")
                got += k
        else:
            self.sock.sendall(struct.pack("<BQ", 1, n))
            self.sock.sendall(self.view[:n])
            if self.sock.recv(1) != b"\x01":
                raise RuntimeError("raw server closed")
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


def _progress(done: int, total: int, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _stats(samples_s: list[float], nbytes: int) -> dict[str, float]:
    arr = np.asarray(samples_s)
    median = float(np.median(arr))
    return {
        "throughput_gbps": nbytes / median / 1e9,
        "latency_us_p50": median * 1e6,
        "latency_us_p99": float(np.percentile(arr, 99)) * 1e6,
    }


class CmaLimit:
    """One process_vm_readv/writev of the very ranges a kvx transfer moves."""

    def __init__(
        self, pid: int, local_base: int, remote_base: int, offsets: np.ndarray, block_size: int
    ) -> None:
        self.pid = pid
        self.local = (local_base + offsets).astype(np.uint64)
        self.remote = (remote_base + offsets).astype(np.uint64)
        self.lens = np.full(len(offsets), block_size, np.uint64)

    def transfer(self, op: str, n: int) -> float:
        move = _io.vm_readv if op == "read" else _io.vm_writev
        start = time.perf_counter()
        move(self.pid, self.local, self.lens, self.remote, self.lens)
        return time.perf_counter() - start

    def close(self) -> None:
        pass


class CudaCopyLimit:
    """One cudaMemcpyAsync of the transfer's size between two buffers on the
    GPU: the device-to-device copy bandwidth the cuda_ipc path aims at."""

    def __init__(self, nbytes: int) -> None:
        from kvx._datapath import gpu

        self.cp = gpu.cupy_module()
        self.src = self.cp.zeros(nbytes, self.cp.uint8)
        self.dst = self.cp.zeros(nbytes, self.cp.uint8)
        self.stream = self.cp.cuda.Stream(non_blocking=True)

    def transfer(self, op: str, n: int) -> float:
        start = time.perf_counter()
        self.dst.data.copy_from_device_async(self.src.data, n, self.stream)
        self.stream.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        pass


LIMITS = {"tcp": "raw socket", "shm": "process_vm_readv", "cuda_ipc": "process_vm_readv"}
MEMORIES = ("host", "cuda")


class _Session:
    """One target worker, one initiator agent and the limit of the path
    between them, reused for every transfer size measured."""

    def __init__(self, pool_bytes: int, streams: int, backend: str, memory: str) -> None:
        self.memory = memory
        secret = secrets.token_bytes(32)
        if memory == "cuda":
            from kvx._datapath import gpu

            self.cp = gpu.cupy_module()
            if not gpu.available():
                raise ConfigError("--memory cuda needs a CUDA device, and this process sees none")
        # rdma by name: the target opens the same endpoint (the tcp provider where no NIC is).
        target_backend = "rdma" if backend == "rdma" else "auto"
        self.worker = Worker(
            WorkerConfig(
                "bench-target",
                pool_bytes,
                auth_secret=secret,
                streams=streams,
                memory=memory,
                backend=target_backend,
            )
        )
        self.agent: Agent | None = None
        self.raw: RawClient | None = None
        try:
            self.agent = Agent("bench-initiator", auth_secret=secret, streams=streams, backend=backend)
            self.pool = (
                self.cp.zeros(pool_bytes, self.cp.uint8)
                if memory == "cuda"
                else np.zeros(pool_bytes, np.uint8)
            )
            self.region = self.agent.register(self.pool)
            self.peer = self.agent.add_peer(self.worker.metadata)
        except BaseException:
            self.close()
            raise

    def limit(self, block_size: int, ids: np.ndarray, nbytes: int) -> tuple[str, Any]:
        peer = self.peer
        if self.memory == "cuda" and peer.backend == "cuda_ipc":
            return "cudaMemcpy device to device", CudaCopyLimit(nbytes)
        if self.memory == "host" and peer.backend in ("shm", "cuda_ipc"):
            return LIMITS[peer.backend], CmaLimit(
                self.worker.pid, self.region.address, peer.regions[0].address, ids * block_size, block_size
            )
        # tcp, and GPU memory staged over the socket: the host-memory socket rate.
        if self.raw is None:
            self.raw = RawClient(len(self.pool) // 2)
        return "raw socket", self.raw

    def measure(
        self, op: str, block_size: int, blocks: int, iters: int, warmup: int, progress: bool = False
    ) -> dict[str, Any]:
        """Transfers of ``blocks`` non-adjacent blocks (every other one),
        alternating with the limit's; then the bytes are checked."""
        nbytes = block_size * blocks
        ids = np.arange(0, 2 * blocks, 2)
        local = Descs.from_blocks(self.region, ids, block_size)
        remote = Descs.from_blocks(self.peer.regions[0], ids, block_size)
        limit_name, limit_path = self.limit(block_size, ids, nbytes)
        post = self.peer.read if op == "read" else self.peer.write
        kvx_s: list[float] = []
        raw_s: list[float] = []
        for i in range(warmup + iters):
            raw_t = limit_path.transfer(op, nbytes)
            start = time.perf_counter()
            post(local, remote).wait(60)
            kvx_t = time.perf_counter() - start
            if i >= warmup:
                raw_s.append(raw_t)
                kvx_s.append(kvx_t)
                _progress(i - warmup + 1, iters, progress)
        mine, limit = _stats(kvx_s, nbytes), _stats(raw_s, nbytes)
        return {
            "bytes": nbytes,
            "block_size_bytes": block_size,
            "blocks": blocks,
            "iters": iters,
            **mine,
            "limit": limit_name,
            "limit_gbps": limit["throughput_gbps"],
            "limit_latency_us_p50": limit["latency_us_p50"],
            "limit_latency_us_p99": limit["latency_us_p99"],
            "ratio": mine["throughput_gbps"] / limit["throughput_gbps"],
            "verified": self.verify(op, block_size, ids),
        }

    def pingpong(self, op: str, iters: int = 1000) -> dict[str, float]:
        """A 4 KiB kvx transfer against a bare Python socket ping-pong of the
        same bytes between two processes, alternating: the latency floor of
        a request and its answer on this machine, whatever the backend."""
        if self.raw is None:
            self.raw = RawClient(len(self.pool) // 2)
        local = Descs.from_blocks(self.region, [0], 4096)
        remote = Descs.from_blocks(self.peer.regions[0], [0], 4096)
        post = self.peer.read if op == "read" else self.peer.write
        kvx_s, raw_s = [], []
        for i in range(iters + iters // 10):
            raw_t = self.raw.transfer(op, 4096)
            start = time.perf_counter()
            post(local, remote).wait(60)
            kvx_t = time.perf_counter() - start
            if i >= iters // 10:
                kvx_s.append(kvx_t)
                raw_s.append(raw_t)
        mine, raw = _stats(kvx_s, 4096), _stats(raw_s, 4096)
        return {
            "kvx_us_p50": mine["latency_us_p50"],
            "kvx_us_p99": mine["latency_us_p99"],
            "socket_us_p50": raw["latency_us_p50"],
            "ratio_p50": mine["latency_us_p50"] / raw["latency_us_p50"],
        }

    def verify(self, op: str, block_size: int, ids: np.ndarray) -> bool:
        pool = self.cp.asnumpy(self.pool) if self.memory == "cuda" else self.pool
        if op == "read":
            got = pool[: 2 * len(ids) * block_size].reshape(-1, block_size)[ids]
            want = self.worker.expected(0, 2 * len(ids) * block_size).reshape(-1, block_size)[ids]
            return bool(np.array_equal(got, want))
        return bool(self.worker.call("peek", 0, block_size) == pool[:block_size].tobytes())

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.peer.backend,
            "backend_reason": self.peer.backend_reason,
            "memory": self.memory,
            "data_path": _io.IMPL,
            "streams": self.peer.streams,
            # The bounded polls before a thread sleeps (both processes read the same
            # environment): the waiting thread's for its tcp answer, the target's for
            # its next request.
            "spin_us": {
                "wait": _io.spin_us("KVX_TCP_SPIN_US", _link.SPIN_US),
                "serve": _io.spin_us("KVX_SERVE_SPIN_US", _serve.SERVE_SPIN_US),
            },
        }

    def close(self) -> None:
        try:
            if self.raw is not None:
                self.raw.close()
            if self.agent is not None:
                self.agent.close()
        finally:
            self.worker.stop()


def run(
    op: str,
    block_size: int,
    blocks: int,
    iters: int,
    streams: int,
    warmup: int,
    progress: bool,
    backend: str = "auto",
    memory: str = "host",
) -> dict[str, Any]:
    # Every other block: the descriptors are not adjacent.
    session = _Session(block_size * blocks * 2, streams, backend, memory)
    try:
        point = session.measure(op, block_size, blocks, iters, warmup, progress)
        about = session.describe()
    finally:
        session.close()
    return {
        "op": op,
        **about,
        "bytes_per_transfer": point.pop("bytes"),
        **point,
    }


# The transfer sizes of ``kvx bench --sweep``: 4 KiB to 64 MiB.
SWEEP_SIZES = tuple(4096 << (2 * k) for k in range(8))
SWEEP_BLOCK = 16 * 1024


def sweep_plan(size: int) -> tuple[int, int, int, int]:
    """(block size, blocks, measured transfers, warm-up) at one sweep size:
    16 KiB blocks (one block below that), and enough transfers that each
    size takes about the same time."""
    block = min(SWEEP_BLOCK, size)
    iters = max(10, min(1000, (256 << 20) // size))
    return block, size // block, iters, max(2, iters // 10)


def sweep(
    op: str,
    streams: int,
    backend: str = "auto",
    memory: str = "host",
    sizes: tuple[int, ...] = SWEEP_SIZES,
    progress: bool = False,
) -> dict[str, Any]:
    """The curve: transfer size -> throughput, latency and ratio to the limit."""
    session = _Session(2 * max(sizes), streams, backend, memory)
    points = []
    try:
        for size in sizes:
            block, blocks, iters, warmup = sweep_plan(size)
            points.append(session.measure(op, block, blocks, iters, warmup))
            if progress:
                sys.stderr.write(f"  {_size(size):>8}: {points[-1]['throughput_gbps']:.3f} GB/s\n")
        pingpong = session.pingpong(op)
        about = session.describe()
    finally:
        session.close()
    return {"op": op, **about, "limit": points[0]["limit"], "points": points, "pingpong": pingpong}


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def render_sweep(result: dict[str, Any]) -> str:
    r = result
    lines = [
        f"kvx bench --sweep: {r['op']}, {r['backend']}, {r['memory']} memory, {r['streams']} stream(s) "
        f"({r['data_path']} data path); limit: {r['limit']}",
        f"  {'size':>8} {'blocks':>7} {'kvx GB/s':>9} {'p50 us':>9} {'p99 us':>9} "
        f"{'limit GB/s':>10} {'p50 us':>9} {'ratio':>6}",
    ]
    for p in r["points"]:
        lines.append(
            f"  {_size(p['bytes']):>8} {p['blocks']:>7} {p['throughput_gbps']:9.3f} {p['latency_us_p50']:9.1f} "
            f"{p['latency_us_p99']:9.1f} {p['limit_gbps']:10.3f} {p['limit_latency_us_p50']:9.1f} "
            f"{p['ratio']:6.2f}" + ("" if p["verified"] else "  DATA NOT VERIFIED")
        )
    pp = r["pingpong"]
    lines.append(
        f"  4 KiB, alternating with a bare Python socket ping-pong of the same bytes: kvx p50 "
        f"{pp['kvx_us_p50']:.1f} us (p99 {pp['kvx_us_p99']:.1f}), socket p50 {pp['socket_us_p50']:.1f} us, "
        f"{pp['ratio_p50']:.2f}x"
    )
    lines.append(f"  backend: {r['backend']}: {r['backend_reason']}")
    lines.append(_polls(r))
    return "\n".join(lines)


def _polls(r: dict[str, Any]) -> str:
    spin = r["spin_us"]
    return (
        f"  polls before sleeping: a waiting thread up to {spin['wait']} us (KVX_TCP_SPIN_US), "
        f"the target's serving thread up to {spin['serve']} us (KVX_SERVE_SPIN_US)"
    )


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """Draw the curve (throughput and ratio against size) into ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib: pip install 'kvx[bench]' ({exc})") from None
    points = result["points"]
    sizes = [p["bytes"] for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    top.plot(sizes, [p["throughput_gbps"] for p in points], "o-", label=f"kvx ({result['backend']})")
    top.plot(sizes, [p["limit_gbps"] for p in points], "s--", label=f"limit: {result['limit']}")
    top.set_ylabel("GB/s")
    top.set_title(f"kvx bench --sweep: {result['op']}, {result['backend']}, {result['memory']} memory")
    top.legend()
    top.grid(True, which="both", alpha=0.3)
    bottom.plot(sizes, [p["ratio"] for p in points], "o-")
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    bottom.set_ylabel("ratio to the limit")
    bottom.set_xlabel("bytes per transfer")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(sizes, [_size(s) for s in sizes], rotation=30)
    bottom.set_ylim(0, max(1.1, max(p["ratio"] for p in points) * 1.1))
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict[str, Any]) -> str:
    r = result
    return "\n".join(
        [
            f"kvx bench: {r['op']} of {r['blocks']} non-adjacent blocks x {r['block_size_bytes']} bytes "
            f"= {r['bytes_per_transfer'] / 2**20:.1f} MiB per transfer, {r['iters']} transfers, "
            f"{r['streams']} stream(s), {r['backend']}, {r['memory']} memory ({r['data_path']} data path)",
            f"  kvx:              {r['throughput_gbps']:7.3f} GB/s   latency p50 {r['latency_us_p50']:9.1f} us   "
            f"p99 {r['latency_us_p99']:9.1f} us",
            f"  {r['limit'] + ':':<18}{r['limit_gbps']:7.3f} GB/s   latency p50 {r['limit_latency_us_p50']:9.1f} us",
            f"  ratio:            {r['ratio']:.2f} of the {r['limit']} limit",
            f"  backend:          {r['backend']}: {r['backend_reason']}"
            + ("" if r["verified"] else "   (DATA NOT VERIFIED)"),
            _polls(r),
        ]
    )


def main_json(result: dict[str, Any]) -> str:
    return json.dumps(result, sort_keys=True)
