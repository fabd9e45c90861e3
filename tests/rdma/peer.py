"""One side of a hardware RDMA test, run as its own process (tests/rdma/test_verbs_hw.py).

    python -m tests.rdma.peer target    --size N [--device D] [--gpu G]
    python -m tests.rdma.peer initiator --size N [--device D] [--gpu G] --case CASE
    python -m tests.rdma.peer loopback  --size N [--device D] [--gpu G]

Lines of JSON on stdin/stdout carry the connection info between the two, as
kvx's control connection would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from kvx.backends.rdma import verbs

PIECE = 32 * 1024


class Buffer:
    """Host memory, or GPU memory through CuPy (--gpu)."""

    def __init__(self, size: int, gpu: int, seed: int) -> None:
        data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.gpu = gpu
        if gpu >= 0:
            import cupy

            cupy.cuda.Device(gpu).use()
            self.array = cupy.asarray(data)
            self.addr = int(self.array.data.ptr)
        else:
            self.array = data
            self.addr = int(data.ctypes.data)

    def host(self) -> np.ndarray:
        return self.array.get() if self.gpu >= 0 else self.array


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def hear() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the test closed the pipe")
    return json.loads(line)


def target(args: argparse.Namespace) -> None:
    ep = verbs.Endpoint(args.device)
    buf = Buffer(args.size, args.gpu, seed=1)
    mr = ep.register(buf.addr, args.size, remote_read=True, remote_write=True, device=args.gpu)
    half, info = ep.prepare()
    say({"info": info.hex(), "addr": buf.addr, "key": mr.key, "how": mr.how})
    ep.complete(half, bytes.fromhex(hear()["info"]))
    say({"ready": True})
    while hear().get("do") != "quit":
        say({"sha256": hashlib.sha256(buf.host().tobytes()).hexdigest()})


def pieces(ep, peer, op, local, remote_addr, key, count, timeout_ms=30_000, offset=0):
    addrs = [local.addr + i * PIECE for i in range(count)]
    remote = [remote_addr + offset + (count - 1 - i) * PIECE for i in range(count)]  # scattered
    ep.post(op, peer, addrs, [PIECE] * count, remote, [PIECE] * count, [key] * count, timeout_ms)


def initiator(args: argparse.Namespace) -> None:
    first = hear()
    ep = verbs.Endpoint(args.device)
    buf = Buffer(args.size, args.gpu, seed=2)
    # An MR lives as long as its object: keep every one until the end.
    mrs = [ep.register(buf.addr, args.size, remote_read=False, remote_write=False, device=args.gpu)]
    half, info = ep.prepare()
    peer = ep.complete(half, bytes.fromhex(first["info"]))
    say({"info": info.hex()})
    hear()  # go
    count = args.size // PIECE
    addr, key = first["addr"], first["key"]
    result: dict = {"case": args.case}
    start = time.monotonic()
    try:
        if args.case == "transfer":
            pieces(ep, peer, verbs.READ, buf, addr, key, count)
            expect = np.random.default_rng(1).integers(0, 256, args.size, dtype=np.uint8)
            got = buf.host().reshape(count, PIECE)[::-1].reshape(-1)
            result["read_exact"] = bool(np.array_equal(got, expect))
            buf2 = Buffer(args.size, args.gpu, seed=3)
            mrs.append(
                ep.register(buf2.addr, args.size, remote_read=False, remote_write=False, device=args.gpu)
            )
            pieces(ep, peer, verbs.WRITE, buf2, addr, key, count)
            sent = buf2.host().reshape(count, PIECE)[::-1].reshape(-1)
            result["written_sha256"] = hashlib.sha256(sent.tobytes()).hexdigest()
        elif args.case in ("bad_rkey", "out_of_bounds"):
            bad_key = key ^ 0x80 if args.case == "bad_rkey" else key
            offset = args.size if args.case == "out_of_bounds" else 0
            pieces(ep, peer, verbs.WRITE, buf, addr, bad_key, 1, offset=offset)
            result["error"] = None
        elif args.case == "peer_killed":
            say({"killing": True})
            hear()  # the test killed the target
            pieces(ep, peer, verbs.READ, buf, addr, key, count, timeout_ms=20_000)
            result["error"] = None
    except verbs.VerbsError as error:
        result["error"] = error.status
    except TimeoutError:
        result["error"] = "timeout"
    result["elapsed_s"] = time.monotonic() - start
    say(result)


def loopback(args: argparse.Namespace) -> None:
    a, b = verbs.Endpoint(args.device), verbs.Endpoint(args.device)
    src, dst = Buffer(args.size, args.gpu, seed=4), Buffer(args.size, args.gpu, seed=5)
    local = a.register(src.addr, args.size, remote_read=False, remote_write=False, device=args.gpu)
    mr = b.register(dst.addr, args.size, remote_read=True, remote_write=True, device=args.gpu)
    half_a, info_a = a.prepare()
    half_b, info_b = b.prepare()
    b.complete(half_b, info_a)
    peer = a.complete(half_a, info_b)
    count = args.size // PIECE
    pieces(a, peer, verbs.WRITE, src, dst.addr, mr.key, count)
    sent = src.host().reshape(count, PIECE)[::-1].reshape(-1)
    say({"write_exact": bool(np.array_equal(dst.host(), sent)), "how": mr.how})
    local.close()
    mr.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["target", "initiator", "loopback"])
    parser.add_argument("--size", type=int, default=1000 * PIECE)
    parser.add_argument("--device", default=None)
    parser.add_argument("--gpu", type=int, default=-1)
    parser.add_argument("--case", default="transfer")
    args = parser.parse_args()
    {"target": target, "initiator": initiator, "loopback": loopback}[args.role](args)


if __name__ == "__main__":
    main()
