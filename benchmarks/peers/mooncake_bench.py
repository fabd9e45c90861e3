#!/usr/bin/env python3
"""Mooncake transfer engine (TCP transport, P2P handshake) on the kvx peer workloads.

Two processes on 127.0.0.1: the target registers a 2000 x 32 KiB pool and
serves it; this process is the initiator and issues synchronous batch READs.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    BLOCK_SIZE,
    NUM_BLOCKS,
    POOL_BYTES,
    SMALL_BYTES,
    XFER_BLOCK_IDS,
    XFER_BYTES,
    Output,
    Peer,
    Timeout,
    alloc_pool,
    die_with_parent,
    fill_pattern,
    host_info,
    lat_stats,
    parse_args,
    set_deadline,
    sweep,
    verify_blocks,
)

HOST = "127.0.0.1"
ENV_DEFAULTS = {
    "GLOG_minloglevel": "2",  # errors only
    "MC_LOG_LEVEL": "ERROR",
}
# The non-CUDA wheel still links libibverbs; setup.sh unpacks it (and libnl)
# into the venv instead of installing it system-wide.
NATIVE_DIR = os.path.join(sys.prefix, "lib", "native")
NATIVE_LIBS = ["libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"]


def load_engine():
    for name in NATIVE_LIBS:
        path = os.path.join(NATIVE_DIR, name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    from mooncake.engine import TransferEngine

    return TransferEngine


def make_engine():
    engine = load_engine()()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def target_main(conn, opts: dict) -> None:
    die_with_parent()
    deadline = time.monotonic() + opts["timeout"]
    try:
        engine = make_engine()
        pool = alloc_pool()
        fill_pattern(pool)
        addr = pool.ctypes.data
        rc = engine.register_memory(addr, POOL_BYTES)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        conn.send({"segment": f"{HOST}:{engine.get_rpc_port()}", "addr": addr})
        # The engine serves reads from its own threads; just wait.
        while not conn.poll(0.2):
            if time.monotonic() > deadline:
                conn.send({"error": "target timed out"})
                return
        conn.recv()
        conn.send({"done": True})
        conn.close()
        os._exit(0)  # skip native teardown
    except Exception as e:
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(e).__name__}: {e}"})


def read(engine, segment, local, remote, lengths) -> float:
    t0 = time.perf_counter()
    rc = engine.batch_transfer_sync_read(segment, local, remote, lengths)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
    return dt


def read_one(engine, segment, local, remote, length) -> float:
    t0 = time.perf_counter()
    rc = engine.transfer_sync_read(segment, local, remote, length)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"transfer_sync_read returned {rc}")
    return dt


def main() -> int:
    args = parse_args("mooncake")
    out = Output(args.json_only)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    set_deadline(args.timeout, out, "mooncake")

    from importlib.metadata import version

    peer = Peer(target_main, ({"timeout": args.timeout},))
    result: dict = {"peer": "mooncake"}
    try:
        engine = make_engine()
        pool = alloc_pool()
        addr = pool.ctypes.data
        rc = engine.register_memory(addr, POOL_BYTES)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        info = peer.recv(timeout=120)
        segment, raddr = info["segment"], info["addr"]
        if args.sweep:

            def read_blocks(local, remote_addrs, lengths) -> float:
                if len(local) == 1:
                    return read_one(engine, segment, local[0], remote_addrs[0], lengths[0])
                return read(engine, segment, local, remote_addrs, lengths)

            result.update(
                {
                    "version": version("mooncake-transfer-engine-non-cuda"),
                    "sweep": sweep(read_blocks, addr, raddr, pool),
                    **host_info(),
                }
            )
            peer.send("stop")
            peer.recv(timeout=30)
            out.result(result)
            return 0

        offs = [int(b) * BLOCK_SIZE for b in XFER_BLOCK_IDS]
        local = [addr + o for o in offs]
        remote = [raddr + o for o in offs]
        lengths = [BLOCK_SIZE] * len(offs)

        # Workload A, first request checked byte for byte.
        read(engine, segment, local, remote, lengths)
        verified, why = verify_blocks(pool, XFER_BLOCK_IDS)
        if not verified:
            raise RuntimeError(f"verification failed: {why}")
        out.log("mooncake: verified 1000 x 32 KiB read")
        for _ in range(max(0, args.warmup - 1)):
            read(engine, segment, local, remote, lengths)
        a = [read(engine, segment, local, remote, lengths) for _ in range(args.iters)]

        # Workload B: one 4 KiB read (first 4 KiB of block 1 into local block 1).
        sl, sr = addr + BLOCK_SIZE, raddr + BLOCK_SIZE
        for _ in range(args.lat_warmup):
            read_one(engine, segment, sl, sr, SMALL_BYTES)
        b = [read_one(engine, segment, sl, sr, SMALL_BYTES) for _ in range(args.lat_iters)]
        # Same thing through the batch call, for reference.
        for _ in range(args.lat_warmup):
            read(engine, segment, [sl], [sr], [SMALL_BYTES])
        bb = [read(engine, segment, [sl], [sr], [SMALL_BYTES]) for _ in range(args.lat_iters)]
        expected = np.empty(POOL_BYTES, dtype=np.uint8)
        fill_pattern(expected)
        if not np.array_equal(
            pool[BLOCK_SIZE : BLOCK_SIZE + SMALL_BYTES], expected[BLOCK_SIZE : BLOCK_SIZE + SMALL_BYTES]
        ):
            raise RuntimeError("4 KiB read returned wrong bytes")

        peer.send("stop")
        peer.recv(timeout=30)

        sa, lb, lbb = lat_stats(a), lat_stats(b), lat_stats(bb)
        result.update(
            {
                "version": version("mooncake-transfer-engine-non-cuda"),
                "throughput_gbps": XFER_BYTES / (sa["p50_us"] * 1e-6) / 1e9,
                "latency_us_p50": sa["p50_us"],
                "latency_us_p99": sa["p99_us"],
                "lat4k_us_p50": lb["p50_us"],
                "lat4k_us_p99": lb["p99_us"],
                "prepare_ms": None,  # no separate preparation step in this API
                "verified": True,
                "lat4k_batch_us_p50": lbb["p50_us"],
                "lat4k_batch_us_p99": lbb["p99_us"],
                "settings": {
                    "protocol": "tcp",
                    "metadata": "P2PHANDSHAKE",
                    "local_hostname": HOST,
                    "wheel": "mooncake-transfer-engine-non-cuda",
                    "request": "batch_transfer_sync_read per iteration (4 KiB: transfer_sync_read)",
                    "mc_env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
                    "blocks": f"{len(XFER_BLOCK_IDS)} x {BLOCK_SIZE} B of {NUM_BLOCKS}, even ids",
                    "bytes_per_iter": XFER_BYTES,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "lat_iters": args.lat_iters,
                    **host_info(),
                },
            }
        )
        out.log(
            f"mooncake: A {result['throughput_gbps']:.3f} GB/s (p50 {sa['p50_us']:.0f} us, "
            f"p99 {sa['p99_us']:.0f} us) | B p50 {lb['p50_us']:.1f} us p99 {lb['p99_us']:.1f} us "
            f"(batch call {lbb['p50_us']:.1f}/{lbb['p99_us']:.1f})"
        )
        rc = 0
    except (Timeout, Exception) as e:
        traceback.print_exc(file=sys.stderr)
        result.update(
            {"verified": False, "error": f"{type(e).__name__}: {e}", "target_exitcode": peer.proc.exitcode}
        )
        rc = 1
    finally:
        import signal

        signal.setitimer(signal.ITIMER_REAL, 0)
        peer.stop()
    out.result(result)
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
