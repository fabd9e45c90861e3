"""What one unary gRPC call costs a Python server here, whatever kvx does in it.

The metadata service's CPU per GetAgent (about 400 us on the 2-core VM) is
mostly gRPC's own. This measures the floor: a server whose one method returns
fixed bytes (no protobuf, no kvx code), in each of gRPC Python's two server
models, the asyncio one kvx uses (grpc.aio, on asyncio's event loop and
on uvloop's) and the thread-pool one, driven by a grpc.aio client process
with --concurrency calls in flight. It reports the server process's CPU per
call (user + system, from /proc) and the client's achieved rate, medians
over --rounds alternating rounds:

    python benchmarks/grpc_floor.py --calls 5000 --concurrency 8 --rounds 5

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent import futures

METHOD = "/kvx.bench.Floor/Get"
ANSWER = b"x" * 200  # about a GetAgent answer's size
# grpc.aio on asyncio's loop (the service's default), grpc.aio on uvloop's
# (kvx metadata --event-loop uvloop), the thread-pool server.
MODELS = ("aio", "aio-uvloop", "sync")


def _identity(b: bytes) -> bytes:
    return b


def _handlers(fn):  # type: ignore[no-untyped-def]
    import grpc

    return grpc.method_handlers_generic_handler(
        "kvx.bench.Floor",
        {
            "Get": grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )


def serve(model: str, threads: int) -> None:
    """Serve until stdin closes; print the port first."""
    import grpc

    if model == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(threads))
        server.add_generic_rpc_handlers((_handlers(lambda req, ctx: ANSWER),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        sys.stdin.read()
        server.stop(0)
        return

    async def get(req: bytes, ctx: object) -> bytes:
        return ANSWER

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(get),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)

    if model == "aio-uvloop":  # uvloop itself, not kvx: the server runs no kvx code
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


def drive(port: int, calls: int, concurrency: int) -> None:
    import grpc

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)
            await call(b"warm")

            async def worker(n: int) -> None:
                for _ in range(n):
                    await call(b"some-agent-name")

            await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(model: str, calls: int, concurrency: int, threads: int) -> dict[str, float]:
    me = os.path.abspath(__file__)
    server = subprocess.Popen(
        [sys.executable, me, "--serve", model, "--threads", str(threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        before = _cpu_s(server.pid)
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                me,
                "--drive",
                str(port),
                "--calls",
                str(calls),
                "--concurrency",
                str(concurrency),
            ],
            check=True,
            timeout=600,
        )
        wall = time.perf_counter() - start
        cpu = _cpu_s(server.pid) - before
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    done = calls // concurrency * concurrency
    return {"server_cpu_us_per_call": cpu / done * 1e6, "calls_per_s": done / wall}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4, help="the thread-pool server's workers")
    parser.add_argument("--serve", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--drive", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.threads)
        return 0
    if args.drive:
        drive(args.drive, args.calls, args.concurrency)
        return 0
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in MODELS}
    for _ in range(args.rounds):
        for model in rounds:
            rounds[model].append(one_round(model, args.calls, args.concurrency, args.threads))
    out = {
        "date": datetime.date.today().isoformat(),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "calls": args.calls,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
    }
    for model, runs in rounds.items():
        for key in ("server_cpu_us_per_call", "calls_per_s"):
            values = [r[key] for r in runs]
            out[f"{model}_{key}"] = round(statistics.median(values), 1)
            out[f"{model}_{key}_range"] = [round(min(values), 1), round(max(values), 1)]
    import grpc

    out["grpcio"] = grpc.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
