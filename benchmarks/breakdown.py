"""Where the time of one small transfer goes: a traced breakdown.

Two processes on this host, as in ``kvx bench``; both are instrumented by
wrapping kvx functions (nothing in kvx changes) with timestamps from
CLOCK_MONOTONIC, which both processes share. Each transfer is posted alone
and waited for, so the stamps of one transfer line up across the processes.
The table gives, per stage, the median time from the previous stage that the
transfer went through (stages a path does not take are left out), and the
median total.

    python benchmarks/breakdown.py --backend tcp --size 4096 --iters 2000
    python benchmarks/breakdown.py --backend shm --size 16384
    python benchmarks/breakdown.py --backend shm --size 16384 --untraced --iters 20000
    python benchmarks/breakdown.py --backend shm --size 16384 --steps --iters 20000

``--untraced`` wraps nothing and prints one JSON line instead: p10, p50 and
p99 of the same READ, kvx's own latency for before/after comparisons of a
change on the latency path (``kvx bench --sweep`` alternates each transfer
with its limit's, which disturbs the caches of both), and the CPU time per
READ of each process (all its threads, user and system), which shows what
a bounded poll before sleeping costs (``KVX_TCP_SPIN_US``,
``KVX_SERVE_SPIN_US``).

``--steps`` (shm) times, in this process, each step of the READ's inline
path called on its own (the copy's C call with and without the lease's
bookkeeping, the lease, the region table's pin, the finished Transfer),
medians in microseconds, as JSON: what is left above the copy itself.

The wrappers cost about a microsecond each; the total is a little above
``kvx bench``'s p50 for the same size.
"""

from __future__ import annotations

import argparse
import array
import functools
import json
import multiprocessing
import os
import secrets
import sys
import time
from typing import Any

import numpy as np

# The checkout's kvx, also for the spawned target.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

STAMPS: list[tuple[str, int]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.monotonic_ns()))


def wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, attr, traced)


def instrument_target() -> None:
    from kvx.backends.control import serve

    merge = serve.merge_handlers

    def merged(by_backend: Any) -> Any:
        table = merge(by_backend)
        for msg_type, handler in list(table.items()):
            box = type("Box", (), {"fn": staticmethod(handler)})
            wrap(box, "fn", f"target: handler {msg_type} in", f"target: handler {msg_type} out")
            table[msg_type] = box.fn
        return table

    serve.merge_handlers = merged
    wrap(serve, "recv_header", None, "target: header read")


def instrument_initiator() -> None:
    from kvx import agent, transfer
    from kvx._datapath import io as _io
    from kvx.backends.control import link, pinned

    wrap(agent.Peer, "_post", "post called", None)
    # A small tcp transfer's checks in one C call; the waiting thread reading its own answer.
    wrap(_io, "post_check", "post_check", "post_check returned")
    wrap(link.Connection, "_take_answer", "_take_answer called", "_take_answer returned")
    for module, cls in (
        ("kvx.backends.tcp", "TcpChannel"),
        ("kvx.backends.shm", "ShmChannel"),
    ):
        wrap(getattr(sys.modules[module], cls), "post", "channel.post", "channel.post returned")
    wrap(link.Connection, "submit", None, "request sent")
    wrap(link.Connection, "_read_response", "response header read", "response handled")
    wrap(pinned.PinnedCopy, "__call__", "copy start", "copy end")
    wrap(transfer.Transfer, "_finish", "transfer finishing", None)


