"""The state and event loop of one simulation run (model: kvx/plan/simulate.py)."""

from __future__ import annotations

import bisect
import heapq
import math
import operator
import time
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvx.plan._sim_engine import Engine

# rare events: (time, kind, node, 0)
FAIL, DETECT, RESTART, TICK = 0, 1, 2, 3
# an instance as the cluster sees it: up; failed, its lease not yet expired (the router
# still sends it requests, which fail); failed and known to be (the router skips it)
UP, DOWN, KNOWN_DOWN = 0, 1, 2

_REPICKS_MAX = 64  # router re-draws when it hits an instance it knows is down
_CHECK_EVERY = 1 << 14  # arrivals between checks of the caps
INF = math.inf
_first = operator.itemgetter(0)


SAMPLES_MAX = 1 << 20  # latencies kept per series (a uniform sample of them beyond this)
PENDING_MAX = 1 << 20  # transfers known but not yet at their decode NIC: an unstable run's backlog


class Samples:
    """One latency series: count, sum and max of every value, and a uniform random sample
    of at most SAMPLES_MAX values for the percentiles (bottom-k sampling: each value gets a
    uniform random key and the SAMPLES_MAX smallest keys are kept; seeded, so a run is
    still reproducible). Values are appended to ``buf`` (float32) in the hot loop;
    ``compact`` folds it into the sample once it is full, keeping memory at about
    ``SAMPLES_MAX`` x 16 bytes per series at any run length."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.buf = array("f")
        self.count = 0
        self.total = 0.0
        self.max = -INF
        self.kept = np.empty(0, dtype=np.float32)
        self.keys = np.empty(0)
        self.sampled = False

    def compact(self, force: bool = False) -> None:
        if len(self.buf) < SAMPLES_MAX and not force:
            return
        if not len(self.buf):
            return
        new = np.frombuffer(self.buf, dtype=np.float32).copy()
        del self.buf[:]  # in place: the hot loop holds buf.append
        self.count += new.size
        self.total += float(new.sum(dtype=np.float64))
        self.max = max(self.max, float(new.max()))
        if not self.sampled and self.kept.size + new.size <= SAMPLES_MAX:
            self.kept = np.concatenate([self.kept, new])
            return
        if not self.sampled:  # first time over the cap: key what was kept until now
            self.keys = self.rng.random(self.kept.size)
            self.sampled = True
        values = np.concatenate([self.kept, new])
        keys = np.concatenate([self.keys, self.rng.random(new.size)])
        if values.size > SAMPLES_MAX:
            keep = np.argpartition(keys, SAMPLES_MAX - 1)[:SAMPLES_MAX]
            values, keys = values[keep], keys[keep]
        self.kept, self.keys = values, keys

    def summary(self) -> dict[str, float]:
        """count, mean and max of every value; p50, p90, p99 of the sample."""
        self.compact(force=True)
        if not self.count:
            return {"count": 0}
        p50, p90, p99 = np.percentile(self.kept, [50, 90, 99])
        return {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "max": self.max,
        }


class _Metadata:
    """The metadata service: ``cores`` FIFO servers for lookups, registrations and
    change fan-outs; lease renewals are a fluid load that slows every core by
    1 / (1 - u), u the renewals' share of the cores (100,000 nodes renew hundreds of
    thousands of times a second: one event each would dominate the run)."""

    def __init__(self, engine: Engine) -> None:
        c = engine.c
        md = c.metadata
        self.md = md
        self.cores = [0.0] * md.cores  # a heap of the times each core frees
        self.warm = c.warmup_s
        self.end = c.duration_s
        self.agents = (c.prefill + c.decode) * md.agents_per_node
        self.renew_t = 0.0
        self.slow = 1.0  # 1 / (1 - u); INF when renewals alone saturate the cores
        self.saturated = False
        self.ops = {"lookup": 0.0, "renewal": 0.0, "register": 0.0, "notify": 0.0}
        self.timeouts = 0
        self._set_agents(0.0, 0)

    def _set_agents(self, now: float, delta: int) -> None:
        md = self.md
        lo = max(self.renew_t, self.warm)
        hi = min(now, self.end)
        if hi > lo:
            self.ops["renewal"] += self.agents / md.renewal_interval_s * (hi - lo)
        self.renew_t = now
        self.agents += delta
        u = self.agents * md.renewal_cost_s / md.renewal_interval_s / md.cores
        if u < 1.0:
            self.slow = 1.0 / (1.0 - u)
        else:
            self.slow = INF
            self.saturated = True

    def burst(self, now: float, kind: str, ops: int, cost_s: float) -> None:
        """Work arriving at once (registrations, a change sent to every watcher),
        spread over the cores ahead of lookups that arrive later."""
        if self.warm <= now < self.end:
            self.ops[kind] += ops
        if self.slow == INF or not ops:
            return
        per_core = ops * cost_s / len(self.cores) * self.slow
        # max(now, f) + x keeps the heap's order, so the list stays a heap
        self.cores[:] = [(f if f > now else now) + per_core for f in self.cores]

    def close(self) -> None:
        self._set_agents(self.end, 0)

    def report(self, window_s: float, lookup_s: dict[str, float]) -> dict[str, Any]:
        md = self.md
        work = (
            self.ops["lookup"] * md.lookup_cost_s
            + self.ops["renewal"] * md.renewal_cost_s
            + self.ops["register"] * md.register_cost_s
            + self.ops["notify"] * md.notify_cost_s
        )
        return {
            "ops_per_s": {kind: n / window_s for kind, n in self.ops.items()},
            "utilisation": work / (md.cores * window_s),
            "cores": md.cores,
            "lookup_p99_s": lookup_s.get("p99"),
            "timeouts": self.timeouts,
            "saturated": self.saturated,
        }


class Loop:
    """All per-instance state, in flat lists, and the loop that advances it."""

    def __init__(
        self, engine: Engine, failures: list[tuple[float, int, int, int]], per_node: dict[int, list[float]]
    ):
        c = engine.c
        self.engine = engine
        self.c = c
        P, D, K = c.prefill, c.decode, c.nics_per_node
        self.prefill_free = [0.0] * P
        self.prefill_busy = [0.0] * P
        self.send_free: list[Any] = [0.0] * P if K == 1 else [[0.0] * K for _ in range(P)]
        self.receive_free: list[Any] = [0.0] * D if K == 1 else [[0.0] * K for _ in range(D)]
        self.send_busy = [0.0] * P
        self.receive_busy = [0.0] * D
        self.state_p = [UP] * P
        self.state_d = [UP] * D
        self.known_down = [0, 0]  # prefill, decode
        self.epoch_d = [0] * D
        self.next_fail_p = [INF] * P
        self.next_fail_d = [INF] * D
        self.fail_times = per_node
        self.fail_index: dict[int, int] = {}
        for node, times in per_node.items():
            self._set_next_fail(node, times[0])
        self.rare: list[tuple[float, int, int, int]] = list(failures)
        heapq.heapify(self.rare)
        self.metadata = _Metadata(engine)
        self.counts = dict.fromkeys(
            ("arrived", "completed", "dropped", "failed_routed", "failed_metadata", "no_instance"), 0
        )
        self.failures = {"count": 0, "prefill": 0, "decode": 0, "in_window": 0, "skipped": 0}
        self.events = 0
        rng = engine.rng_samples
        self.ttft = Samples(rng)
        self.transfer = Samples(rng)
        self.prefill_wait = Samples(rng)
        self.lookup = Samples(rng)
        self.series = (self.ttft, self.transfer, self.prefill_wait, self.lookup)
        self._spine_init(engine)

    def _set_next_fail(self, node: int, t: float) -> None:
        if node < self.c.prefill:
            self.next_fail_p[node] = t
        else:
            self.next_fail_d[node - self.c.prefill] = t

    # -- the spine: a fluid approximation -------------------------------------------

    def _spine_init(self, engine: Engine) -> None:
        """Each window, a leaf's cross-leaf bytes (the larger of up and down) over its
        uplink capacity is its offered load; in the next window transfers between two
        leaves take max(1, that load) of the two leaves times longer."""
        c = self.c
        L = engine.leaves
        self.leaf_p = (np.arange(c.prefill) * L // c.prefill).tolist()
        self.leaf_d = (np.arange(c.decode) * L // c.decode).tolist()
        self.stretch = [1.0] * L
        self.up_bytes = [0.0] * L
        self.down_bytes = [0.0] * L
        self.spine_stats = {"windows": 0, "sum": 0.0, "max": 0.0, "overloaded": 0}
        if engine.spine:
            nodes = np.bincount(self.leaf_p, minlength=L) + np.bincount(self.leaf_d, minlength=L)
            bw = engine._nic_bytes_per_s()
            # a leaf with no nodes (fewer nodes than leaves x nodes_per_leaf, spread evenly)
            # carries nothing: an infinite capacity gives it an offered load of 0, not 0/0
            self.leaf_occupied = nodes > 0
            capacity = nodes * c.nics_per_node * bw / c.spine_oversubscription
            self.leaf_capacity = np.where(self.leaf_occupied, capacity, INF)
            if c.spine_window_s < c.duration_s:
                self.rare.append((c.spine_window_s, TICK, 0, 0))
                heapq.heapify(self.rare)

    def _tick(self, now: float) -> None:
        c = self.c
        w = c.spine_window_s
        offered = np.maximum(np.asarray(self.up_bytes), np.asarray(self.down_bytes)) / (
            self.leaf_capacity * w
        )
        self.stretch[:] = np.maximum(offered, 1.0).tolist()
        if now - w >= c.warmup_s:
            s = self.spine_stats
            s["windows"] += int(self.leaf_occupied.sum())
            s["sum"] += float(np.minimum(offered, 1.0).sum())
            s["max"] = max(s["max"], float(offered.max()))
            s["overloaded"] += int((offered > 1.0).sum())
        self.up_bytes[:] = [0.0] * len(self.up_bytes)
        self.down_bytes[:] = [0.0] * len(self.down_bytes)
        if now + w < c.duration_s:
            heapq.heappush(self.rare, (now + w, TICK, 0, 0))

    # -- failures -------------------------------------------------------------------

    def _rare(self, now: float, kind: int, node: int) -> None:
        c = self.c
        md = c.metadata
        P = c.prefill
        is_p = node < P
        i = node if is_p else node - P
        states = self.state_p if is_p else self.state_d
        if kind == FAIL:
            times = self.fail_times[node]
            j = self.fail_index.get(node, 0) + 1
            self.fail_index[node] = j
            self._set_next_fail(node, times[j] if j < len(times) else INF)
            if states[i] != UP:
                self.failures["skipped"] += 1  # a node already down does not fail again
                return
            states[i] = DOWN
            if not is_p:
                self.epoch_d[i] += 1  # transfers on their way to it are lost
            self.failures["count"] += 1
            self.failures["prefill" if is_p else "decode"] += 1
            if c.warmup_s <= now:
                self.failures["in_window"] += 1
            self.metadata._set_agents(now, -md.agents_per_node)
            # its lease expires ttl after the last renewal, which came up to an interval ago
            detect = now + md.lease_ttl_s - self.engine.rnd.random() * md.renewal_interval_s
            back = now + c.restart_s
            if detect < back:
                heapq.heappush(self.rare, (detect, DETECT, node, 0))
            heapq.heappush(self.rare, (back, RESTART, node, 0))
        elif kind == DETECT:
            if states[i] == DOWN:
                states[i] = KNOWN_DOWN
                self.known_down[0 if is_p else 1] += 1
                self.metadata.burst(
                    now, "notify", md.agents_per_node * self.engine.watchers, md.notify_cost_s
                )
        elif kind == RESTART:
            if states[i] == KNOWN_DOWN:
                self.known_down[0 if is_p else 1] -= 1
            states[i] = UP
            if is_p:
                self.prefill_free[i] = now
                self.send_free[i] = now if c.nics_per_node == 1 else [now] * c.nics_per_node
            else:
                self.receive_free[i] = now if c.nics_per_node == 1 else [now] * c.nics_per_node
            self.metadata._set_agents(now, md.agents_per_node)
            self.metadata.burst(now, "register", md.agents_per_node, md.register_cost_s)
            self.metadata.burst(now, "notify", md.agents_per_node * self.engine.watchers, md.notify_cost_s)
        else:
            self._tick(now)

    def _repick(self, states: list[int], n: int, which: int) -> int:
        """Another instance, drawn among those not known to be down; -1 if none."""
        if self.known_down[which] >= n:
            return -1
        randrange = self.engine.rnd.randrange
        for _ in range(_REPICKS_MAX):
            x = randrange(n)
            if states[x] != KNOWN_DOWN:
                return x
        up = [x for x in range(n) if states[x] != KNOWN_DOWN]
        return up[randrange(len(up))]

    # -- the loop -------------------------------------------------------------------

    def run(self, batches: Iterator[tuple[list[Any], ...]], started: float) -> str | None:
        """Advance through every arrival, then drain; returns why it stopped early, or None."""
        c = self.c
        md = c.metadata
        K = c.nics_per_node
        warm = c.warmup_s
        overhead = c.overhead_s
        lookup_cost = md.lookup_cost_s
        lookup_timeout = md.timeout_s
        meta = self.metadata
        mcores = meta.cores
        counts = self.counts
        rare = self.rare
        pending: list[tuple[float, int, float, float, float, float, int]] = []
        pending_min = INF
        pending_add = pending.append
        heappop, heapreplace = heapq.heappop, heapq.heapreplace
        prefill_free, prefill_busy = self.prefill_free, self.prefill_busy
        send_free, send_busy = self.send_free, self.send_busy
        receive_free, receive_busy = self.receive_free, self.receive_busy
        state_p, state_d, epoch_d = self.state_p, self.state_d, self.epoch_d
        next_fail_p, next_fail_d = self.next_fail_p, self.next_fail_d
        spine = self.engine.spine
        leaf_p, leaf_d, stretch = self.leaf_p, self.leaf_d, self.stretch
        up_bytes, down_bytes = self.up_bytes, self.down_bytes
        ttft_add, transfer_add = self.ttft.buf.append, self.transfer.buf.append
        wait_add, lookup_add = self.prefill_wait.buf.append, self.lookup.buf.append
        series = self.series
        handle_rare, repick = self._rare, self._repick
        P, D = c.prefill, c.decode
        completed = dropped = 0

        def flush(upto: float) -> None:
            """The transfers that reached their decode NIC by `upto`, in that order.

            Only each decode NIC's own order matters, and every transfer reaching one by
            `upto` is known once the arrivals up to `upto` are handled; so transfers wait
            in a plain list and are sorted in batches (a heap of tens of thousands of
            pending transfers cost more than the rest of the loop)."""
            nonlocal completed, dropped, pending_min
            if pending_min > upto:
                return
            # what is left from the last flush is sorted already, which Timsort makes use of
            pending.sort(key=_first)
            n = bisect.bisect_right(pending, upto, key=_first)
            ready = pending[:n]
            del pending[:n]
            pending_min = pending[0][0] if pending else INF
            self.events += len(ready)
            for s1, d, S, t, pf, lat, epoch in ready:
                if epoch_d[d] != epoch:  # the decode node failed since the request was routed
                    if t >= warm:
                        dropped += 1
                    continue
                if K == 1:
                    r = receive_free[d]
                    if r < s1:
                        r = s1
                    end = r + S
                    receive_free[d] = end
                else:
                    h = receive_free[d]
                    r = h[0]
                    if r < s1:
                        r = s1
                    end = r + S
                    heapreplace(h, end)
                if end > next_fail_d[d]:
                    if t >= warm:
                        dropped += 1
                    continue
                if t >= warm:
                    completed += 1
                    receive_busy[d] += S
                    ttft_add(end - t + lat + overhead)
                    transfer_add(end - pf)

        def until(t: float) -> str | None:
            """Handle the rare events up to t; those on decode nodes after the transfers
            that reach them first. Returns why the caps stopped it, or None: a long
            stretch without arrivals (a low rate) is all rare events."""
            check = self.events + _CHECK_EVERY
            while rare and rare[0][0] <= t:
                now, kind, node, _ = heappop(rare)
                if node >= P:
                    flush(now)
                handle_rare(now, kind, node)
                self.events += 1
                if self.events >= check:
                    stop = self._capped(events, now, started)
                    if stop:
                        return stop
                    check = self.events + _CHECK_EVERY
            return None

        next_rare = rare[0][0] if rare else INF
        events = 0
        next_check = _CHECK_EVERY
        truncated = None
        arrived = failed_routed = failed_metadata = no_instance = 0
        # The hot loop: one pass per arrival; state lives in the locals bound above.
        for times, prefill, decode, busy, nbytes, seconds, misses in batches:
            for t, p, d, b, nb, S, m in zip(
                times, prefill, decode, busy, nbytes, seconds, misses, strict=True
            ):
                if events >= next_check:
                    truncated = self._capped(events, t, started)
                    if not truncated and len(pending) > PENDING_MAX:
                        truncated = (
                            f"stopped at {t:.3f} s simulated: {len(pending):,} requests queued "
                            f"(the backlog bound, {PENDING_MAX:,}); a queue is unstable"
                        )
                    if truncated:
                        break
                    for one in series:
                        one.compact()
                    next_check = events + _CHECK_EVERY
                if t >= next_rare:
                    truncated = until(t)
                    if truncated:
                        break
                    next_rare = rare[0][0] if rare else INF
                events += 1
                measured = t >= warm
                if measured:
                    arrived += 1
                lat = 0.0
                if m:
                    if meta.slow == INF:
                        lat = INF
                    else:
                        f = mcores[0]
                        done = (f if f > t else t) + m * lookup_cost * meta.slow
                        heapreplace(mcores, done)
                        lat = done - t
                    if measured:
                        meta.ops["lookup"] += m
                    if lat > lookup_timeout:
                        if measured:
                            failed_metadata += 1
                        continue
                if state_p[p]:
                    if state_p[p] == KNOWN_DOWN:
                        p = repick(state_p, P, 0)
                    if p < 0 or state_p[p] == DOWN:
                        if measured:
                            if p < 0:
                                no_instance += 1
                            else:
                                failed_routed += 1
                        continue
                if state_d[d]:
                    if state_d[d] == KNOWN_DOWN:
                        d = repick(state_d, D, 1)
                    if d < 0 or state_d[d] == DOWN:
                        if measured:
                            if d < 0:
                                no_instance += 1
                            else:
                                failed_routed += 1
                        continue
                start = prefill_free[p]
                if start < t:
                    start = t
                pf = start + b
                prefill_free[p] = pf
                if spine:
                    lp = leaf_p[p]
                    ld = leaf_d[d]
                    if lp != ld:
                        x = stretch[lp]
                        y = stretch[ld]
                        S *= x if x > y else y
                        up_bytes[lp] += nb
                        down_bytes[ld] += nb
                if K == 1:
                    s1 = send_free[p]
                    if s1 < pf:
                        s1 = pf
                    send_free[p] = s1 + S
                else:
                    h = send_free[p]
                    s1 = h[0]
                    if s1 < pf:
                        s1 = pf
                    heapreplace(h, s1 + S)
                if s1 + S > next_fail_p[p]:
                    if measured:
                        dropped += 1
                    continue
                if measured:
                    prefill_busy[p] += b
                    send_busy[p] += S
                    wait_add(start - t)
                    if m:
                        lookup_add(lat)
                pending_add((s1, d, S, t, pf, lat, epoch_d[d]))
                if s1 < pending_min:
                    pending_min = s1
            if truncated:
                break
            if times:
                flush(times[-1])
                for one in series:
                    one.compact()
        if not truncated:
            truncated = until(INF)
        if not truncated:
            flush(INF)
        self.events += events
        counts.update(
            arrived=arrived,
            completed=completed,
            dropped=dropped,
            failed_routed=failed_routed,
            failed_metadata=failed_metadata,
            no_instance=no_instance,
        )
        counts["unfinished"] = arrived - completed - dropped - failed_routed - failed_metadata - no_instance
        meta.timeouts = failed_metadata
        meta.close()
        return truncated

    def _capped(self, events: int, t: float, started: float) -> str | None:
        c = self.c
        if events + self.events >= c.max_events:
            return f"stopped at {t:.3f} s simulated: the cap of {c.max_events} events (max_events)"
        if time.monotonic() - started >= c.max_wall_s:
            return f"stopped at {t:.3f} s simulated: the cap of {c.max_wall_s} s of wall time (max_wall_s)"
        return None

    # -- results ------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        c = self.c
        window = c.duration_s - c.warmup_s
        K = c.nics_per_node
        lookup = self.lookup.summary()
        s = self.spine_stats
        utilisation = {
            "prefill_mean": sum(self.prefill_busy) / (c.prefill * window),
            "prefill_max": max(self.prefill_busy) / window,
            "nic_send_mean": sum(self.send_busy) / (c.prefill * K * window),
            "nic_send_max": max(self.send_busy) / (K * window),
            "nic_receive_mean": sum(self.receive_busy) / (c.decode * K * window),
            "nic_receive_max": max(self.receive_busy) / (K * window),
        }
        if self.engine.spine:
            utilisation["spine_mean"] = s["sum"] / s["windows"] if s["windows"] else 0.0
            utilisation["spine_offered_max"] = s["max"]
            utilisation["spine_overloaded_fraction"] = s["overloaded"] / s["windows"] if s["windows"] else 0.0
        node_hours = (c.prefill + c.decode) * c.duration_s / 3600.0
        return {
            "requests": dict(self.counts),
            "ttft_s": self.ttft.summary(),
            "transfer_s": self.transfer.summary(),
            "prefill_wait_s": self.prefill_wait.summary(),
            "lookup_s": lookup,
            "utilisation": utilisation,
            "metadata": self.metadata.report(window, lookup),
            "failures": {
                **self.failures,
                "node_hours": node_hours,
                "per_node_hour": self.failures["count"] / node_hours,
            },
        }
