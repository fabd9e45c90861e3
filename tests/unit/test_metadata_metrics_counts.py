"""The metadata service's /metrics agent counts: a store that reads every
record to count them (etcd) is counted at most every COUNT_EVERY_S, one
count shared by the scrapes that arrive meanwhile; one that keeps its
counts (memory) is asked every time."""

from __future__ import annotations

import asyncio

import pytest

from kvx.metadata import metrics
from kvx.metadata.store import StoreError
from kvx.v1 import metadata_pb2


class CountingStore:
    """What _StoreCollector asks of a store: count_by_role, slow, counted."""

    def __init__(self, counts_kept: bool) -> None:
        self.counts_kept = counts_kept
        self.calls = 0
        self.fail = False
        self.prefill = 3

    async def count_by_role(self) -> dict[int, int]:
        self.calls += 1
        await asyncio.sleep(0.05)  # a page or two of etcd
        if self.fail:
            raise StoreError("etcd is down")
        return {metadata_pb2.ROLE_PREFILL: self.prefill, metadata_pb2.ROLE_DECODE: 2}


def test_a_store_that_reads_its_records_is_counted_once_for_many_scrapes(monkeypatch):
    async def scrapes() -> None:
        store = CountingStore(counts_kept=False)
        collector = metrics._StoreCollector(store)  # type: ignore[arg-type]
        await asyncio.gather(*(collector.refresh() for _ in range(50)))
        assert store.calls == 1 and collector.by_role["prefill"] == 3 and collector.by_role["decode"] == 2
        store.prefill = 4
        await collector.refresh()  # within COUNT_EVERY_S: the last count stands
        assert store.calls == 1 and collector.by_role["prefill"] == 3
        # A scrape that goes away does not take the count with it.
        monkeypatch.setattr(metrics, "COUNT_EVERY_S", 0.0)
        first = asyncio.ensure_future(collector.refresh())
        await asyncio.sleep(0.01)
        first.cancel()
        await collector.refresh()
        assert store.calls == 2 and collector.by_role["prefill"] == 4
        # A failed count fails the scrapes that waited for it; the next one counts again.
        store.fail = True
        results = await asyncio.gather(collector.refresh(), collector.refresh(), return_exceptions=True)
        assert [type(r) for r in results] == [StoreError, StoreError] and store.calls == 3
        monkeypatch.setattr(metrics, "COUNT_EVERY_S", 10.0)
        await collector.refresh()  # nor is a failed count tried again at once: the last counts stand
        assert store.calls == 3 and collector.by_role["prefill"] == 4
        monkeypatch.setattr(metrics, "COUNT_EVERY_S", 0.0)
        store.fail, store.prefill = False, 5
        await collector.refresh()
        assert store.calls == 4 and collector.by_role["prefill"] == 5

    asyncio.run(scrapes())


@pytest.mark.parametrize("every_s", [0.0, 10.0])
def test_a_store_that_keeps_its_counts_is_asked_every_time(monkeypatch, every_s):
    monkeypatch.setattr(metrics, "COUNT_EVERY_S", every_s)

    async def scrapes() -> None:
        store = CountingStore(counts_kept=True)
        collector = metrics._StoreCollector(store)  # type: ignore[arg-type]
        for prefill in (1, 2, 3):
            store.prefill = prefill
            await collector.refresh()
            assert collector.by_role["prefill"] == prefill
        assert store.calls == 3

    asyncio.run(scrapes())
