"""64 transfers of 1 MiB in flight at once (64 x 16 KiB blocks each, every
other block): their aggregate throughput against the limit of the path
moving the same 64 MiB in one go (one process_vm_readv of the same ranges on
shm, one 64 MiB request over a raw socket on tcp), alternating, medians.

    python benchmarks/inflight.py --backend shm --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvx import Descs  # noqa: E402
from kvx._bench import _Session  # noqa: E402

BLOCK = 16 * 1024
PER = 64  # blocks per transfer: 1 MiB
TRANSFERS = 64


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    total = BLOCK * PER * TRANSFERS
    session = _Session(2 * total, 1, args.backend, "host")
    try:
        ids = np.arange(0, 2 * PER * TRANSFERS, 2)
        limit_name, limit = session.limit(BLOCK, ids, total)
        peer, region = session.peer, session.region
        pairs = [
            (
                Descs.from_blocks(region, ids[k * PER : (k + 1) * PER], BLOCK),
                Descs.from_blocks(peer.regions[0], ids[k * PER : (k + 1) * PER], BLOCK),
            )
            for k in range(TRANSFERS)
        ]
        mine, theirs = [], []
        for r in range(args.rounds + 1):
            theirs_t = limit.transfer("read", total)
            start = time.perf_counter()
            transfers = [peer.read(local, remote) for local, remote in pairs]
            for t in transfers:
                t.wait(60)
            mine_t = time.perf_counter() - start
            if r:  # the first round warms up
                mine.append(mine_t)
                theirs.append(theirs_t)
        verified = session.verify("read", BLOCK, ids)
        backend = peer.backend
    finally:
        session.close()
    kvx_gbps = total / statistics.median(mine) / 1e9
    limit_gbps = total / statistics.median(theirs) / 1e9
    print(
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {backend}: {TRANSFERS} x 1 MiB in flight "
        f"{kvx_gbps:.3f} GB/s, {limit_name} {limit_gbps:.3f} GB/s, ratio {kvx_gbps / limit_gbps:.2f}, "
        f"medians of {args.rounds}" + ("" if verified else "  DATA NOT VERIFIED")
    )
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
