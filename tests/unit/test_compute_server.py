"""The synthetic engine's simulated accelerator (kvx.daemon.synthetic.ComputeServer):
one FIFO server, a queue bounded by its wait (a request that would wait past
the bound is refused, as is one whose own compute is past it), and waits that
end on close. In-process threads; the bounds are loose (ordering, not timing)."""

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


def _wait_for_turn_taken(server: ComputeServer) -> float:
    """The finish of the request a thread has just started: polled, so a
    slow thread start on a busy machine is waited for, not assumed."""
    deadline = time.monotonic() + 30
    while server._busy_until == 0.0:
        assert time.monotonic() < deadline, "the worker never took its turn"
        time.sleep(0.005)
    return server._busy_until


def test_a_queue_longer_than_the_wait_bound_is_refused_at_once():
    server = ComputeServer(tokens_per_s=100.0, wait_s=1.0)
    worker = threading.Thread(target=server.run, args=(80,), daemon=True)  # 0.8 s
    worker.start()
    busy_until = _wait_for_turn_taken(server)
    start = time.monotonic()
    with pytest.raises(EngineError, match="compute queue") as refused:
        server.run(80)  # would finish up to 1.6 s from now, past the 1 s bound
    assert refused.value.status == 503
    assert time.monotonic() - start < 0.5  # refused without waiting
    assert server._busy_until == busy_until  # and it took no turn
    worker.join(10)
    assert not worker.is_alive()
    # Had the refused request taken its turn (0.8 s), this 0.1 s one would
    # wait behind it: about 0.9 s.
    assert server.run(10) < 0.5


def test_a_prompt_whose_compute_alone_is_over_the_bound_is_refused():
    # An idle server: the queue is empty, yet 3 s of compute against a 1 s
    # bound could never be served; it is refused (400) and takes no turn.
    server = ComputeServer(tokens_per_s=100.0, wait_s=1.0)
    start = time.monotonic()
    with pytest.raises(EngineError, match="shorter prompt") as refused:
        server.run(300)
    assert refused.value.status == 400
    assert time.monotonic() - start < 0.5 and server._busy_until == 0.0
    assert 0 < server.run(50) < 30  # under the bound: served, not refused


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
