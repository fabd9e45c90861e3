"""The bytes the etcd store's watches hold (kvx/metadata/etcd.py), driven by
hand with fake etcd responses: past the total over all watches the watch
holding the most is cut off, whichever watch's reader crosses it, and a
watch cut off queues nothing more."""

import asyncio

import grpc
import pytest

from kvx.metadata import etcd as etcd_module
from kvx.metadata.etcd import EtcdStore, _WatchQueue
from kvx.metadata.store import WatchLagError


class FakeResponse:
    compact_revision = 0
    canceled = False

    def __init__(self, size: int) -> None:
        self.size = size

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        return self.size


class FakeCall:
    """An etcd watch call that answers ``responses``, then waits for good."""

    def __init__(self, responses: list[FakeResponse]) -> None:
        self.responses = list(responses)
        self.cancelled = False

    async def read(self):
        if self.responses:
            return self.responses.pop(0)
        await asyncio.sleep(3600)
        return grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


def test_past_the_total_the_watch_holding_the_most_is_cut_off(monkeypatch) -> None:
    monkeypatch.setattr(etcd_module, "WATCH_QUEUE_BYTES_TOTAL", 1000)

    async def body() -> None:
        store = EtcdStore("etcd://127.0.0.1:1")
        stalled = _WatchQueue(100, store._queued_bytes)
        reading = _WatchQueue(100, store._queued_bytes)
        store._watches.update((stalled, reading))
        for _ in range(9):
            stalled.put_nowait(FakeResponse(100))  # 900 bytes nobody reads
        # The reading watch's reader crosses the total (900 + 200 > 1000)...
        reader = asyncio.create_task(
            store._read_watch(FakeCall([FakeResponse(200), FakeResponse(50)]), reading)
        )
        await asyncio.sleep(0.05)
        # ...and the stalled watch is the one cut off; the reading one keeps its changes.
        with pytest.raises(WatchLagError, match="furthest behind"):
            raise stalled.get_nowait()
        assert reading.qsize() == 2 and not reader.done()
        assert store._queued_bytes == [250]
        # A watch cut off queues nothing more: its reader stops at its next response.
        victim_call = FakeCall([FakeResponse(100)])
        await store._read_watch(victim_call, stalled)
        assert victim_call.cancelled and stalled.empty() and store._queued_bytes == [250]
        reader.cancel()

    asyncio.run(body())
