"""A step that computes nothing waits in ``KvxWorker.get_finished`` for a
transfer to finish (up to IDLE_WAIT_S) instead of letting vLLM step again at
once: while a request waits for its KV, vLLM runs empty steps back to back,
and on a host shared with a prefill that spins a core."""

from __future__ import annotations

import threading
import time

from kvx.connectors.vllm import worker as worker_mod
from kvx.connectors.vllm.meta import KvxConnectorMetadata
from kvx.connectors.vllm.stats import KvxConnectorStats


def _bare_worker() -> worker_mod.KvxWorker:
    """The worker's finished-sets machinery alone (no agent, no caches)."""
    w = worker_mod.KvxWorker.__new__(worker_mod.KvxWorker)
    w.push = None
    w._lock = threading.Lock()
    w._progress = threading.Condition(w._lock)
    w._idle_step = False
    w._done_recv, w._failed_recv, w._done_send = set(), set(), set()
    w._held, w._early = {}, {}
    w._stats = KvxConnectorStats()
    w._pool = None
    return w


def _step(w: worker_mod.KvxWorker, idle: bool) -> None:
    w.start_step(KvxConnectorMetadata(idle=idle))


def test_an_idle_step_waits_for_a_transfer_and_wakes_when_one_finishes():
    w = _bare_worker()
    _step(w, idle=True)
    started = time.monotonic()
    assert w.get_finished() == (set(), set(), set())
    waited = time.monotonic() - started
    assert worker_mod.IDLE_WAIT_S * 0.9 <= waited < worker_mod.IDLE_WAIT_S + 0.5
    # A load that lands meanwhile ends the wait at once, and is reported by that step.
    _step(w, idle=True)

    def land() -> None:
        time.sleep(worker_mod.IDLE_WAIT_S / 4)
        with w._lock:
            w._report(w._done_recv, "r1")

    lander = threading.Thread(target=land)
    lander.start()
    assert w.get_finished() == (set(), {"r1"}, set())
    lander.join()


def test_a_step_that_computes_something_never_waits():
    w = _bare_worker()
    _step(w, idle=False)
    started = time.monotonic()
    for _ in range(20):
        assert w.get_finished() == (set(), set(), set())
    assert time.monotonic() - started < worker_mod.IDLE_WAIT_S
    # An idle step waits once: a second get_finished in the same step does not.
    _step(w, idle=True)
    w.get_finished()
    started = time.monotonic()
    w.get_finished()
    assert time.monotonic() - started < worker_mod.IDLE_WAIT_S / 2


def test_an_idle_step_with_something_finished_returns_at_once():
    w = _bare_worker()
    with w._lock:
        w._report(w._done_send, "p1")
    _step(w, idle=True)
    started = time.monotonic()
    assert w.get_finished() == ({"p1"}, set(), set())
    assert time.monotonic() - started < worker_mod.IDLE_WAIT_S / 2
