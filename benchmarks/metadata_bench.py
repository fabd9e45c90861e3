"""Load on the kvx metadata service: many agents renewing leases, lookups, watchers.

Every mode prints one JSON object. The goal figures, one command each:

    # steady: 100,000 agents renewing, 1,000 lookups/s for 60 s (memory store)
    python benchmarks/metadata_bench.py --agents 100000 --lookups-per-s 1000 --duration-s 60
    # the same on etcd (a local one is started), two replicas sharing the load
    python benchmarks/metadata_bench.py --agents 100000 --duration-s 60 --store etcd --replicas 2
    # the memory store with two read replicas: lookups (and watches) go to them
    python benchmarks/metadata_bench.py --agents 100000 --lookups-per-s 1000 --duration-s 60 --read-replicas 2
    # service CPU per lookup (no renewals) and per renewal (no lookups)
    python benchmarks/metadata_bench.py --agents 100000 --duration-s 60 --no-keepalive
    # the same, the 8 ranks of an engine looked up in one GetAgents call
    python benchmarks/metadata_bench.py --agents 100000 --duration-s 60 --no-keepalive --lookup-batch 8
    python benchmarks/metadata_bench.py --agents 100000 --duration-s 60 --renewals-only
    # registration storm: the service is killed and restarted, every agent registers again
    python benchmarks/metadata_bench.py --mode storm --agents 100000
    # the same, the agents of a process registering together (RegisterAgents), lookups at replicas
    python benchmarks/metadata_bench.py --mode storm --agents 100000 --register-batch 8 --read-replicas 2
    # watch fan-out: 1,000 watchers of 8 agents each, 20 changes/s
    python benchmarks/metadata_bench.py --mode watch --agents 100000 --watchers 1000 --changes-per-s 20 --duration-s 60

Processes: the service (`kvx metadata`, --replicas of them on one store, and
--read-replicas mirrors of the first: `--store mirror://`), and load
generators, each its own process, connected to every replica (lookups and
watchers to the read replicas when there are any):
  - agent hosts (--agent-procs): register their share of the --agents
    (ttl_s 0: the service default; --register-concurrency calls in flight
    each, of --register-batch agents per RegisterAgents call), then renew every lease every ttl/3 as a client does, the leases of
    --agents-per-process agents together in one KeepAliveRequest (lease_ids),
    over --keepalive-streams streams in all, the renewals spread evenly in
    time. A lease answered ttl 0 is lost and its agent registers again; a
    broken stream makes all its agents register again (as a client's
    Registration does). Agent groups go to the replicas in turn.
  - lookups (--lookup-procs): GetAgent of random names, open loop at
    --lookups-per-s (a request is sent on schedule whether or not the last
    one has answered), each latency measured from its scheduled time
    (lookup_*); also how late the generator started each call
    (lookup_start_late_*) and the latency from that start (lookup_from_start_*).
    With --lookup-batch N, GetAgents of N consecutive agents (an engine's
    ranks) at --lookups-per-s / N calls a second: rates and CPU per lookup
    count names, latencies count calls.
  - watchers (--watch-procs, watch mode): --watchers WatchAgents streams, each
    on --names-per-watcher names of the --watched-agents agents (or all
    agents with --watch-all).
  - the change driver (watch mode): holds the --watched-agents agents and
    registers them again (an update) at --changes-per-s, the send time in
    engine_info; each watcher measures the delay to its receipt.

Modes:
  steady  register (each lease renewed from its registration on), then for
          --duration-s: renewals and lookups. Reports
          lookup p50/p99/max, rates achieved, renewals/s (leases) and
          messages/s, leases lost (ttl 0 answers, and records missing at the
          end, counted by ListAgents pages), service CPU and peak RSS
          (VmHWM), and per service the full collections of Python's cycle
          collector in the window and the seconds they held it
          (service_gc_full, from its /metrics). --no-keepalive (registered with the longest ttl, 300 s,
          never renewed) gives service CPU per lookup; --renewals-only gives
          it per renewal.
  storm   register, renewals and lookups run; the service is killed and
          restarted (the memory store loses every record), every agent
          registers again. Reports the time until all are back, and the
          lookups in that window: p99, NOT_FOUND (names not back yet) apart
          from errors.
  watch   register, watchers sync, then changes for --duration-s. Reports
          delivery latency p50/p99/max, events delivered, service CPU per
          event sent.

A service that does not renew KeepAliveRequest.lease_ids answers them ttl 0:
every batched lease then counts as lost and registers again; measure such a
service with --agents-per-process 1 (one lease a message). One that ignores
WatchAgentsRequest.names sends every watcher every record and change (the
snapshot alone is --watchers x --agents events): watch_events_received
against watch_events_delivered shows it.

host_busy_cores is the whole machine's busy CPU over the window (the service,
the load generators and anything else running): where it nears the core
count, latencies measure the machine's contention as much as the service.

--store memory (default), etcd (a local /usr/bin/etcd in a temporary
directory on free ports, stopped after; its CPU and RSS reported) or
etcd://host:port (a running one). With --profile, py-spy samples replica 0
during the measured window and the top functions by own time go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the load generators (spawned) and the service import kvx from this tree
    sys.path.insert(0, ROOT)

from kvx import _loop  # noqa: E402  (kvx from this tree, above)

SERVICE = "/kvx.v1.MetadataService/"
STAMP = "bench_sent_ns"  # engine_info key of a watch-mode change: its send time, time.time_ns()
_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
_TICK_S = 0.01


def _name(i: int) -> str:
    return f"agent-{i:06d}"


def _record(i: int) -> Any:
    from kvx.v1 import metadata_pb2

    name = _name(i)
    rec = metadata_pb2.AgentRecord(
        name=name,
        epoch=i + 1,
        role=1 + i % 2,
        started_unix_ms=1,
        labels={"model": "llama-3-8b", "zone": f"z{i % 4}"},
        engine_info={"url": f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000"},
    )
    rec.metadata.name, rec.metadata.epoch, rec.metadata.protocol_version = name, i + 1, 1
    rec.metadata.endpoints.add(backend=1, address=f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:40000")
    for r in range(4):
        rec.metadata.regions.add(
            id=r + 1,
            size_bytes=1 << 30,
            memory_kind=2,
            device=r,
            address=0x7F0000000000 + r,
            remote_read=True,
            remote_write=True,
        )
    return rec


def _channel(address: str) -> Any:
    import grpc

    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.keepalive_time_ms", 5000),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            # Back as soon as the service is (storm), not after gRPC's default 1 s .. 120 s.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
    )


class _Window:
    """Counters snapshotted when the parent opens (``go``) and closes (``end``) the measured window."""

    def __init__(self, go: Any, end: Any) -> None:
        self.go, self.end = go, end
        self.at: list[tuple[float, float, dict]] = []

    def poll(self, counters: dict) -> None:
        if len(self.at) == 0 and self.go.is_set() or len(self.at) == 1 and self.end.is_set():
            self.at.append((time.monotonic(), time.process_time(), dict(counters)))

    def rates(self) -> dict:
        if len(self.at) < 2:
            return {}
        (t0, c0, k0), (t1, c1, k1) = self.at
        out = {f"{k}_per_s": round((k1[k] - k0[k]) / (t1 - t0), 1) for k in k1}
        out["cpu_cores"] = round((c1 - c0) / (t1 - t0), 3)
        out["window_s"] = round(t1 - t0, 2)
        out.update({f"{k}_in_window": k1[k] - k0[k] for k in k1})
        return out


class _Agents:
    """A set of agent hosts in one process: registration, batched renewals, re-registration."""

    def __init__(self, cfg: dict, idx: int, lo: int, hi: int, ctl: dict, out: Any) -> None:
        from kvx.v1 import metadata_pb2

        self.pb = metadata_pb2
        self.cfg, self.idx, self.lo, self.out, self.ctl = cfg, idx, lo, out, ctl
        self.n = hi - lo
        ttl = 300 if cfg["no_keepalive"] else 0
        self.prefix = [
            metadata_pb2.RegisterAgentRequest(record=_record(lo + a), ttl_s=ttl).SerializeToString()
            for a in range(self.n)
        ]
        self.lease = [0] * self.n
        self.g = cfg["agents_per_process"]
        self.groups = math.ceil(self.n / self.g)
        self.group_bytes: list[bytes | None] = [None] * self.groups
        self.streams = max(1, min(cfg["streams_per_proc"], self.groups))
        self.pending: set[int] = set(range(self.n))
        self.ttl_s = 10
        self.stopping = False
        self.c = {
            "registrations": 0,
            "messages": 0,
            "renewals": 0,
            "lost": 0,
            "stream_breaks": 0,
            "register_errors": 0,
            "changes": 0,
            "change_errors": 0,
            "changes_skipped": 0,
        }
        self.errors: dict[str, int] = {}
        self.back_at: list[float] = []
        self.tasks: set[asyncio.Task] = set()
        self.calls: dict[int, Any] = {}
        self.fifo: dict[int, deque] = {}
        self.outbox: dict[int, asyncio.Queue] = {}
        self.changing: set[int] = set()  # agents with an update in flight
        # --register-batch: agents waiting to be sent in a RegisterAgents call, and how
        # often each has been refused in a row (its backoff).
        self.batch = cfg["register_batch"]
        self.queued: list[int] = []
        self.attempts = [0] * self.n

    def _replica(self, group: int) -> int:
        # Groups go to streams in turn, streams to replicas in turn: a host talks to one replica.
        return (group % self.streams + self.idx) % len(self.chans)

    async def run(self) -> None:
        import grpc

        self.grpc = grpc
        self.chans = [_channel(a) for a in self.cfg["addresses"]]
        self.register_m = [c.unary_unary(SERVICE + "RegisterAgent") for c in self.chans]
        self.register_many_m = [c.unary_unary(SERVICE + "RegisterAgents") for c in self.chans]
        self.keepalive_m = [c.stream_stream(SERVICE + "KeepAlive") for c in self.chans]
        self.sem = asyncio.Semaphore(self.cfg["register_concurrency"])
        t0 = time.monotonic()

        async def register_all() -> None:
            if self.batch > 1:
                self.queued.extend(range(self.n))
                while self.pending and not self.stopping:
                    await asyncio.sleep(_TICK_S)
            else:
                await asyncio.gather(*(self.register(a) for a in range(self.n)))
            self.out.put(("registered", self.idx, time.monotonic() - t0, self.errors.copy()))

        # Each lease is renewed from its registration on (the first ones would expire
        # before the last agents are in, at 100,000 agents), as an agent's own would be.
        window = _Window(self.ctl["go"], self.ctl["end"])
        runners = [register_all()]
        if self.batch > 1:
            runners.append(self._flush())
        if not self.cfg["no_keepalive"]:
            runners += [self._stream(s) for s in range(self.streams)]
        if self.cfg["changes_per_s"]:
            runners.append(self._changes())
        tasks = [asyncio.ensure_future(r) for r in runners]
        # Every group once per ttl/3 (the ttl the service answers), this process's
        # groups offset from the other processes' so that all are spread evenly.
        due = -self.idx / max(1, self.cfg["agent_procs"])
        last = time.monotonic()
        sent = 0
        while not self.ctl["stop"].is_set():
            window.poll(self.c)
            if not self.cfg["no_keepalive"]:
                now = time.monotonic()
                due += (now - last) / (self.ttl_s / 3) * self.groups
                last = now
                while sent < int(due):
                    self._send(sent % self.groups)
                    sent += 1
            await asyncio.sleep(_TICK_S)
        window.poll(self.c)
        self.stopping = True
        for call in self.calls.values():
            call.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        self.out.put(
            (
                "done",
                self.idx,
                {
                    "counters": self.c,
                    "window": window.rates(),
                    "errors": self.errors,
                    "back_at": self.back_at,
                    "ttl_s": self.ttl_s,
                },
            )
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def register(self, a: int, request: bytes | None = None) -> bool:
        """Registers agent ``a`` (again: with its last lease as proof), retrying until it is in."""
        grpc = self.grpc
        async with self.sem:
            for attempt in range(10_000):
                if self.stopping:
                    return False
                lease = self.lease[a]
                req = request or self.prefix[a] + (
                    self.pb.RegisterAgentRequest(lease_id=lease).SerializeToString() if lease else b""
                )
                try:
                    raw = await self.register_m[self._replica(a // self.g)](req, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    if self.stopping:
                        return False
                    self.c["register_errors"] += 1
                    self.errors[exc.code().name] = self.errors.get(exc.code().name, 0) + 1
                    wait_s = _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]
                    for key, value in exc.trailing_metadata() or ():
                        if key == "kvx-retry-after-ms":
                            wait_s = int(value) / 1000
                    await asyncio.sleep(wait_s * random.uniform(0.5, 1.0))
                    continue
                self._registered(a, self.pb.RegisterAgentResponse.FromString(raw))
                return True
        return False

    def _lost(self, a: int) -> None:
        if a not in self.pending:
            self.pending.add(a)
            if self.batch > 1:
                self.queued.append(a)
            else:
                self._spawn(self.register(a))

    def _registered(self, a: int, reply: Any) -> None:
        self.lease[a] = reply.lease_id
        self.ttl_s = reply.ttl_s
        self.group_bytes[a // self.g] = None
        self.c["registrations"] += 1
        if a in self.pending:
            self.pending.discard(a)
            if not self.pending:
                self.back_at.append(time.monotonic())
                self.out.put(("back", self.idx, self.back_at[-1]))

    async def _flush(self) -> None:
        """--register-batch: every tick, what waits goes out in RegisterAgents calls of
        up to that many agents (the agents of one process that lost their leases
        together, as kvx's client sends them)."""
        while not self.stopping:
            if self.queued:
                todo, self.queued = sorted(set(self.queued)), []
                for start in range(0, len(todo), self.batch):
                    self._spawn(self._register_batch(todo[start : start + self.batch]))
            await asyncio.sleep(_TICK_S)

    def _retry(self, agents: list[int], wait_s: float) -> None:
        def again() -> None:
            self.queued.extend(a for a in agents if a in self.pending)

        asyncio.get_running_loop().call_later(wait_s * random.uniform(0.5, 1.0), again)

    async def _register_batch(self, agents: list[int]) -> None:
        req = self.pb.RegisterAgentsRequest()
        for a in agents:
            item = req.requests.add()
            item.ParseFromString(self.prefix[a])
            item.lease_id = self.lease[a]
        async with self.sem:
            if self.stopping:
                return
            try:
                raw = await self.register_many_m[self._replica(agents[0] // self.g)](
                    req.SerializeToString(), timeout=30
                )
            except self.grpc.aio.AioRpcError as exc:
                if self.stopping:
                    return
                self.c["register_errors"] += len(agents)
                self.errors[exc.code().name] = self.errors.get(exc.code().name, 0) + len(agents)
                attempt = max(self.attempts[a] for a in agents)
                for a in agents:
                    self.attempts[a] += 1
                self._retry(agents, _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
                return
        for a, result in zip(agents, self.pb.RegisterAgentsResponse.FromString(raw).results, strict=True):
            if result.code == 0:
                self.attempts[a] = 0
                self._registered(a, result.response)
                continue
            name = self.grpc.StatusCode.UNKNOWN.name
            for status in self.grpc.StatusCode:
                if status.value[0] == result.code:
                    name = status.name
            self.c["register_errors"] += 1
            self.errors[name] = self.errors.get(name, 0) + 1
            wait_s = _BACKOFF_S[min(self.attempts[a], len(_BACKOFF_S) - 1)]
            if result.retry_after_ms:
                wait_s = result.retry_after_ms / 1000
            self.attempts[a] += 1
            self._retry([a], wait_s)

    def _send(self, group: int) -> None:
        s = group % self.streams
        call = self.calls.get(s)
        if call is None:
            return
        members = [
            a for a in range(group * self.g, min((group + 1) * self.g, self.n)) if a not in self.pending
        ]
        if not members:
            return
        leases = [self.lease[a] for a in members]
        if self.group_bytes[group] is None or len(members) < min(self.g, self.n - group * self.g):
            req = (
                self.pb.KeepAliveRequest(lease_id=leases[0])
                if self.g == 1
                else self.pb.KeepAliveRequest(lease_ids=leases)
            )
            data = req.SerializeToString()
            if len(members) == min(self.g, self.n - group * self.g):
                self.group_bytes[group] = data
        else:
            data = self.group_bytes[group]
        self.fifo[s].append((members, leases))
        self.outbox[s].put_nowait(data)

    async def _writer(self, call: Any, outbox: asyncio.Queue) -> None:
        """One write at a time on a stream (gRPC allows no concurrent writes)."""
        with contextlib.suppress(self.grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                await call.write(await outbox.get())

    async def _stream(self, s: int) -> None:
        grpc = self.grpc
        attempt = 0
        while not self.stopping:
            call = self.keepalive_m[self._replica(s)](timeout=None)
            self.fifo[s] = deque()
            self.outbox[s] = asyncio.Queue()
            self.calls[s] = call
            writer = asyncio.ensure_future(self._writer(call, self.outbox[s]))
            try:
                while True:
                    raw = await call.read()
                    if raw is grpc.aio.EOF:
                        break
                    attempt = 0
                    if not self.fifo[s]:  # an answer to no request: count it, do not guess
                        self.errors["keepalive_unasked"] = self.errors.get("keepalive_unasked", 0) + 1
                        continue
                    members, leases = self.fifo[s].popleft()
                    reply = self.pb.KeepAliveResponse.FromString(raw)
                    self.c["messages"] += 1
                    self.c["renewals"] += len(leases)
                    ttls = [reply.ttl_s] if self.g == 1 else list(reply.ttls_s)
                    if len(ttls) != len(leases):  # a service that does not renew lease_ids
                        ttls = [0] * len(leases)
                    for a, lease, ttl in zip(members, leases, ttls, strict=True):
                        if ttl == 0 and self.lease[a] == lease:
                            self.c["lost"] += 1
                            self._lost(a)
            except grpc.aio.AioRpcError as exc:
                if self.stopping:
                    break
                self.errors["keepalive_" + exc.code().name] = (
                    self.errors.get("keepalive_" + exc.code().name, 0) + 1
                )
            self.calls.pop(s, None)
            writer.cancel()
            if self.stopping:
                break
            # The stream broke: its agents register again, as a client's Registration does.
            self.c["stream_breaks"] += 1
            for group in range(s, self.groups, self.streams):
                for a in range(group * self.g, min((group + 1) * self.g, self.n)):
                    self._lost(a)
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    async def _changes(self) -> None:
        """The watch-mode driver: registers its agents again in turn, the send time stamped."""
        while not self.ctl["go"].is_set():
            await asyncio.sleep(0.01)
        rate = self.cfg["changes_per_s"]
        start = time.monotonic()
        k = 0
        while not self.ctl["end"].is_set():
            await asyncio.sleep(max(0.0, start + k / rate - time.monotonic()))
            a = k % self.n
            k += 1
            if a in self.pending or a in self.changing:  # one update of an agent at a time
                self.c["changes_skipped"] += 1
                continue
            self.changing.add(a)
            rec = _record(self.lo + a)
            rec.engine_info[STAMP] = str(time.time_ns())
            req = self.pb.RegisterAgentRequest(record=rec, lease_id=self.lease[a]).SerializeToString()
            self._spawn(self._change(a, req))

    async def _change(self, a: int, req: bytes) -> None:
        try:
            raw = await self.register_m[self._replica(a // self.g)](req, timeout=30)
        except self.grpc.aio.AioRpcError as exc:
            self.c["change_errors"] += 1
            self.errors["change_" + exc.code().name] = self.errors.get("change_" + exc.code().name, 0) + 1
            return
        finally:
            self.changing.discard(a)
        self.lease[a] = self.pb.RegisterAgentResponse.FromString(raw).lease_id
        self.group_bytes[a // self.g] = None
        self.c["changes"] += 1


def _pin(cpus: list[int] | None) -> None:
    """Runs this process (and the threads it starts later) on ``cpus`` (None: anywhere)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def _agents_proc(cfg: dict, idx: int, lo: int, hi: int, ctl: dict, out: Any) -> None:
    _pin(cfg["load_cpus"])
    agents = _Agents(cfg, idx, lo, hi, ctl, out)
    _loop.run(_loop.loop_factory(cfg["load_event_loop"]), agents.run())


def _collector_off(collect: bool = True) -> None:
    """For a load generator's measured window: no pause of Python's cycle collector
    in what measures latency. Lookups that back up are thousands of calls in
    flight, and full collections of them (100-240 ms every 3 s were seen) would
    be counted against the service. The window's garbage waits for gc.enable().
    ``collect``: collect first (before anything is measured)."""
    if collect:
        gc.collect()
    gc.freeze()
    gc.disable()


def _lookup_proc(cfg: dict, idx: int, rate: float, ctl: dict, out: Any) -> None:
    _pin(cfg["load_cpus"])
    import grpc

    from kvx.v1 import metadata_pb2

    batch = cfg["lookup_batch"]
    if batch == 1:
        method = "GetAgent"
        requests = [
            metadata_pb2.GetAgentRequest(name=_name(i)).SerializeToString() for i in range(cfg["agents"])
        ]
    else:  # an engine's ranks: consecutive agents
        method = "GetAgents"
        requests = [
            metadata_pb2.GetAgentsRequest(names=[_name(j) for j in range(i, i + batch)]).SerializeToString()
            for i in range(0, cfg["agents"] - batch + 1, batch)
        ]
    rate /= batch  # calls a second

    async def main() -> dict:
        chans = [_channel(a) for a in cfg["read_addresses"]]
        methods = [c.unary_unary(SERVICE + method) for c in chans]
        for m in methods:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await m(requests[0], timeout=10)
        at_s: list[float] = []
        lat_ms: list[float] = []
        late_ms: list[float] = []  # the generator's own: its schedule to the call's start
        call_ms: list[float] = []  # the call's start (before gRPC's client work) to its answer
        codes: list[int] = []  # 0 answered, 1 NOT_FOUND, 2 error
        errors: dict[str, int] = {}

        async def one(k: int, at: float) -> None:
            code = 0
            started = time.monotonic()
            try:
                answer = await methods[k % len(methods)](
                    requests[random.randrange(len(requests))], timeout=10
                )
                if batch > 1:
                    got = metadata_pb2.GetAgentsResponse.FromString(answer)
                    if got.answered < batch:  # cut at the service's page bytes: not a lookup done
                        code = 2
                        errors["CUT_SHORT"] = errors.get("CUT_SHORT", 0) + 1
                    elif len(got.records) < batch:
                        code = 1  # a name not found
            except grpc.aio.AioRpcError as exc:
                code = 1 if exc.code() == grpc.StatusCode.NOT_FOUND else 2
                if code == 2:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            at_s.append(at)
            now = time.monotonic()
            lat_ms.append((now - at) * 1e3)
            late_ms.append((started - at) * 1e3)
            call_ms.append((now - started) * 1e3)
            codes.append(code)

        out.put(("ready", idx))
        while not ctl["go"].is_set():
            await asyncio.sleep(0.005)
        _collector_off()
        start, cpu0 = time.monotonic(), time.process_time()
        tasks: set[asyncio.Task] = set()
        k = 0
        while not ctl["end"].is_set():
            for _ in range(50):
                at = start + k / rate
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                task = asyncio.ensure_future(one(k, at))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
        elapsed, cpu = time.monotonic() - start, time.process_time() - cpu0
        if tasks:
            await asyncio.wait(tasks, timeout=15)
        gc.enable()  # once no call is measured
        return {
            "sent": k,
            "unanswered": k - len(lat_ms),  # still waiting 15 s after the window
            "rate_per_s": round(k * batch / elapsed, 1),  # names
            "cpu_cores": round(cpu / elapsed, 3),
            "errors": dict(errors),
            "at": np.asarray(at_s),
            "lat_ms": np.asarray(lat_ms),
            "late_ms": np.asarray(late_ms),
            "call_ms": np.asarray(call_ms),
            "code": np.asarray(codes, dtype=np.int8),
        }

    out.put(("done", idx, _loop.run(_loop.loop_factory(cfg["load_event_loop"]), main())))


def _watch_proc(cfg: dict, idx: int, count: int, ctl: dict, out: Any) -> None:
    _pin(cfg["load_cpus"])
    import grpc

    from kvx.v1 import metadata_pb2

    Event = metadata_pb2.WatchAgentsResponse
    rng = random.Random(idx)
    pool = cfg["watched_agents"]

    async def main() -> dict:
        chans = [_channel(a) for a in cfg["read_addresses"]]
        methods = [c.unary_stream(SERVICE + "WatchAgents") for c in chans]
        lat_ms: list[float] = []
        c = {"synced": 0, "delivered": 0, "received": 0, "snapshot_events": 0, "stream_errors": 0}
        errors: dict[str, int] = {}

        async def watcher(w: int) -> None:
            names = (
                set() if cfg["watch_all"] else {_name(i) for i in rng.sample(range(pool), cfg["names_per"])}
            )
            req = metadata_pb2.WatchAgentsRequest(names=sorted(names)).SerializeToString()
            call = methods[(w + idx) % len(methods)](req)
            synced = False
            try:
                async for raw in call:
                    ev = Event.FromString(raw)
                    if not synced:
                        if ev.type == Event.EVENT_TYPE_SYNCED:
                            synced = True
                            c["synced"] += 1
                            if c["synced"] == count:
                                out.put(("synced", idx))
                        else:
                            c["snapshot_events"] += 1
                        continue
                    now = time.time_ns()
                    c["received"] += 1
                    if ev.type == Event.EVENT_TYPE_PUT and (not names or ev.record.name in names):
                        stamp = ev.record.engine_info.get(STAMP)
                        if stamp and ctl["go"].is_set():
                            c["delivered"] += 1
                            lat_ms.append((now - int(stamp)) / 1e6)
            except grpc.aio.AioRpcError as exc:
                if not ctl["stop"].is_set():
                    c["stream_errors"] += 1
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

        window = _Window(ctl["go"], ctl["end"])
        calls = [asyncio.ensure_future(watcher(w)) for w in range(count)]
        collecting = True
        while not ctl["stop"].is_set():
            window.poll(c)
            if collecting and ctl["go"].is_set() and not ctl["end"].is_set():
                _collector_off(collect=False)  # deliveries are being measured already
                collecting = False
            elif not collecting and ctl["end"].is_set():
                gc.enable()
                collecting = True
            await asyncio.sleep(0.02)
        gc.enable()
        for task in calls:
            task.cancel()
        await asyncio.wait(calls, timeout=10)
        return {"counters": c, "window": window.rates(), "errors": errors, "lat_ms": np.asarray(lat_ms)}

    out.put(("done", idx, _loop.run(_loop.loop_factory(cfg["load_event_loop"]), main())))


# The parent: service, etcd, orchestration, figures.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_busy_s() -> float:
    """CPU seconds the whole machine spent busy (every process, ours and others')."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _gc_full(admin: str) -> tuple[float, float] | None:
    """Full collections of the cycle collector so far, and their seconds in all,
    from a service's /metrics; None where it has none (an older kvx)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for part in ("count", "sum"):
            if line.startswith(f'kvx_metadata_gc_pause_seconds_{part}{{generation="2"}} '):
                values[part] = float(line.split()[-1])
    return (values["count"], values["sum"]) if len(values) == 2 else None


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _cpu_list(text: str) -> list[int]:
    cpus = sorted({int(c) for c in text.split(",") if c.strip()})
    if not cpus or not set(cpus) < os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give some, not all, of CPUs {sorted(os.sched_getaffinity(0))}"
        )
    return cpus


def _load_cpus(service_cpus: list[int] | None) -> list[int] | None:
    return sorted(os.sched_getaffinity(0) - set(service_cpus)) if service_cpus else None


def _wait_port(address: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} did not start listening on {address}") from None
            time.sleep(0.05)


class _Etcd:
    def __init__(self, cpus: list[int] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvx-bench-etcd-")
        client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        self.url = "etcd://" + client.removeprefix("http://")
        self.log = open(os.path.join(self.dir, "etcd.log"), "ab")  # noqa: SIM115 - closed in stop()
        from kvx._spawn import launched

        self.proc = subprocess.Popen(
            launched(
                [
                    "/usr/bin/etcd",
                    "--name",
                    "kvx-bench",
                    "--data-dir",
                    os.path.join(self.dir, "data"),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"kvx-bench={peer}",
                    "--initial-cluster-state",
                    "new",
                    "--quota-backend-bytes",
                    str(8 << 30),
                ],
                cpus=cpus or (),
            ),  # fmt: skip
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        _wait_port(client.removeprefix("http://"), self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class _Replica:
    def __init__(self, address: str, store: str, args: argparse.Namespace) -> None:
        self.address, self.store, self.args = address, store, args
        # Its admin API, for /metrics (its collections of the cycle collector).
        self.admin = f"127.0.0.1:{_free_port()}"
        self.start()

    def start(self) -> None:
        from kvx._spawn import launched

        args = self.args
        self.proc = subprocess.Popen(
            launched(
                [
                    sys.executable,
                    "-m",
                    "kvx.cli",
                    "--log-level",
                    args.service_log_level,
                    "metadata",
                    "--listen",
                    self.address,
                    "--admin-listen",
                    self.admin,
                    "--store",
                    self.store,
                    "--max-agents",
                    str(args.agents + 1000),
                    "--max-watch-streams",
                    str(max(256, args.watchers + 64)),
                    "--event-loop",
                    args.event_loop,
                ],
                cpus=args.service_cpus or (),
            ),  # fmt: skip
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
        _wait_port(self.address, self.proc)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait_serving(address: str, timeout_s: float = 60) -> None:
    """Until the service at ``address`` reports SERVING (a read replica: its first copy is complete)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                if health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"the service at {address} did not report SERVING within {timeout_s} s")


def _count_registered(address: str) -> int:
    import grpc

    from kvx.v1 import metadata_pb2, metadata_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = metadata_pb2_grpc.MetadataServiceStub(ch)
        count, token = 0, ""
        while True:
            page = stub.ListAgents(
                metadata_pb2.ListAgentsRequest(page_size=1000, page_token=token), timeout=60
            )
            count += len(page.records)
            token = page.next_page_token
            if not token:
                return count


def _pct(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
        "max_ms": round(float(values.max()), 3),
    }


_PROCS: list[Any] = []  # the load generators, checked while waiting on them


def _get(queue: Any, deadline: float) -> Any:
    import queue as queues

    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            failed = [p.name for p in _PROCS if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"load generator(s) {failed} failed (see above)") from None
            if time.monotonic() > deadline:
                raise TimeoutError("the load generators did not answer in time") from None


def _collect(queue: Any, kind: str, n: int, timeout_s: float) -> dict[int, Any]:
    """The first ``kind`` message of each of ``n`` processes: {process index: payload}."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        msg = _get(queue, deadline)
        if msg[0] == kind:
            got[msg[1]] = msg[2] if len(msg) == 3 else msg[2:]
    return got


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    step = math.ceil((hi - lo) / parts)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def _profile(pid: int, duration_s: float) -> subprocess.Popen | None:
    if not shutil.which("py-spy"):
        return None
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, int(duration_s))),
            "--format",
            "raw",
            "--output",
            "/dev/stdout",
            "--nonblocking",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _top_self(raw: str, n: int = 15) -> list[tuple[str, float]]:
    """Top functions by own (leaf) samples from py-spy's raw output."""
    from collections import Counter

    counts: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        counts[stack.split(";")[-1]] += int(count)
        total += int(count)
    return [(name, c / total) for name, c in counts.most_common(n)] if total else []


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["steady", "storm", "watch"], default="steady")
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--lookups-per-s", type=float, default=1000, help="0: no lookups")
    p.add_argument("--duration-s", type=float, default=30.0, help="the measured window (steady, watch)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="renewals running before the window opens")
    p.add_argument("--no-keepalive", action="store_true", help="no renewals (leases of 300 s): lookups alone")
    p.add_argument("--renewals-only", action="store_true", help="no lookups: renewals alone")
    p.add_argument("--agents-per-process", type=int, default=8, help="leases renewed in one KeepAliveRequest")
    p.add_argument("--keepalive-streams", type=int, default=64, help="KeepAlive streams in all")
    p.add_argument("--agent-procs", type=int, default=2, help="agent-host load generator processes")
    p.add_argument("--lookup-procs", type=int, default=1)
    p.add_argument(
        "--lookup-batch",
        type=int,
        default=1,
        help="names per lookup call: 1 sends GetAgent, more send GetAgents of that many consecutive agents",
    )
    p.add_argument(
        "--register-concurrency", type=int, default=64, help="registration calls in flight per process"
    )
    p.add_argument(
        "--register-batch",
        type=int,
        default=1,
        help="agents registered in one RegisterAgents call (as kvx's client sends the agents of one "
        "process that register together); 1: one RegisterAgent call each",
    )
    p.add_argument("--watchers", type=int, default=1000)
    p.add_argument("--watch-procs", type=int, default=2)
    p.add_argument("--watched-agents", type=int, default=1000, help="agents the change driver holds")
    p.add_argument("--names-per-watcher", type=int, default=8)
    p.add_argument("--watch-all", action="store_true", help="watchers watch every agent (no names)")
    p.add_argument("--changes-per-s", type=float, default=20.0)
    p.add_argument("--storm-timeout-s", type=float, default=600.0)
    p.add_argument("--store", default="memory", help="memory, etcd (a local one is started) or etcd://...")
    p.add_argument("--replicas", type=int, default=1, help="kvx metadata processes on the one store")
    p.add_argument(
        "--read-replicas",
        type=int,
        default=0,
        help="kvx metadata --store mirror:// processes following the first replica; lookups and "
        "watchers go to them",
    )
    p.add_argument("--profile", action="store_true", help="sample replica 0 with py-spy")
    p.add_argument(
        "--event-loop",
        choices=_loop.LOOPS,
        default="asyncio",
        help="the services' event loop (kvx metadata --event-loop)",
    )
    p.add_argument(
        "--load-event-loop",
        choices=_loop.LOOPS,
        default="asyncio",
        help="the load generators' event loop",
    )
    p.add_argument(
        "--service-log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the services' log level (their logs go to this command's stderr)",
    )
    p.add_argument(
        "--service-cpus",
        type=_cpu_list,
        default=None,
        help="run the service replicas on these CPUs (e.g. 0) and the load generators on the "
        "others, so that they do not take turns on the same cores (default: all share all)",
    )
    args = p.parse_args()
    if not 1 <= args.lookup_batch <= min(64, args.agents):
        p.error("--lookup-batch: 1 to 64 names a call (GetAgentsRequest's bound), at most --agents")
    if args.replicas > 1 and args.store == "memory":
        p.error("--replicas > 1 needs a shared store: --store etcd or etcd://...")
    if args.read_replicas < 0 or (args.read_replicas and args.store != "memory"):
        p.error("--read-replicas mirrors the memory store (etcd replicas share their store already)")
    if args.no_keepalive and args.mode != "steady":
        p.error("--no-keepalive is for --mode steady")
    if not 1 <= args.register_batch <= 128:
        p.error("--register-batch must be within [1, 128] (the service's bound per RegisterAgents call)")
    if not 1 <= args.agents_per_process <= 1024:
        p.error("--agents-per-process must be within [1, 1024] (the service's bound per request)")
    for loop in {args.event_loop, args.load_event_loop}:
        try:
            _loop.loop_factory(loop)
        except Exception as exc:
            p.error(str(exc))
    if args.mode == "watch":
        args.watched_agents = min(args.watched_agents, args.agents)
        args.names_per_watcher = min(args.names_per_watcher, args.watched_agents)
    return args


def main() -> int:
    args = _parse()
    etcd = _Etcd(args.service_cpus) if args.store == "etcd" else None
    store = etcd.url if etcd else args.store
    replicas: list[_Replica] = []
    procs: list[Any] = _PROCS
    ctx = mp.get_context("spawn")
    ctl = {k: ctx.Event() for k in ("go", "end", "stop")}
    out_a, out_l, out_w = ctx.Queue(), ctx.Queue(), ctx.Queue()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "mode": args.mode,
        "store": args.store,
        "replicas": args.replicas,
        "read_replicas": args.read_replicas,
        "event_loop": args.event_loop,
        "load_event_loop": args.load_event_loop,
        "service_cpus": args.service_cpus or "all",
        "agents": args.agents,
        "agents_per_process": args.agents_per_process,
        "register_batch": args.register_batch,
        "lookup_batch": args.lookup_batch,
    }
    try:
        for _ in range(args.replicas):
            replicas.append(_Replica(f"127.0.0.1:{_free_port()}", store, args))
        mirrors: list[_Replica] = []
        for _ in range(args.read_replicas):
            mirrors.append(_Replica(f"127.0.0.1:{_free_port()}", f"mirror://{replicas[0].address}", args))
            replicas.append(mirrors[-1])  # stopped with the others; their CPU is the service's too
        for m in mirrors:
            _wait_serving(m.address)
        cfg = {
            "addresses": [r.address for r in replicas if r not in mirrors],
            "read_addresses": [r.address for r in (mirrors or replicas)],
            "agents": args.agents,
            "agents_per_process": args.agents_per_process,
            "agent_procs": args.agent_procs,
            "streams_per_proc": max(1, args.keepalive_streams // args.agent_procs),
            "register_concurrency": args.register_concurrency,
            "register_batch": args.register_batch,
            "no_keepalive": args.no_keepalive,
            "changes_per_s": 0.0,
            "watched_agents": args.watched_agents,
            "names_per": args.names_per_watcher,
            "watch_all": args.watch_all,
            "load_cpus": _load_cpus(args.service_cpus),
            "load_event_loop": args.load_event_loop,
            "lookup_batch": args.lookup_batch,
        }
        first = args.watched_agents if args.mode == "watch" else 0
        shares = _split(first, args.agents, args.agent_procs) if first < args.agents else []
        if first:
            shares.insert(0, (0, first))
        for i, (lo, hi) in enumerate(shares):
            c = dict(cfg, changes_per_s=args.changes_per_s if first and i == 0 else 0.0)
            procs.append(ctx.Process(target=_agents_proc, args=(c, i, lo, hi, ctl, out_a), daemon=True))
        lookups = 0 if args.renewals_only else args.lookups_per_s
        n_look = args.lookup_procs if lookups else 0
        for i in range(n_look):
            procs.append(
                ctx.Process(target=_lookup_proc, args=(cfg, i, lookups / n_look, ctl, out_l), daemon=True)
            )
        watch_shares = _split(0, args.watchers, args.watch_procs) if args.mode == "watch" else []
        for p in procs:
            p.start()
        t0 = time.monotonic()
        reg = _collect(out_a, "registered", len(shares), args.storm_timeout_s + args.agents / 50)
        result["register_all_s"] = round(time.monotonic() - t0, 2)
        result["register_errors"] = _merge(e for _, e in reg.values())
        if n_look:
            _collect(out_l, "ready", n_look, 120)
        wprocs = [
            ctx.Process(target=_watch_proc, args=(cfg, i, hi - lo, ctl, out_w), daemon=True)
            for i, (lo, hi) in enumerate(watch_shares)
        ]
        for p in wprocs:
            p.start()
        procs += wprocs
        if wprocs:
            t1 = time.monotonic()
            _collect(out_w, "synced", len(wprocs), 300 + args.watchers)
            result["watch_sync_s"] = round(time.monotonic() - t1, 2)
        time.sleep(args.warmup_s)
        pids = [r.proc.pid for r in replicas]
        cpu0 = [_cpu_s(pid) for pid in pids]
        etcd_cpu0 = _cpu_s(etcd.proc.pid) if etcd else 0.0
        gc0 = [_gc_full(r.admin) for r in replicas]
        w0, host0 = time.monotonic(), _host_busy_s()
        ctl["go"].set()
        w0_host = w0
        spy = _profile(pids[0], args.duration_s - 1) if args.profile else None
        if args.mode == "storm":
            time.sleep(2.0)
            t_kill = time.monotonic()
            cpu_before = [_cpu_s(pid) for pid in pids]
            for r in replicas:
                if r not in mirrors:  # read replicas follow the restarted service by themselves
                    r.kill()
            for r in replicas:
                if r not in mirrors:
                    r.start()
            t_up = time.monotonic()
            mirror_cpu_up = {r.proc.pid: _cpu_s(r.proc.pid) for r in mirrors}
            back = _collect_back(out_a, len(shares), t_kill, args.storm_timeout_s)
            t_back = max(back)
            time.sleep(2.0)
            result.update(
                {
                    "restart_s": round(t_up - t_kill, 2),
                    "reregister_all_s": round(t_back - t_up, 2),
                    "reregister_all_from_kill_s": round(t_back - t_kill, 2),
                    "storm_service_cpu_cores": round(
                        sum(_cpu_s(r.proc.pid) - mirror_cpu_up.get(r.proc.pid, 0.0) for r in replicas)
                        / (time.monotonic() - t_up),
                        2,
                    ),
                }
            )
            result["service_cpu_before_kill_cores"] = round(
                sum(b - a for a, b in zip(cpu0, cpu_before, strict=True)) / (t_kill - w0), 3
            )
            # The restarted processes: CPU since their start; the read replicas: since then.
            cpu0 = [mirror_cpu_up.get(r.proc.pid, 0.0) for r in replicas]
            w0 = t_up
            times = {"t_kill": t_kill, "t_up": t_up, "t_back": t_back}
        else:
            time.sleep(args.duration_s)
            times = {}
        ctl["end"].set()
        w1 = time.monotonic()
        cpu1 = [_cpu_s(pid) for pid in (r.proc.pid for r in replicas)]
        etcd_cpu1 = _cpu_s(etcd.proc.pid) if etcd else 0.0
        gc1 = [_gc_full(r.admin) for r in replicas]
        window = w1 - w0
        result["host_busy_cores"] = round((_host_busy_s() - host0) / (w1 - w0_host), 2)
        result["host_loadavg_1m"] = round(os.getloadavg()[0], 2)
        looks = _collect(out_l, "done", n_look, 120)
        if args.mode == "watch":
            time.sleep(2.0)  # the last changes' deliveries
        # Counted while the agents still renew: once they stop, a slow host's wait for
        # their reports outlasts the leases' ttl, and the count then tells nothing.
        registered = _count_registered(replicas[0].address)
        ctl["stop"].set()
        agents = _collect(out_a, "done", len(shares), 120)
        watches = _collect(out_w, "done", len(wprocs), 120)
        rss = [_status_kb(r.proc.pid, "VmHWM") for r in replicas]
        cpu = [(b - a) / window for a, b in zip(cpu0, cpu1, strict=True)]
        service_cpu = sum(cpu)
        result["window_s"] = round(window, 2)
        _agent_figures(result, args, agents, registered, service_cpu)
        if n_look:
            _lookup_figures(result, args, looks, service_cpu, window, times)
        if wprocs:
            _watch_figures(result, watches, service_cpu * window)
        result["service_cpu_cores"] = round(service_cpu, 3)
        if args.mode != "storm":  # a restarted service starts its counts again
            # Per service (primary first): full collections in the window, and the seconds they held it.
            result["service_gc_full"] = [
                [round(b[0] - a[0]), round(b[1] - a[1], 3)] if a and b else None
                for a, b in zip(gc0, gc1, strict=True)
            ]
        result["service_peak_rss_mib"] = round(sum(rss) / 1024, 1)
        if args.replicas > 1 or mirrors:
            result["replicas_cpu_cores"] = [round(c, 3) for c in cpu]
            result["replicas_peak_rss_mib"] = [round(k / 1024, 1) for k in rss]
        if etcd:
            result["etcd_pid"] = etcd.proc.pid
            result["etcd_cpu_cores"] = round((etcd_cpu1 - etcd_cpu0) / window, 3)
            result["etcd_peak_rss_mib"] = round(_status_kb(etcd.proc.pid, "VmHWM") / 1024, 1)
        result["load_generators"] = _generators(agents, looks, watches)
        profile = _top_self(spy.communicate(timeout=60)[0]) if spy else []
    finally:
        ctl["stop"].set()
        ctl["end"].set()
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
        for r in reversed(replicas):  # read replicas first: their primary outlives them
            r.stop()
        if etcd:
            etcd.stop()
    print(json.dumps(result))
    if profile:
        print("replica 0 time by function (own samples, py-spy):", file=sys.stderr)
        for name, share in profile:
            print(f"  {share:5.1%}  {name}", file=sys.stderr)
    return 0


def _merge(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _collect_back(queue: Any, n: int, since: float, timeout_s: float) -> list[float]:
    """When each agents process had all its agents registered again after ``since``."""
    got: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        msg = _get(queue, deadline)
        if msg[0] == "back" and msg[2] > since:
            got[msg[1]] = msg[2]
    return list(got.values())


def _agent_figures(
    result: dict, args: argparse.Namespace, agents: dict, registered: int, service_cpu: float
) -> None:
    counters = _merge(a["counters"] for a in agents.values())
    ttl_s = max(a["ttl_s"] for a in agents.values())
    windows = [a["window"] for a in agents.values() if a["window"]]
    renewals = sum(w.get("renewals_per_s", 0) for w in windows)
    messages = sum(w.get("messages_per_s", 0) for w in windows)
    result.update(
        {
            "lease_ttl_s": ttl_s,
            "renewals_per_s_target": 0 if args.no_keepalive else round(args.agents / (ttl_s / 3), 1),
            "renewals_per_s": round(renewals, 1),
            "keepalive_messages_per_s": round(messages, 1),
            "leases_lost": counters["lost"],
            "keepalive_stream_breaks": counters["stream_breaks"],
            "registrations": counters["registrations"],
            "registered_at_end": registered,
            "missing_at_end": args.agents - registered,
            "agent_errors": _merge(a["errors"] for a in agents.values()),
        }
    )
    if args.mode == "watch":
        result["changes_per_s"] = round(sum(w.get("changes_per_s", 0) for w in windows), 1)
        result["change_errors"] = counters["change_errors"]
        result["changes_skipped"] = counters["changes_skipped"]  # the agent's last update not answered yet
    if args.renewals_only and renewals:
        result["service_cpu_us_per_renewal"] = round(service_cpu / renewals * 1e6, 1)
        result["service_cpu_us_per_message"] = round(service_cpu / messages * 1e6, 1)


def _lookup_figures(
    result: dict, args: argparse.Namespace, looks: dict, service_cpu: float, window: float, where: dict
) -> None:
    at = np.concatenate([r["at"] for r in looks.values()])
    lat = np.concatenate([r["lat_ms"] for r in looks.values()])
    code = np.concatenate([r["code"] for r in looks.values()])
    result["lookups_per_s_target"] = args.lookups_per_s
    result["lookups_per_s"] = round(sum(r["rate_per_s"] for r in looks.values()), 1)
    if args.mode == "storm":
        t_kill, t_up = where["t_kill"], where["t_up"]
        t_back = where["t_back"]
        before = (at < t_kill) & (code == 0)
        down = (at >= t_kill) & (at < t_up)
        storm = (at >= t_up) & (at <= t_back)
        answered = storm & (code < 2)
        result.update({f"lookup_before_{k}": v for k, v in _pct(lat[before]).items()})
        result["lookups_while_down"] = int(down.sum())
        result["lookup_errors_while_down"] = int((down & (code == 2)).sum())
        result["storm_lookups"] = int(storm.sum())
        result.update({f"storm_lookup_{k}": v for k, v in _pct(lat[answered]).items()})
        result["storm_lookups_found"] = int((storm & (code == 0)).sum())
        result["storm_lookups_not_found"] = int((storm & (code == 1)).sum())
        result["storm_lookup_errors"] = int((storm & (code == 2)).sum())
    else:
        ok = code == 0
        result.update({f"lookup_{k}": v for k, v in _pct(lat[ok]).items()})
        # How late the generator itself started its calls (its timer, its own CPU):
        # included in the latencies above, which count from the scheduled time.
        late = np.concatenate([r["late_ms"] for r in looks.values()])
        result.update({f"lookup_start_late_{k}": v for k, v in _pct(late[ok]).items()})
        call = np.concatenate([r["call_ms"] for r in looks.values()])
        result.update({f"lookup_from_start_{k}": v for k, v in _pct(call[ok]).items()})
        result["lookups_not_found"] = int((code == 1).sum())
        result["lookup_errors"] = int((code == 2).sum())
        if args.no_keepalive and ok.any():
            # Per name looked up; per call too when a call looks up several.
            per_call = service_cpu * window / ok.sum() * 1e6
            result["service_cpu_us_per_lookup"] = round(per_call / args.lookup_batch, 1)
            if args.lookup_batch > 1:
                result["service_cpu_us_per_call"] = round(per_call, 1)
    result["lookup_error_codes"] = _merge(r["errors"] for r in looks.values())
    result["lookups_unanswered"] = sum(r["unanswered"] for r in looks.values())


def _watch_figures(result: dict, watches: dict, service_cpu_s: float) -> None:
    lat = np.concatenate([w["lat_ms"] for w in watches.values()]) if watches else np.zeros(0)
    counters = _merge(w["counters"] for w in watches.values())
    received = sum(w["window"].get("received_in_window", 0) for w in watches.values())
    result.update({f"watch_delivery_{k}": v for k, v in _pct(lat).items()})
    result["watchers_synced"] = counters["synced"]
    result["watch_snapshot_events"] = counters["snapshot_events"]
    result["watch_events_delivered"] = counters["delivered"]
    result["watch_events_received"] = counters["received"]
    result["watch_stream_errors"] = counters["stream_errors"]
    result["watch_error_codes"] = _merge(w["errors"] for w in watches.values())
    if received:
        result["service_cpu_us_per_event_sent"] = round(service_cpu_s / received * 1e6, 1)


def _generators(agents: dict, looks: dict, watches: dict) -> list[dict]:
    out = []
    for kind, results in (("agents", agents), ("watch", watches)):
        for i, r in sorted(results.items()):
            w = r["window"]
            out.append(
                {"proc": f"{kind}{i}", "cpu_cores": w.get("cpu_cores")}
                | {k: v for k, v in w.items() if k.endswith("_per_s") and v}
            )
    for i, r in sorted(looks.items()):
        out.append({"proc": f"lookup{i}", "cpu_cores": r["cpu_cores"], "lookups_per_s": r["rate_per_s"]})
    return out


if __name__ == "__main__":
    sys.exit(main())
