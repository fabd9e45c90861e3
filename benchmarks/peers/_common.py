"""Shared pieces of the peer benchmarks (workload shape, stats, process control).

The workload constants here are the same ones the kvx benchmarks use, so the
numbers of every peer can be put side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import threading
import time

import numpy as np

# Workload A: 2000 blocks of 32 KiB per side; one READ of the 1000 even blocks.
BLOCK_SIZE = 32 * 1024
NUM_BLOCKS = 2000
POOL_BYTES = BLOCK_SIZE * NUM_BLOCKS  # 65,536,000 B (64,000 KiB)
XFER_BLOCK_IDS = np.arange(0, NUM_BLOCKS, 2, dtype=np.int64)  # 1000 non-adjacent
XFER_BYTES = len(XFER_BLOCK_IDS) * BLOCK_SIZE  # 32,768,000

# Workload B: one READ of a single 4 KiB block.
SMALL_BYTES = 4 * 1024

# Descriptor-list preparation: 262,144 non-adjacent 128 B descriptors spread
# over the registered pool (250 B apart).
PREP_DESCS = 262_144
PREP_DESC_STRIDE = POOL_BYTES // PREP_DESCS
PREP_DESC_BYTES = 128

PATTERN_SEED = 0x6B7678  # arbitrary, shared by both sides


def fill_pattern(buf: np.ndarray) -> None:
    """Fill a uint8 pool with a position-dependent pattern (no two blocks alike)."""
    words = buf.view(np.uint32)
    idx = np.arange(words.size, dtype=np.uint32)
    words[:] = (idx * np.uint32(2654435761)) ^ np.uint32(PATTERN_SEED)


def verify_blocks(local: np.ndarray, block_ids: np.ndarray) -> tuple[bool, str]:
    """Check that local holds the target pattern in block_ids and zeros elsewhere."""
    expected = np.empty(POOL_BYTES, dtype=np.uint8)
    fill_pattern(expected)
    lb = local.reshape(NUM_BLOCKS, BLOCK_SIZE)
    eb = expected.reshape(NUM_BLOCKS, BLOCK_SIZE)
    if not np.array_equal(lb[block_ids], eb[block_ids]):
        bad = [int(b) for b in block_ids if not np.array_equal(lb[b], eb[b])]
        return False, f"{len(bad)} transferred blocks differ (first: {bad[:5]})"
    others = np.setdiff1d(np.arange(NUM_BLOCKS), block_ids)
    if lb[others].any():
        return False, "blocks outside the request were written"
    return True, "ok"


def alloc_pool() -> np.ndarray:
    """Pool-sized page-aligned, zeroed, pre-faulted host buffer."""
    buf = np.zeros(POOL_BYTES + 4096, dtype=np.uint8)
    off = (-buf.ctypes.data) % 4096
    pool = buf[off : off + POOL_BYTES]
    pool[::4096] = 0  # touch every page
    return pool


def lat_stats(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s, dtype=np.float64) * 1e6
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "min_us": float(a.min()),
        "mean_us": float(a.mean()),
        "n": int(a.size),
    }


def parse_args(peer: str, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"{peer} peer benchmark (kvx workloads)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations of workload A")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations of workload A")
    p.add_argument("--lat-iters", type=int, default=2000, help="timed iterations of workload B")
    p.add_argument("--lat-warmup", type=int, default=200, help="untimed iterations of workload B")
    p.add_argument("--timeout", type=float, default=300.0, help="hard limit for the whole run, seconds")
    p.add_argument("--json-only", action="store_true", help="print only the JSON result")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="instead: READs of 4 KiB to 16 MiB in 16 KiB blocks, as `kvx bench --sweep` (sweep())",
    )
    if extra:
        extra(p)
    return p.parse_args()


def host_info() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_at_start": load,
    }


class Output:
    """Keeps stdout for the single JSON line; everything else goes to stderr.

    Native libraries print on fd 1 as well, so fd 1 is pointed at stderr for the
    whole run (children inherit that) and the real stdout is kept aside.
    """

    def __init__(self, quiet: bool):
        sys.stdout.flush()
        self._json_fd = os.dup(1)
        os.dup2(2, 1)
        self.quiet = quiet

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def result(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode()
        os.write(self._json_fd, data)


class Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise Timeout("benchmark exceeded --timeout")


_PEERS: list = []


def set_deadline(seconds: float, out: Output, peer: str) -> float:
    """SIGALRM at the deadline; if that cannot be delivered (the main thread
    is stuck inside a native call), a watchdog thread ends the run a bit later."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)

    def hard_stop():
        for p in _PEERS:
            if p.proc.is_alive():
                p.proc.kill()
        out.result(
            {
                "peer": peer,
                "verified": False,
                "error": "hard timeout: blocked in a native call past --timeout",
            }
        )
        os._exit(3)

    t = threading.Timer(seconds + 20.0, hard_stop)
    t.daemon = True
    t.start()
    return time.monotonic() + seconds


def die_with_parent() -> None:
    """Child side: get SIGKILL if the parent goes away (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Peer:
    """The target process, started with the spawn method, talking over a Pipe."""

    def __init__(self, target, args: tuple):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        _PEERS.append(self)

    def recv(self, timeout: float):
        if not self.conn.poll(timeout):
            code = self.proc.exitcode
            raise Timeout(f"no message from target within {timeout}s (exitcode={code})")
        msg = self.conn.recv()
        if isinstance(msg, dict) and msg.get("error"):
            raise RuntimeError(f"target failed: {msg['error']}")
        return msg

    def send(self, obj) -> None:
        self.conn.send(obj)

    def stop(self, grace: float = 5.0) -> None:
        p = self.proc
        if p.is_alive():
            p.join(grace)
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


# `--sweep`: the sizes of `kvx bench --sweep` that fit in the pool. Blocks of
# 16 KiB (one block below that), each at the start of a 32 KiB block, so no
# two are adjacent; 64 MiB would need twice this pool and is left out.
SWEEP_SIZES = [4096 << (2 * k) for k in range(7)]  # 4 KiB .. 16 MiB
SWEEP_BLOCK = 16 * 1024


def sweep(read_blocks, local_base: int, remote_base: int, pool: np.ndarray) -> list[dict]:
    """read_blocks(local addrs, remote addrs, lengths) -> seconds, one
    complete READ; per size the same iterations and warm-up as kvx's sweep.
    The first READ at each size is checked byte for byte."""
    expected = np.empty(POOL_BYTES, dtype=np.uint8)
    fill_pattern(expected)
    points = []
    for size in SWEEP_SIZES:
        block = min(SWEEP_BLOCK, size)
        offsets = [k * BLOCK_SIZE for k in range(size // block)]
        local = [local_base + o for o in offsets]
        remote = [remote_base + o for o in offsets]
        lengths = [block] * len(offsets)
        iters = max(10, min(1000, (256 << 20) // size))
        pool[:] = 0
        read_blocks(local, remote, lengths)
        verified = all(np.array_equal(pool[o : o + block], expected[o : o + block]) for o in offsets)
        for _ in range(max(2, iters // 10)):
            read_blocks(local, remote, lengths)
        samples = [read_blocks(local, remote, lengths) for _ in range(iters)]
        stats = lat_stats(samples)
        points.append(
            {
                "bytes": size,
                "block_size_bytes": block,
                "blocks": len(offsets),
                "iters": iters,
                "throughput_gbps": size / (stats["p50_us"] * 1e-6) / 1e9,
                "latency_us_p50": stats["p50_us"],
                "latency_us_p99": stats["p99_us"],
                "verified": verified,
            }
        )
    return points
