"""The synthetic engine's simulated accelerator (kvx.daemon.synthetic.ComputeServer):
one FIFO server, a bounded queue, and waits that end on close. In-process
threads; the bounds are loose (ordering, not timing)."""

from __future__ import annotations

import threading
import time

import pytest

from kvx.daemon.synthetic import ComputeServer, EngineError


def _run_all(server: ComputeServer, tokens: list[int], gap_s: float) -> list[tuple[int, float]]:
    """Each request in its own thread, ``gap_s`` apart: (index, finish time) in finishing order."""
    done: list[tuple[int, float]] = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(i: int) -> None:
        server.run(tokens[i])
        with lock:
            done.append((i, time.monotonic() - start))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(tokens))]
    for t in threads:
        t.start()
        time.sleep(gap_s)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return done


def test_requests_are_served_one_at_a_time_in_arrival_order():
    server = ComputeServer(tokens_per_s=100.0, wait_s=60.0)
    # A long one, then short ones arriving while it computes: none overtakes it.
    done = _run_all(server, [50, 5, 5, 5], gap_s=0.05)
    assert [i for i, _ in done] == [0, 1, 2, 3]
    assert done[-1][1] >= (50 + 15) / 100.0 * 0.9, done
    assert done[-1][1] < 20, done


def test_a_queue_longer_than_the_wait_bound_is_refused_at_once():
    server = ComputeServer(tokens_per_s=100.0, wait_s=1.0)
    worker = threading.Thread(target=server.run, args=(80,), daemon=True)  # 0.8 s
    worker.start()
    time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(EngineError, match="compute queue") as refused:
        server.run(80)  # would finish about 1.5 s from now
    assert refused.value.status == 503
    assert time.monotonic() - start < 0.5  # refused without waiting
    worker.join(10)
    assert server.run(10) < 5  # the refused request took no turn


def test_close_ends_every_wait():
    server = ComputeServer(tokens_per_s=1.0, wait_s=3600.0)
    errors: list[EngineError] = []

    def one() -> None:
        try:
            server.run(600)
        except EngineError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    server.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3 and all(e.status == 503 for e in errors)