def time_steps(agent: Any, peer: Any, local: Any, remote: Any, iters: int) -> dict[str, Any]:
    """Each step of the shm inline path, called alone ``iters`` times: medians in us."""
    from kvx._datapath import io as _io
    from kvx.backends.shm import DEVICE, INLINE_COPY_BYTES, REMOTE_READ
    from kvx.memory import LOCAL_WRITE, VALID
    from kvx.transfer import Op, Transfer

    channel, regions = peer._channel, agent._regions
    conn = channel._link.conns[0]
    rids = sorted(set(remote.array["region"].tolist()))
    pinned = conn.lease(rids, False)
    conn.unlease(rids)
    if pinned is None:
        raise RuntimeError("the region is not leased: the READs before did not take the leased path")
    pin = regions.pin_table()
    regions.release(pin[0])
    need, ids, words = LOCAL_WRITE | VALID, array.array("I", rids), array.array("Q", pinned)
    la, ra = local.array, remote.array
    table = (pin[1], pin[2], pin[3])
    steps = {
        "read_wait": lambda: peer.read(local, remote).wait(30),
        "post_inline": lambda: peer._post_inline(Op.READ, la, ra),
        "copy_inline": lambda: channel._copy_inline(False, la, pin[1:], need, ra, 1 << 40),
        "conn_leased_post": lambda: _io.conn_leased_post(
            conn, channel.pid, False, la, *table, need, need | DEVICE, ra, REMOTE_READ, INLINE_COPY_BYTES
        ),
        "leased_post": lambda: _io.leased_post(
            channel.pid,
            False,
            la,
            *table,
            need,
            need | DEVICE,
            ra,
            ids,
            words,
            REMOTE_READ,
            INLINE_COPY_BYTES,
        ),
        "lease_unlease": lambda: conn.lease(rids, False) is not None and conn.unlease(rids),
        "pin_release": lambda: regions.release(regions.pin_table()[0]),
        "transfer_finished": lambda: Transfer.finished(Op.READ, "x", 0, 0.0, None),
    }
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "size": int(local.total_bytes),
        "iters": iters,
    }
    for name, step in steps.items():
        for _ in range(min(iters, 500)):
            step()
        took = []
        for _ in range(iters):
            start = time.perf_counter_ns()
            step()
            took.append(time.perf_counter_ns() - start)
        out[f"{name}_us"] = round(float(np.median(took)) / 1e3, 2)
    return out


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (/proc, 10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def target_main(conn: Any, size: int, backend: str, secret: bytes, traced: bool) -> None:
    if traced:
        instrument_target()
    import kvx

    pool = np.arange(2 * size, dtype=np.uint8)
    agent = kvx.Agent("breakdown-target", auth_secret=secret, backend=backend)
    agent.register(pool)
    conn.send(agent.metadata())
    conn.recv()  # start recording
    STAMPS.clear()
    conn.recv()  # done
    conn.send(list(STAMPS))
    agent.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--size", type=int, default=4096, help="bytes of the one block read")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--untraced", action="store_true", help="no stages: the latency alone, as JSON")
    parser.add_argument(
        "--steps", action="store_true", help="shm: each step of the inline path alone, as JSON"
    )
    args = parser.parse_args()
    if args.steps and args.backend != "shm":
        parser.error("--steps times the shm backend's inline path: add --backend shm")
    traced = not (args.untraced or args.steps)

    import kvx
    import kvx.backends.shm  # noqa: F401  (instrumented below)
    import kvx.backends.tcp  # noqa: F401

    if traced:
        instrument_initiator()
    secret = secrets.token_bytes(32)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(
        target=target_main, args=(theirs, args.size, args.backend, secret, traced), daemon=True
    )
    child.start()
    try:
        if not mine.poll(60):
            raise RuntimeError("target did not start")
        metadata = mine.recv()
        with kvx.Agent("breakdown-initiator", auth_secret=secret, backend=args.backend) as agent:
            pool = np.zeros(2 * args.size, np.uint8)
            region = agent.register(pool)
            peer = agent.add_peer(metadata)
            local = kvx.Descs.from_blocks(region, [0], args.size)
            remote = kvx.Descs.from_blocks(peer.regions[0], [1], args.size)
            for _ in range(args.warmup):
                peer.read(local, remote).wait(30)
            if args.steps:
                print(json.dumps(time_steps(agent, peer, local, remote, args.iters)))
            mine.send("start")
            STAMPS.clear()
            bounds = []
            took = []
            cpu = (time.process_time(), _cpu_s(child.pid))
            for _ in range(0 if args.steps else args.iters):
                begin = len(STAMPS)
                start = time.perf_counter()
                peer.read(local, remote).wait(30)
                took.append(time.perf_counter() - start)
                if traced:
                    stamp("wait returned")
                    bounds.append((begin, len(STAMPS)))
            cpu = (time.process_time() - cpu[0], _cpu_s(child.pid) - cpu[1])
            mine.send("done")
            target = mine.recv()
            initiator = list(STAMPS)
            assert pool[: args.size].tobytes() == bytes(np.arange(2 * args.size, dtype=np.uint8)[args.size :])
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    if args.steps:
        return 0
    if not traced:
        from kvx._datapath import io as _io
        from kvx.backends.control import link, serve

        us = np.array(took) * 1e6
        print(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "backend": peer.backend,
                    "size": args.size,
                    "iters": args.iters,
                    **{f"p{q}_us": round(float(np.percentile(us, q)), 2) for q in (10, 50, 99)},
                    "initiator_cpu_us": round(cpu[0] / args.iters * 1e6, 1),
                    "target_cpu_us": round(cpu[1] / args.iters * 1e6, 1),
                    "mean_us": round(float(us.mean()), 2),
                    "spin_us": {  # the polls in effect, as kvx bench reports them
                        "wait": _io.spin_us("KVX_TCP_SPIN_US", link.SPIN_US),
                        "serve": _io.spin_us("KVX_SERVE_SPIN_US", serve.SERVE_SPIN_US),
                    },
                }
            )
        )
        return 0
    # The target's stamps that fall inside each transfer belong to it.
    offsets: dict[str, list[float]] = {}
    totals = []
    t_index = 0
    for begin, end in bounds:
        events = initiator[begin:end]
        start, stop = events[0][1], events[-1][1]
        while t_index < len(target) and target[t_index][1] < start:
            t_index += 1
        while t_index < len(target) and target[t_index][1] <= stop:
            events.append(target[t_index])
            t_index += 1
        totals.append((stop - start) / 1e3)
        seen = set()
        for name, t in events:
            if name not in seen:  # the first time a transfer passes a stage
                seen.add(name)
                offsets.setdefault(name, []).append((t - start) / 1e3)
    print(
        f"breakdown: READ of one {args.size}-byte block, backend {peer.backend}, "
        f"{args.iters} transfers, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores"
    )
    print("  median us since post | since the stage before | stage")
    previous = 0.0
    for name, samples in sorted(offsets.items(), key=lambda item: np.median(item[1])):
        at = float(np.median(samples))
        share = len(samples) / len(bounds)
        note = "" if share > 0.99 else f"   (in {share:.0%} of transfers)"
        print(f"  {at:8.1f} | {at - previous:8.1f} | {name}{note}")
        previous = at
    print(f"  total p50 {np.median(totals):.1f} us, p99 {np.percentile(totals, 99):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
