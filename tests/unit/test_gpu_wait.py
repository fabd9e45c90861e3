"""How a thread waits for its own GPU copy (gpu.Engine.wait): a bounded poll
of the event, then a blocking wait; and the KVX_CUDA_SPIN_US setting. No GPU
needed: the events are stand-ins that count what was asked of them."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from kvx._datapath import gpu
from kvx._datapath import io as _io
from kvx._datapath import staging as _staging
from kvx.errors import ConfigError


class CountingEvent:
    """Done after ``ready_after`` queries (never, if None)."""

    def __init__(self, ready_after: int | None, error: Exception | None = None) -> None:
        self.ready_after = ready_after
        self.error = error
        self.queries = 0
        self.synchronized = 0

    @property
    def done(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.ready_after is not None and self.queries > self.ready_after

    def synchronize(self) -> None:
        if self.error is not None:
            raise self.error
        self.synchronized += 1


def _wait(spin_s: float, event: CountingEvent) -> float:
    started = time.perf_counter()
    gpu.Engine.wait(types.SimpleNamespace(spin_s=spin_s, driver=None), event)  # type: ignore[arg-type]
    return time.perf_counter() - started


def test_a_copy_that_ends_while_polled_is_never_slept_on():
    event = CountingEvent(ready_after=3)
    _wait(0.5, event)
    assert event.queries == 4
    assert event.synchronized == 0


def test_the_poll_is_bounded_then_the_thread_sleeps_on_the_event():
    event = CountingEvent(ready_after=None)
    took = _wait(0.02, event)
    assert took >= 0.02
    assert took < 1.0  # bounded: it stopped polling (generous for a loaded machine)
    assert event.queries > 1
    assert event.synchronized == 1


def test_zero_never_polls():
    event = CountingEvent(ready_after=0)
    _wait(0.0, event)
    assert event.queries == 0
    assert event.synchronized == 1


def test_a_failed_copy_raises_from_the_poll():
    event = CountingEvent(ready_after=None, error=RuntimeError("an illegal address was encountered"))
    with pytest.raises(RuntimeError, match="illegal address"):
        _wait(0.5, event)
    assert event.synchronized == 0


def test_an_interrupt_in_the_poll_waits_for_the_copy_first():
    """The caller lets go of the copy's memory when the wait unwinds: an
    exception raised into the poll (Ctrl-C) must not end it before the GPU
    has finished."""
    event = CountingEvent(ready_after=None, error=KeyboardInterrupt())
    event.synchronize = lambda: setattr(event, "synchronized", event.synchronized + 1)  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        _wait(0.5, event)
    assert event.synchronized == 1


def test_spin_setting(monkeypatch):
    monkeypatch.delenv("KVX_CUDA_SPIN_US", raising=False)
    assert gpu.spin_seconds() == gpu.SPIN_US / 1e6
    monkeypatch.setenv("KVX_CUDA_SPIN_US", "0")
    assert gpu.spin_seconds() == 0
    monkeypatch.setenv("KVX_CUDA_SPIN_US", " 250 ")
    assert gpu.spin_seconds() == pytest.approx(250e-6)
    monkeypatch.setenv("KVX_CUDA_SPIN_US", str(_io.SPIN_US_MAX))
    assert gpu.spin_seconds() == pytest.approx(_io.SPIN_US_MAX / 1e6)
    for bad in ("-1", str(_io.SPIN_US_MAX + 1), "ten", "1.5", "1e3"):
        monkeypatch.setenv("KVX_CUDA_SPIN_US", bad)
        with pytest.raises(ConfigError, match="KVX_CUDA_SPIN_US"):
            gpu.spin_seconds()


def test_pieces_leave_short_copies_as_they_are():
    dsts = np.arange(4, dtype=np.uint64) * 100_000
    srcs = dsts + 7
    lens = np.array([1, 0, 4096, 65536], np.uint64)
    out = _staging.pieces(dsts, srcs, lens, 65536)
    assert out[0] is dsts and out[1] is srcs
    assert out[2].tolist() == lens.tolist()
    empty = np.zeros(0, np.uint64)
    assert [len(a) for a in _staging.pieces(empty, empty, empty, 65536)] == [0, 0, 0]
    # One byte over the piece: that copy alone is cut, in order (an empty one stays).
    d, s, n = _staging.pieces(dsts, srcs, np.array([1, 0, 4096, 65537], np.uint64), 65536)
    assert n.tolist() == [1, 0, 4096, 65536, 1]
    assert d.tolist() == [0, 100_000, 200_000, 300_000, 300_000 + 65536]
    assert s.tolist() == [7, 100_007, 200_007, 300_007, 300_007 + 65536]
