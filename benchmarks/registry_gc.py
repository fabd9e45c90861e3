"""What a registry of N agents costs Python's cycle collector, on the memory store.

Registers --agents agents (a lease each, the records of metadata_bench.py) in a
MemoryStore in this process, then reports the objects the collector tracks
beyond an empty store, the time of a full collection (gc.collect(), median of
--rounds) with the store and without it, and this process's peak RSS. A full
collection holds the metadata service's event loop for as long: on a busy
service it comes every few tens of seconds.

    python benchmarks/registry_gc.py --agents 100000

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metadata_bench import _record  # noqa: E402

from kvx.metadata.store import MemoryStore  # noqa: E402


def _full_collection_ms(rounds: int) -> float:
    took = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        took.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(took), 1)


async def main(agents: int, rounds: int) -> dict:
    gc.collect()
    empty_ms = _full_collection_ms(rounds)
    before = len(gc.get_objects())
    store = MemoryStore()
    start = time.perf_counter()
    for i in range(agents):
        await store.put_if(_record(i), await store.grant_lease(60), 0)
    register_s = time.perf_counter() - start
    gc.collect()
    return {
        "agents": agents,
        "tracked_objects_added": len(gc.get_objects()) - before,
        "full_collection_ms": _full_collection_ms(rounds),
        "full_collection_ms_without_store": empty_ms,
        "register_us_per_agent": round(register_s / agents * 1e6, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), **asyncio.run(main(args.agents, args.rounds))}))
