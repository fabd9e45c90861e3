"""Lease bookkeeping of ``EtcdStore`` (``etcd.py``): the leases one replica
tracks, and renewals multiplexed over one etcd LeaseKeepAlive stream."""

from __future__ import annotations

import asyncio
import collections

from kvx.metadata.store import StoreError


class TrackedLease:
    """A lease renewed at this replica: its kvx deadline, and when etcd last heard of it."""

    __slots__ = (
        "lease_id",
        "ttl_s",
        "etcd_ttl_s",
        "renewed",
        "deadline",
        "forwarded",
        "takeover_until",
        "due",
    )

    def __init__(self, lease_id: int, ttl_s: int, etcd_ttl_s: int, now: float) -> None:
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.etcd_ttl_s = etcd_ttl_s
        self.renewed = self.deadline = now
        self.forwarded = now  # when our last forward's reply came
        self.takeover_until = 0.0
        self.due = 0  # the second its expiry check is scheduled for (0: none)

    def take_over(self, now: float, extra_s: float) -> None:
        """Forward every renewal for a kvx ttl (+ ``extra_s``) from ``now``: the replica
        that renewed it before checks it at most that long after its last renewal
        there, and must find in etcd a forward of ours later than its own by more
        than etcd's 1 s granularity. At any ttl the agent renews (every ttl/3) in that
        window at least once that late."""
        self.takeover_until = now + self.ttl_s + extra_s

    def must_forward(self, now: float, extra_s: float) -> bool:
        if now - self.renewed > self.ttl_s / 2:
            # A gap: the agent renewed at another replica meanwhile (or stalled). Tell
            # etcd, so that the other replica sees the lease move here.
            self.take_over(now, extra_s)
        return now < self.takeover_until or now - self.forwarded >= self.etcd_ttl_s / 3


class Renewals:
    """Lease renewals multiplexed over one LeaseKeepAlive stream per client."""

    def __init__(self) -> None:
        self._client = None
        self._queue: asyncio.Queue | None = None
        self._waiters: dict[int, collections.deque] = {}
        self._reader: asyncio.Task | None = None

    async def renew(self, client, rpc, lease_id: int) -> int:
        queue = self._queue
        if client is not self._client or queue is None or self._reader is None or self._reader.done():
            queue = self._open(client, rpc)
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(lease_id, collections.deque()).append(future)
        queue.put_nowait(rpc.LeaseKeepAliveRequest(ID=lease_id))
        return await future

    def _open(self, client, rpc) -> asyncio.Queue:
        """A new keep-alive stream on ``client``; returns the queue its requests go into."""
        self.close(StoreError("etcd connection replaced"))
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (request := await queue.get()) is not None:
                yield request

        call = client.leasestub.LeaseKeepAlive(requests())
        # However the call ends, requests() ends too: gRPC's task that sends them is
        # not cancelled with a call that has ended already (see etcd.py, _open_watch).
        # close() ends it as well; this keeps that true if close() ever changes.
        call.add_done_callback(lambda _call: queue.put_nowait(None))
        self._client, self._queue = client, queue
        self._reader = asyncio.ensure_future(self._read(call, queue))
        return queue

    async def _read(self, call, queue: asyncio.Queue) -> None:
        try:
            async for reply in call:
                lease_id = int(reply.ID)
                waiters = self._waiters.get(lease_id)
                while waiters:
                    future = waiters.popleft()
                    if not future.done():  # a renewal that timed out was cancelled
                        future.set_result(max(int(reply.TTL), 0))
                        break
                if waiters is not None and not waiters:
                    del self._waiters[lease_id]
            error: BaseException = StoreError("etcd ended the lease keep-alive stream")
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            error = exc
        finally:
            call.cancel()
        if self._queue is queue:
            self.close(error)

    def close(self, error: BaseException) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
        waiters, self._waiters = self._waiters, {}
        for pending in waiters.values():
            for future in pending:
                if not future.done():
                    future.set_exception(error)
        self._client = self._queue = None
