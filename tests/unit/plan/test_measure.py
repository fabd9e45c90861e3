"""kvx.plan.measure's client keeps the garbage collector off its heap while it sends."""

import gc

from kvx.plan.measure import heap_frozen


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_heap_frozen_hides_what_exists_collects_what_is_new_and_gives_the_heap_back():
    # Some interpreters' start-up hooks freeze a heap of their own: thaw it for
    # this test (heap_frozen leaves a frozen heap alone, as the next test shows).
    frozen_at_start = gc.get_freeze_count()
    gc.unfreeze()
    try:
        held = [_Cycle() for _ in range(1000)]
        assert gc.get_freeze_count() == 0
        with heap_frozen():
            # Everything that existed (held among it) is out of the collector's sight...
            assert gc.get_freeze_count() >= len(held)
            assert not {id(o) for o in held} & {id(o) for o in gc.get_objects()}
            # ... and garbage made now is still collected.
            _Cycle()
            assert gc.collect() >= 1
        assert gc.get_freeze_count() == 0
        assert {id(o) for o in held} <= {id(o) for o in gc.get_objects()}
    finally:
        if frozen_at_start:
            gc.freeze()


def test_a_heap_frozen_by_the_process_stays_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with heap_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
