"""A step that computes nothing waits in ``KvxWorker.get_finished`` for a
transfer to finish (up to IDLE_WAIT_S) instead of letting vLLM step again at
once: while a request waits for its KV, vLLM runs empty steps back to back,
and on a host shared with a prefill that spins a core.

The waits are stretched here (IDLE_WAIT_S set long) so that "waited" and
"did not wait" differ by seconds, not by a scheduler's whim."""

from __future__ import annotations

import threading
import time

import pytest

from kvx.connectors.vllm import worker as worker_mod
from kvx.connectors.vllm.meta import KvxConnectorMetadata
from kvx.connectors.vllm.stats import KvxConnectorStats

LONG_S = 5.0


@pytest.fixture
def w(monkeypatch) -> worker_mod.KvxWorker:
    """The worker's finished-sets machinery alone (no agent, no caches)."""
    monkeypatch.setattr(worker_mod, "IDLE_WAIT_S", LONG_S)
    w = worker_mod.KvxWorker.__new__(worker_mod.KvxWorker)
    w.push = None
    w._lock = threading.Lock()
    w._progress = threading.Condition(w._lock)
    w._idle_step = w._reported = False
    w._done_recv, w._failed_recv, w._done_send = set(), set(), set()
    w._held, w._early = {}, {}
    w._stats = KvxConnectorStats()
    w._pool = None
    return w


def _step(w: worker_mod.KvxWorker, idle: bool) -> None:
    w.start_step(KvxConnectorMetadata(idle=idle))


def _timed(w: worker_mod.KvxWorker) -> tuple[tuple[set[str], set[str], set[str]], float]:
    started = time.monotonic()
    got = w.get_finished()
    return got, time.monotonic() - started


def _report_soon(w: worker_mod.KvxWorker, finished: str, req_id: str) -> threading.Thread:
    def land() -> None:
        time.sleep(0.2)
        with w._lock:
            w._report(getattr(w, finished), req_id)

    thread = threading.Thread(target=land)
    thread.start()
    return thread


def test_an_idle_step_waits_and_wakes_as_soon_as_a_transfer_finishes(w, monkeypatch):
    monkeypatch.setattr(worker_mod, "IDLE_WAIT_S", 0.3)
    _step(w, idle=True)
    got, took = _timed(w)
    assert got == (set(), set(), set()) and 0.27 <= took < LONG_S  # waited its bound
    monkeypatch.setattr(worker_mod, "IDLE_WAIT_S", LONG_S)
    _step(w, idle=True)
    lander = _report_soon(w, "_done_recv", "r1")
    got, took = _timed(w)
    lander.join()
    assert got == (set(), {"r1"}, set()) and took < LONG_S / 2  # woken, not timed out


def test_steps_that_compute_or_follow_a_report_do_not_wait(w):
    _step(w, idle=False)
    assert _timed(w)[1] < LONG_S / 2
    # Something finished: reported at once, and the idle step after it (scheduled before
    # vLLM saw the report, with async scheduling) does not wait either.
    with w._lock:
        w._report(w._done_send, "p1")
    _step(w, idle=True)
    got, took = _timed(w)
    assert got == ({"p1"}, set(), set()) and took < LONG_S / 2
    _step(w, idle=True)
    assert _timed(w)[1] < LONG_S / 2
    # A second get_finished in one step does not wait again.
    _step(w, idle=True)
    lander = _report_soon(w, "_failed_recv", "r2")
    assert w.get_finished() == (set(), {"r2"}, {"r2"})
    lander.join()
    assert _timed(w)[1] < LONG_S / 2
