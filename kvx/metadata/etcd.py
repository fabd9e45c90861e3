"""``EtcdStore``: the metadata ``Store`` on etcd (v3 API, through ``aetcd``).

Several metadata-service replicas pointed at one etcd cluster share its state;
none holds state of its own. How the store maps onto etcd:

* a lease is an etcd lease: LeaseGrant with a random 62-bit id of ours (etcd's
  own ids count up and can be guessed; a lease id is the registrant's proof of
  holding its name; etcd raises a ttl below its minimum, about 2 s), one
  LeaseKeepAlive round trip per ``keep_alive`` (the granted ttl, 0 when the
  lease is gone), LeaseTimeToLive for ``lease_ttl``, LeaseRevoke (deletes
  the lease's keys);
* a record is the key ``prefix + name``, valued the serialized ``AgentRecord``
  and attached to its lease. A returned record's ``revision`` is the key's
  ``mod_revision``, its ``lease_id`` the key's lease;
* ``put_if`` / ``delete_if`` are transactions comparing the key's
  ``mod_revision`` with ``expect_revision`` (etcd compares an absent key as 0,
  so 0 means "absent"); ``put_if`` returns the transaction's revision;
* ``list_page`` is one range over the prefix from the key after ``after``,
  sorted by key, ``limit`` keys; ``count`` a count-only range. ``watch``
  ranges the prefix a page at a time, every page at the revision R of the
  first (one snapshot, never one copy of the whole prefix), yields their PUTs
  and SYNCED(R), then the changes of a watch of the prefix from R + 1 with
  ``prev_kv``, so that every DELETE (also the one etcd makes when a lease
  expires) carries the record as it was. A watch of ``names`` reads its
  snapshot as transactions of gets (128 names each, all at the first one's
  revision R) and passes on only the prefix watch's events of those names.
  A watch that falls ``queue_size``
  etcd responses behind is cut off with WatchLagError.

Every call is bounded by ``timeout_s``. An unreachable etcd raises
``StoreError`` (the aetcd/gRPC error chained) and ends watches with
``StoreError``; the connection is dropped and the next call connects again,
trying the endpoints in order, so callers just retry. ``start()`` raises
``StoreError`` when no endpoint answers; ``ready()`` never raises.

``expired_leases`` counts the distinct revisions (one per expired lease) of
the DELETE events this instance's watches see that its own ``delete_if`` or
``revoke_lease`` did not make. Approximate: another replica's deletes count
too, and an expiry seen while one of our deletes is in flight does not.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import secrets
from collections.abc import AsyncIterator, Collection
from typing import Any

import grpc

from kvx._net import parse_address
from kvx.errors import ConfigError
from kvx.metadata.store import (
    PAGE_RECORDS,
    WATCH_QUEUE_MAX,
    AgentRecord,
    Event,
    EventType,
    Store,
    StoreError,
    WatchLagError,
)

logger = logging.getLogger(__name__)

# A watch without events checks this often that etcd still answers.
WATCH_IDLE_CHECK_S = 10.0
# Gets per transaction of a names watch's snapshot: etcd's default --max-txn-ops is 128.
_TXN_GETS = 128
# gRPC codes after which the connection is dropped and the next call reconnects.
_TRANSIENT = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL", "ABORTED"}
# What a stream's read() returns at its end. grpc-stubs does not declare it (grpcio has it since 1.32).
_EOF = grpc.aio.EOF  # type: ignore[attr-defined]


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port[,host:port...]`` -> ``[(host, port), ...]``."""
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ConfigError(f"etcd URL {url!r} must look like etcd://host:port[,host:port...]")
    endpoints = []
    for part in url.removeprefix("etcd://").rstrip("/").split(","):
        try:
            host, port = parse_address(part.strip())  # [::1]:2379 too
        except ConfigError:
            host, port = "", 0  # refused below, with this function's message
        if "/" in host or port == 0:
            raise ConfigError(f"bad etcd endpoint {part!r} in {url!r}: expected host:port, port in 1..65535")
        endpoints.append((host, port))
    return endpoints


