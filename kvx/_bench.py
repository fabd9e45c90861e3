"""``kvx bench``: kvx against the limit of its path, side by side in one run.

The target agent runs in a child process. Over tcp the limit is a raw-socket
server in another child that moves the same number of bytes per request from
one contiguous buffer with plain send/recv; over shm it is one
process_vm_readv/writev call on exactly the same ranges of the target's
memory, with nothing around it (no check, no pin, no thread hand-off).
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
    nbytes = block_size * blocks
    pool_bytes = block_size * blocks * 2  # every other block: the descriptors are not adjacent
    secret = secrets.token_bytes(32)
    if memory == "cuda":
        from kvx._datapath import gpu

        cp = gpu.cupy_module()
        if not gpu.available():
            raise ConfigError("--memory cuda needs a CUDA device, and this process sees none")
    worker = Worker(
        WorkerConfig("bench-target", pool_bytes, auth_secret=secret, streams=streams, memory=memory)
    )
    limit_path: Any = None
    try:
        with Agent("bench-initiator", auth_secret=secret, streams=streams, backend=backend) as agent:
            pool = cp.zeros(pool_bytes, cp.uint8) if memory == "cuda" else np.zeros(pool_bytes, np.uint8)
            region = agent.register(pool)
            peer = agent.add_peer(worker.metadata)
            ids = np.arange(0, 2 * blocks, 2)
            local = Descs.from_blocks(region, ids, block_size)
            remote = Descs.from_blocks(peer.regions[0], ids, block_size)
            if memory == "cuda" and peer.backend == "cuda_ipc":
                limit_name, limit_path = "cudaMemcpy device to device", CudaCopyLimit(nbytes)
            elif memory == "host" and peer.backend in ("shm", "cuda_ipc"):
                limit_name = LIMITS[peer.backend]
                limit_path = CmaLimit(
                    worker.pid, region.address, peer.regions[0].address, ids * block_size, block_size
                )
            else:  # tcp, and GPU memory staged over the socket: the host-memory socket rate
                limit_name, limit_path = "raw socket", RawClient(nbytes)
            post = peer.read if op == "read" else peer.write
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
            if memory == "cuda":
                pool = cp.asnumpy(pool)
            if op == "read":
                got = pool.reshape(-1, block_size)[ids]
                verified = bool(
                    np.array_equal(got, worker.expected(0, pool_bytes).reshape(-1, block_size)[ids])
                )
            else:
                verified = worker.call("peek", 0, block_size) == pool[:block_size].tobytes()
    finally:
        if limit_path is not None:
            limit_path.close()
        worker.stop()
    mine, limit = _stats(kvx_s, nbytes), _stats(raw_s, nbytes)
    return {
        "op": op,
        "backend": peer.backend,
        "backend_reason": peer.backend_reason,
        "limit": limit_name,
        "memory": memory,
        "data_path": _io.IMPL,
        "block_size_bytes": block_size,
        "blocks": blocks,
        "bytes_per_transfer": nbytes,
        "streams": peer.streams,
        "iters": iters,
        **mine,
        "limit_gbps": limit["throughput_gbps"],
        "limit_latency_us_p50": limit["latency_us_p50"],
        "ratio": mine["throughput_gbps"] / limit["throughput_gbps"],
        "verified": verified,
    }


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
        ]
    )


def main_json(result: dict[str, Any]) -> str:
    return json.dumps(result, sort_keys=True)
