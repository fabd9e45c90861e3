#!/usr/bin/env python3
"""NIXL (UCX backend over TCP) on the kvx peer workloads.

Two processes on 127.0.0.1: the target registers a 2000 x 32 KiB pool and keeps its
UCX worker progressing; this process is the initiator and issues READs.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import contextlib
import glob
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
    PREP_DESC_BYTES,
    PREP_DESC_STRIDE,
    PREP_DESCS,
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

# Defaults; any of them can be overridden from the environment.
ENV_DEFAULTS = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_LOG_LEVEL": "error",
    "NIXL_LOG_LEVEL": "WARN",
}


def make_agent(name: str, prog_thread: bool, err_mode: str):
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=prog_thread, backends=[])
    agent = nixl_agent(name, cfg)
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode, "num_workers": "1"})
    return agent


def block_descs(base: int, nbytes: int = BLOCK_SIZE) -> np.ndarray:
    d = np.zeros((NUM_BLOCKS, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(NUM_BLOCKS, dtype=np.uint64) * BLOCK_SIZE
    d[:, 1] = nbytes
    return d


def target_main(conn, opts: dict) -> None:
    die_with_parent()
    deadline = time.monotonic() + opts["timeout"]
    try:
        agent = make_agent("kvx-peer-target", opts["target_prog_thread"], opts["err_mode"])
        pool = alloc_pool()
        fill_pattern(pool)
        addr = pool.ctypes.data
        _registration = agent.register_memory([(addr, POOL_BYTES, 0, "")], "DRAM")  # held while serving
        conn.send({"meta": agent.get_agent_metadata(), "addr": addr})
        spins = 0
        while True:
            if opts["target_prog_thread"]:
                if conn.poll(0.05):
                    break
            else:
                # No progress thread: the worker only moves when polled.
                agent.get_new_notifs()
                spins += 1
                if spins & 255 == 0 and conn.poll(0):
                    break
            if time.monotonic() > deadline:
                conn.send({"error": "target timed out"})
                return
        conn.recv()
        conn.send({"done": True})
        conn.close()
        # Skip native teardown; the process is going away anyway.
        os._exit(0)
    except Exception as e:  # reported to the initiator, which fails loudly
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(e).__name__}: {e}"})


def wait(agent, handle, state: str) -> None:
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer failed: {state}")


def run_fresh(agent, lp, li, rp, ri) -> float:
    """One request built from the prepared lists, posted and waited on."""
    t0 = time.perf_counter()
    h = agent.make_prepped_xfer("READ", lp, li, rp, ri)
    wait(agent, h, agent.transfer(h))
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    return dt


def run_repost(agent, h) -> float:
    t0 = time.perf_counter()
    wait(agent, h, agent.transfer(h))
    return time.perf_counter() - t0


def ucx_version() -> str | None:
    import ctypes

    import nixl_cu12  # noqa: F401  (the wheel that carries UCX)

    libs = glob.glob(os.path.join(os.path.dirname(nixl_cu12.__file__) + ".libs", "libucp-*.so*"))
    if not libs:
        return None
    lib = ctypes.CDLL(libs[0])
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    return lib.ucp_get_version_string().decode()


def main() -> int:
    def extra(p):
        p.add_argument(
            "--err-mode", default="none", choices=["none", "peer"], help="UCX backend ucx_error_handling_mode"
        )
        p.add_argument(
            "--prog-thread", action="store_true", help="enable the NIXL progress thread in the initiator"
        )
        p.add_argument(
            "--target-prog-thread",
            action="store_true",
            help="enable the progress thread in the target instead of polling",
        )
        p.add_argument("--prep-reps", type=int, default=5)

    args = parse_args("nixl", extra)
    out = Output(args.json_only)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    set_deadline(args.timeout, out, "nixl")

    from importlib.metadata import version

    import nixl  # noqa: F401

    opts = {
        "timeout": args.timeout,
        "err_mode": args.err_mode,
        "target_prog_thread": args.target_prog_thread,
    }
    peer = Peer(target_main, (opts,))
    result: dict = {"peer": "nixl"}
    try:
        agent = make_agent("kvx-peer-initiator", args.prog_thread, args.err_mode)
        pool = alloc_pool()
        addr = pool.ctypes.data
        reg = agent.register_memory([(addr, POOL_BYTES, 0, "")], "DRAM")

        info = peer.recv(timeout=120)
        remote = agent.add_remote_agent(info["meta"])
        raddr = info["addr"]
        agent.make_connection(remote)
        if args.sweep:
            # Lists prepared once per size, as kvx builds its descriptors once: cache them.
            prepared: dict = {}

            def read_prepared(local, remote_addrs, lengths) -> float:
                key = (len(local), lengths[0])
                if key not in prepared:
                    ld = np.array([local, lengths, [0] * len(local)], dtype=np.uint64).T.copy()
                    rd = np.array([remote_addrs, lengths, [0] * len(local)], dtype=np.uint64).T.copy()
                    prepared[key] = (
                        agent.prep_xfer_dlist("NIXL_INIT_AGENT", ld, "DRAM"),
                        agent.prep_xfer_dlist(remote, rd, "DRAM"),
                        np.arange(len(local), dtype=np.int32),
                    )
                lh, rh, idx = prepared[key]
                return run_fresh(agent, lh, idx, rh, idx)

            result.update(
                {"version": version("nixl"), "sweep": sweep(read_prepared, addr, raddr, pool), **host_info()}
            )
            for lh, rh, _ in prepared.values():
                agent.release_dlist_handle(lh)
                agent.release_dlist_handle(rh)
            peer.send("stop")
            peer.recv(timeout=30)
            out.result(result)
            return 0

        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(addr), "DRAM")
        rp = agent.prep_xfer_dlist(remote, block_descs(raddr), "DRAM")
        idx = XFER_BLOCK_IDS.astype(np.int32)

        # Workload A, first request checked byte for byte.
        run_fresh(agent, lp, idx, rp, idx)
        verified, why = verify_blocks(pool, XFER_BLOCK_IDS)
        if not verified:
            raise RuntimeError(f"verification failed: {why}")
        out.log("nixl: verified 1000 x 32 KiB read")
        for _ in range(max(0, args.warmup - 1)):
            run_fresh(agent, lp, idx, rp, idx)
        a_fresh = [run_fresh(agent, lp, idx, rp, idx) for _ in range(args.iters)]

        h = agent.make_prepped_xfer("READ", lp, idx, rp, idx)
        for _ in range(args.warmup):
            run_repost(agent, h)
        a_repost = [run_repost(agent, h) for _ in range(args.iters)]
        agent.release_xfer_handle(h)

        # Workload B: one 4 KiB read (first 4 KiB of block 1 into local block 1).
        slp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr + BLOCK_SIZE, SMALL_BYTES, 0)], "DRAM")
        srp = agent.prep_xfer_dlist(remote, [(raddr + BLOCK_SIZE, SMALL_BYTES, 0)], "DRAM")
        one = np.zeros(1, dtype=np.int32)
        for _ in range(args.lat_warmup):
            run_fresh(agent, slp, one, srp, one)
        b_fresh = [run_fresh(agent, slp, one, srp, one) for _ in range(args.lat_iters)]
        h = agent.make_prepped_xfer("READ", slp, one, srp, one)
        for _ in range(args.lat_warmup):
            run_repost(agent, h)
        b_repost = [run_repost(agent, h) for _ in range(args.lat_iters)]
        agent.release_xfer_handle(h)
        if not np.array_equal(
            pool[BLOCK_SIZE : BLOCK_SIZE + SMALL_BYTES], _expected_slice(BLOCK_SIZE, SMALL_BYTES)
        ):
            raise RuntimeError("4 KiB read returned wrong bytes")

        # Descriptor-list preparation from numpy arrays.
        prep = np.zeros((PREP_DESCS, 3), dtype=np.uint64)
        prep[:, 1] = PREP_DESC_BYTES
        off = np.arange(PREP_DESCS, dtype=np.uint64) * PREP_DESC_STRIDE
        prep_local, prep_remote = [], []
        for _ in range(args.prep_reps):
            prep[:, 0] = addr + off
            t0 = time.perf_counter()
            ph = agent.prep_xfer_dlist("NIXL_INIT_AGENT", prep, "DRAM")
            prep_local.append(time.perf_counter() - t0)
            agent.release_dlist_handle(ph)
            prep[:, 0] = raddr + off
            t0 = time.perf_counter()
            ph = agent.prep_xfer_dlist(remote, prep, "DRAM")
            prep_remote.append(time.perf_counter() - t0)
            agent.release_dlist_handle(ph)

        for hd in (lp, rp, slp, srp):
            agent.release_dlist_handle(hd)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)

        peer.send("stop")
        peer.recv(timeout=30)

        sa, sr = lat_stats(a_fresh), lat_stats(a_repost)
        lb, lr = lat_stats(b_fresh), lat_stats(b_repost)
        result.update(
            {
                "version": version("nixl"),
                "throughput_gbps": XFER_BYTES / (sa["p50_us"] * 1e-6) / 1e9,
                "latency_us_p50": sa["p50_us"],
                "latency_us_p99": sa["p99_us"],
                "lat4k_us_p50": lb["p50_us"],
                "lat4k_us_p99": lb["p99_us"],
                "prepare_ms": float(np.median(prep_local)) * 1e3,
                "verified": True,
                "repost": {
                    "throughput_gbps": XFER_BYTES / (sr["p50_us"] * 1e-6) / 1e9,
                    "latency_us_p50": sr["p50_us"],
                    "latency_us_p99": sr["p99_us"],
                    "lat4k_us_p50": lr["p50_us"],
                    "lat4k_us_p99": lr["p99_us"],
                },
                "prepare_remote_ms": float(np.median(prep_remote)) * 1e3,
                "settings": {
                    "backend": "UCX",
                    "ucx_version": ucx_version(),
                    "wheel": "nixl-cu12 " + version("nixl-cu12"),
                    "UCX_TLS": os.environ.get("UCX_TLS"),
                    "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
                    "ucx_error_handling_mode": args.err_mode,
                    "num_workers": 1,
                    "initiator_prog_thread": args.prog_thread,
                    "target_progress": "prog_thread" if args.target_prog_thread else "polling get_new_notifs",
                    "request": "make_prepped_xfer + transfer + poll per iteration (repost: one handle re-posted)",
                    "blocks": f"{len(XFER_BLOCK_IDS)} x {BLOCK_SIZE} B of {NUM_BLOCKS}, even ids",
                    "bytes_per_iter": XFER_BYTES,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "lat_iters": args.lat_iters,
                    "prep_descs": PREP_DESCS,
                    "prep_desc_bytes": PREP_DESC_BYTES,
                    "prep_desc_stride": PREP_DESC_STRIDE,
                    "prep_reps": args.prep_reps,
                    **host_info(),
                },
            }
        )
        out.log(
            f"nixl: A {result['throughput_gbps']:.3f} GB/s (p50 {sa['p50_us']:.0f} us, "
            f"p99 {sa['p99_us']:.0f} us; repost {result['repost']['throughput_gbps']:.3f} GB/s) | "
            f"B p50 {lb['p50_us']:.1f} us p99 {lb['p99_us']:.1f} us "
            f"(repost {lr['p50_us']:.1f}/{lr['p99_us']:.1f}) | prep {result['prepare_ms']:.1f} ms"
        )
        rc = 0
    except (Timeout, Exception) as e:
        traceback.print_exc(file=sys.stderr)
        result.update(
            {"verified": False, "error": f"{type(e).__name__}: {e}", "target_exitcode": peer.proc.exitcode}
        )
        rc = 1
    finally:
        signal_off()
        peer.stop()
    out.result(result)
    return rc


def _expected_slice(start: int, n: int) -> np.ndarray:
    full = np.empty(POOL_BYTES, dtype=np.uint8)
    fill_pattern(full)
    return full[start : start + n]


def signal_off() -> None:
    import signal

    signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