class EtcdStore(Store):
    """Agent records in etcd, shared by every metadata-service replica."""

    name = "etcd"

    def __init__(
        self,
        endpoints: list[tuple[str, int]] | str,
        *,
        prefix: str = "/kvx/agents/",
        timeout_s: float = 5.0,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = parse_etcd_url(endpoints)
        self._endpoints = [(str(host), int(port)) for host, port in endpoints]
        if not self._endpoints:
            raise ConfigError("EtcdStore needs at least one etcd endpoint")
        if not prefix:
            raise ConfigError("the etcd key prefix must not be empty")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, not {timeout_s!r}")
        self._prefix = prefix.encode()
        self._range_end = _prefix_end(self._prefix)
        self._timeout_s = float(timeout_s)
        self._channel_options = {
            "grpc.max_receive_message_length": 256 << 20,  # a page: PAGE_RECORDS records of up to 256 KiB
            "grpc.initial_reconnect_backoff_ms": 200,
            "grpc.max_reconnect_backoff_ms": 2000,
        }
        self._aetcd: Any = None  # the module, imported by start() (it is optional: kvx[etcd])
        self._client = None
        self._connect_lock = asyncio.Lock()
        self._watches: set[asyncio.Queue] = set()
        self._closing: set[asyncio.Future] = set()
        self._renewals = _Renewals()
        self._own_deletes: collections.deque[int] = collections.deque(maxlen=4096)
        self._deleting = 0  # our delete_if/revoke_lease calls in flight
        self._counted: collections.deque[int] = collections.deque(maxlen=4096)
        self.expired_leases = 0  # approximate, see the module docstring

    async def start(self) -> None:
        try:
            import aetcd
        except ImportError as e:
            raise ConfigError("the etcd metadata store needs aetcd: pip install kvx[etcd]") from e
        self._aetcd = aetcd
        await self._call("connect", lambda client, rpc: asyncio.sleep(0))

    async def close(self) -> None:
        self._renewals.close(StoreError("the metadata store is closing"))
        for queue in list(self._watches):
            _cut_off(queue, StoreError("the metadata store is closing"))
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)

    async def ready(self) -> bool:
        # Two tries in one timeout: the second connects afresh if the first dropped a dead connection.
        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    return await self._call("status", lambda c, rpc: _status(c, rpc))
                except StoreError:
                    return await self._call("status", lambda c, rpc: _status(c, rpc))
        except Exception:  # noqa: BLE001 - ready() reports, it never raises
            return False

    async def grant_lease(self, ttl_s: int) -> int:
        for _ in range(4):  # a clash of two random 62-bit ids is all but impossible; bounded anyway
            lease_id = secrets.randbits(62) | 1
            try:
                response = await self._call(
                    "lease grant",
                    lambda c, rpc, i=lease_id: c.leasestub.LeaseGrant(
                        rpc.LeaseGrantRequest(TTL=int(ttl_s), ID=i)
                    ),
                )
            except StoreError as e:
                if _code(e.__cause__) == "FAILED_PRECONDITION":  # "lease already exists"
                    continue
                raise
            if response.error:
                raise StoreError(f"etcd refused a lease of {ttl_s} s: {response.error}")
            return response.ID
        raise StoreError("etcd refused four random lease ids as taken")

    async def lease_ttl(self, lease_id: int) -> int:
        try:
            response = await self._call(
                "lease ttl",
                lambda c, rpc: c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id)),
            )
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                return 0
            raise
        return max(0, int(response.TTL))  # -1: gone

    async def keep_alive(self, lease_id: int) -> int:
        # One long-lived LeaseKeepAlive stream per connection carries every
        # renewal (a stream per renewal cost the service most of its CPU at
        # 2,000 renewals per second); replies are matched by lease id.
        return await self._call("lease keep-alive", lambda c, rpc: self._renewals.renew(c, rpc, lease_id))

    async def revoke_lease(self, lease_id: int) -> None:
        self._deleting += 1
        try:
            response = await self._call(
                "lease revoke", lambda c, rpc: c.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id))
            )
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                return  # unknown or already expired
            raise
        finally:
            self._deleting -= 1
        self._own_deletes.append(response.header.revision)

    async def get(self, name: str) -> AgentRecord | None:
        key = self._key(name)
        response = await self._call("get", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(key=key)))
        return self._decode(response.kvs[0]) if response.kvs else None

    async def count(self) -> int:
        response = await self._call(
            "count", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(
                key=self._prefix, range_end=self._range_end, count_only=True))
        )  # fmt: skip
        return int(response.count)

    async def list_page(self, after: str, limit: int) -> list[AgentRecord]:
        kvs, _ = await self._page(after, limit, 0)
        return [record for record in map(self._decode, kvs) if record is not None]

    async def put_if(self, record: AgentRecord, lease_id: int, expect_revision: int) -> int | None:
        if lease_id <= 0:
            raise StoreError(f"lease {lease_id:#x} does not exist")
        stored = AgentRecord()
        stored.CopyFrom(record)
        stored.lease_id = lease_id
        stored.ClearField("revision")
        value = stored.SerializeToString()
        try:
            response = await self._txn(
                "put", record.name, expect_revision, lambda rpc, key: rpc.RequestOp(
                    request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))
            )  # fmt: skip
        except StoreError as e:
            if _code(e.__cause__) == "NOT_FOUND":
                raise StoreError(f"lease {lease_id:#x} does not exist (expired?)") from e.__cause__
            raise
        return response.header.revision if response.succeeded else None

    async def delete_if(self, name: str, expect_revision: int) -> bool:
        if expect_revision <= 0:
            return False  # an absent record cannot be deleted
        self._deleting += 1
        try:
            response = await self._txn(
                "delete", name, expect_revision,
                lambda rpc, key: rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)),
            )  # fmt: skip
        finally:
            self._deleting -= 1
        if not response.succeeded or not response.responses[0].response_delete_range.deleted:
            return False
        self._own_deletes.append(response.header.revision)
        return True

    async def watch(
        self, queue_size: int = WATCH_QUEUE_MAX, names: Collection[str] | None = None
    ) -> AsyncIterator[Event]:
        wanted = sorted(set(names)) if names else None

        async def snapshot(after: str, revision: int) -> tuple[list[Any], str, int]:
            """The key-values of the snapshot's next chunk after name ``after``, at
            ``revision`` (0: now); with the chunk's last name ("": the snapshot is
            complete) and the revision read."""
            if wanted is None:
                kvs, read = await self._page(after, PAGE_RECORDS, revision)
                last = kvs[-1].key.removeprefix(self._prefix).decode(errors="replace") if kvs else ""
                return kvs, last, read
            start = bisect.bisect_right(wanted, after) if after else 0
            chunk = wanted[start : start + _TXN_GETS]
            if not chunk:
                return [], "", revision
            # One transaction of gets per chunk: every get of it at one revision, the
            # first chunk's; later chunks read at that revision too.
            keys = [self._key(name) for name in chunk]

            def txn(client, rpc):
                gets = [rpc.RequestOp(request_range=rpc.RangeRequest(key=key, revision=revision))
                        for key in keys]  # fmt: skip
                return client.kvstub.Txn(rpc.TxnRequest(success=gets))

            try:
                response = await self._call("get", txn)
            except StoreError as e:
                if revision and _code(e.__cause__) == "OUT_OF_RANGE":
                    raise WatchLagError(
                        f"etcd compacted its history past {revision} during the snapshot"
                    ) from e
                raise
            kvs = [kv for op in response.responses for kv in op.response_range.kvs]
            return kvs, chunk[-1], revision or response.header.revision

        kvs, after, revision = await snapshot("", 0)
        queue: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self._watches.add(queue)
        call = task = None
        try:
            call = await self._call("watch", lambda c, rpc: self._open_watch(c, rpc, revision + 1))
            task = asyncio.create_task(self._read_watch(call, queue), name="kvx-etcd-watch")
            while after:
                for kv in kvs:
                    if (record := self._decode(kv)) is not None:
                        yield Event(EventType.PUT, record, kv.mod_revision)
                kvs, after, _ = await snapshot(after, revision)
            yield Event(EventType.SYNCED, None, revision)
            keep = None if wanted is None else {self._key(name) for name in wanted}
            while True:
                try:
                    response = await asyncio.wait_for(queue.get(), WATCH_IDLE_CHECK_S)
                except TimeoutError:  # a quiet watch: is etcd still there, or hung?
                    if not await self.ready():
                        raise StoreError("etcd stopped answering") from None
                    continue
                if isinstance(response, Exception):
                    raise response
                for event in response.events:
                    if keep is not None and event.kv.key not in keep:
                        if event.type != 0:
                            self._event(event)  # a DELETE still counts toward expired_leases
                        continue
                    if (out := self._event(event)) is not None:
                        yield out
        finally:
            self._watches.discard(queue)
            if task is not None:
                task.cancel()
            if call is not None:
                call.cancel()

    # Internals.

    async def _call(self, what: str, fn):
        """``await fn(client, rpc)`` within timeout_s, connecting first if need be;
        aetcd/gRPC errors and timeouts become StoreError."""
        if self._aetcd is None:
            raise StoreError("the etcd store is not started")
        client = None
        try:
            async with asyncio.timeout(self._timeout_s):
                client = await self._connect()
                return await fn(client, self._aetcd.rpc)
        except TimeoutError as e:
            error: BaseException = e
            message = f"etcd did not answer ({what}) within {self._timeout_s:g} s"
        except (self._aetcd.ClientError, grpc.RpcError) as e:
            error = e.__cause__ if isinstance(e, self._aetcd.ClientError) and e.__cause__ else e
            message = f"etcd {what} failed: {_details(error)}"
            if _code(error) not in _TRANSIENT:
                raise StoreError(message) from error
        if client is not None and client is self._client:
            self._client = None  # the next call connects again, maybe to another endpoint
            task = asyncio.ensure_future(_close_quietly(client))  # this ends its watches
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        raise StoreError(message) from error

    async def _connect(self):
        async with self._connect_lock:
            if self._client is not None:
                return self._client
            errors, last = [], None
            for host, port in self._endpoints:
                client = self._aetcd.Client(host, port, options=self._channel_options)
                try:
                    await client.connect()  # only makes the channel: ask for the status to know
                    async with asyncio.timeout(self._timeout_s / len(self._endpoints)):
                        await _status(client, self._aetcd.rpc)
                except (TimeoutError, self._aetcd.ClientError, grpc.RpcError) as e:
                    errors.append(f"{host}:{port}: {_details(e)}")
                    last = e
                    await _close_quietly(client)
                    continue
                self._client = client
                return client
            raise StoreError("no etcd endpoint answers: " + "; ".join(errors)) from last

    async def _txn(self, what: str, name: str, expect_revision: int, op):
        key = self._key(name)

        def txn(client, rpc):
            compare = rpc.Compare(
                key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=expect_revision
            )
            return client.kvstub.Txn(rpc.TxnRequest(compare=[compare], success=[op(rpc, key)]))

        return await self._call(what, txn)

    async def _open_watch(self, client, rpc, start_revision: int):
        create = rpc.WatchCreateRequest(
            key=self._prefix, range_end=self._range_end, start_revision=start_revision, prev_kv=True
        )

        async def requests():
            yield rpc.WatchRequest(create_request=create)
            await asyncio.Event().wait()  # keep our side of the stream open

        # hasleader: etcd ends the watch if its member loses the cluster leader.
        call = rpc.WatchStub(client.channel).Watch(requests(), metadata=(("hasleader", "true"),))
        created = await call.read()
        if created is _EOF or not created.created or created.canceled:
            call.cancel()
            raise StoreError(f"etcd refused the watch: {getattr(created, 'cancel_reason', '') or 'ended'}")
        return call

    async def _read_watch(self, call, queue: asyncio.Queue) -> None:
        try:
            while (response := await call.read()) is not _EOF:
                if response.compact_revision:
                    raise WatchLagError(f"etcd compacted its history past {response.compact_revision}")
                if response.canceled:
                    raise StoreError(f"etcd cancelled the watch: {response.cancel_reason or 'no reason'}")
                if queue.full():  # the consumer does not keep up: cut it off, hold nothing more for it
                    raise WatchLagError(f"the watch fell {queue.maxsize} etcd responses behind")
                queue.put_nowait(response)
            error: Exception = StoreError("etcd ended the watch")
        except StoreError as e:
            error = e
        except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - CancelledError: channel closed
            error = StoreError(f"the etcd watch failed: {_details(e)}")
            error.__cause__ = e
        if queue in self._watches:
            _cut_off(queue, error)

    async def _page(self, after: str, limit: int, revision: int):
        """Up to ``limit`` key-values after the key of name ``after``, at ``revision``
        (0: the latest); with the revision read."""
        start = self._key(after) + b"\0" if after else self._prefix
        try:
            response = await self._call(
                "range", lambda c, rpc: c.kvstub.Range(rpc.RangeRequest(
                    key=start, range_end=self._range_end, limit=limit, revision=revision,
                    sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY))
            )  # fmt: skip
        except StoreError as e:
            if revision and _code(e.__cause__) == "OUT_OF_RANGE":  # compacted while paging
                raise WatchLagError(f"etcd compacted its history past {revision} during the snapshot") from e
            raise
        return list(response.kvs), response.header.revision

    def _event(self, event) -> Event | None:
        if event.type == 0:  # PUT
            record = self._decode(event.kv)
            return None if record is None else Event(EventType.PUT, record, event.kv.mod_revision)
        revision = event.kv.mod_revision
        record = self._decode(event.prev_kv) if event.prev_kv.key else None
        if record is None:  # no previous value (compacted): the name is all there is
            record = AgentRecord(name=event.kv.key.removeprefix(self._prefix).decode(errors="replace"))
        if revision not in self._own_deletes and revision not in self._counted and not self._deleting:
            self._counted.append(revision)
            self.expired_leases += 1
        return Event(EventType.DELETE, record, revision)

    def _key(self, name: str) -> bytes:
        return self._prefix + name.encode()

    def _decode(self, kv) -> AgentRecord | None:
        record = AgentRecord()
        try:
            record.ParseFromString(kv.value)
        except Exception:  # noqa: BLE001 - a foreign value under our prefix
            logger.warning("ignoring etcd key %r: its value is not an AgentRecord", kv.key)
            return None
        record.revision = kv.mod_revision
        record.lease_id = kv.lease
        return record


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix.rstrip(b"\xff"))
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


async def _status(client, rpc) -> bool:
    await client.maintenancestub.Status(rpc.StatusRequest())
    return True


def _cut_off(queue: asyncio.Queue, error: Exception) -> None:
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(error)


def _code(error) -> str | None:
    return error.code().name if isinstance(error, grpc.aio.AioRpcError) else None


def _details(error) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name  # details() is None when the server sent none
    return str(error) or type(error).__name__


async def _close_quietly(client) -> None:
    try:
        async with asyncio.timeout(2):
            await client.close()
    except Exception:  # noqa: BLE001
        logger.debug("closing an etcd client failed", exc_info=True)


class _Renewals:
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
