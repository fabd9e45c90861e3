"""What the chaos soak saw (benchmarks/soak.py): faults, operations,
errors, corruptions and hangs, and the attribution of each error to the
fault that caused it."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from soak import AgentProc


@dataclasses.dataclass
class Fault:
    kind: str
    target: str  # "soak-a<i>", "metadata" or "etcd"
    start: float
    end: float | None = None
    detail: str = ""


class Ledger:
    """Everything the agents report, and the verdict. Called from the event readers and the main loop."""

    def __init__(self, args: argparse.Namespace, agent_cfg: dict) -> None:
        self.lock = threading.Lock()
        t = agent_cfg["timeouts"]
        # The longest a connect(name) may take: the watch's first sync, five lookups, the handshake.
        self.connect_bound_s = 6 * agent_cfg["metadata_timeout_s"] + t["connect_s"] + args.margin_s
        self.transfer_bound_s = t["transfer_s"] + args.margin_s
        self.faults: list[Fault] = []
        self.stopped: dict[int, list[list[float | None]]] = collections.defaultdict(list)
        self.outstanding: dict[tuple[int, int, int], float] = {}
        self.hung: set[tuple[int, int, int]] = set()
        self.hangs: list[dict] = []
        self.done = collections.Counter()
        self.bytes = 0
        self.skipped = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.foreign: list[dict] = []
        self.crashes: list[dict] = []
        self.crash_count = 0
        self.corrupt: list[dict] = []
        self.corrupt_count = 0
        self.late: list[dict] = []
        self.late_count = 0
        self.landed = collections.Counter()
        self.start_retries = 0
        self.cut_by_kill = 0
        self.unattributed: list[dict] = []
        self.unattributed_count = 0
        self.fault_to_error: dict[str, dict] = {}
        self.longest_wait: dict | None = None
        self.longest_connect: dict | None = None
        self.pending_after_wait = 0

    def stopped_within(self, index: int, t0: float, t1: float) -> float:
        """Seconds agent ``index`` spent stopped (SIGSTOP) between t0 and t1."""
        total = 0.0
        for start, end in self.stopped.get(index, ()):
            assert start is not None
            total += max(0.0, min(t1, end if end is not None else t1) - max(t0, start))
        return total

    def on_event(self, proc: AgentProc, ev: dict) -> None:
        kind, index = ev.get("k"), proc.index
        key = (index, proc.incarnation, ev.get("i", 0))
        with self.lock:
            if kind == "b":
                self.outstanding[key] = ev["t"]
            elif kind == "e":
                self.outstanding.pop(key, None)
                self._ended(proc, key, ev)
            elif kind == "landed":
                self.landed.update({k: ev.get(k, 0) for k in ("ok", "superseded", "late", "corrupt")})
            elif kind == "late":
                self.late_count += 1
                if len(self.late) < 20:
                    self.late.append(dict(ev, agent=f"soak-a{index}"))
            elif kind == "corrupt":
                self.corrupt_count += 1
                if len(self.corrupt) < 20:
                    self.corrupt.append(dict(ev, agent=f"soak-a{index}"))
            elif kind == "hang":
                self._hang(key, f"soak-a{index}", ev.get("op"), ev.get("peer"), "the agent gave up waiting")
            elif kind == "crash":
                self.crash(dict(ev, agent=f"soak-a{index}"))
            elif kind == "start_retry":
                self.start_retries += 1

    def crash(self, what: dict) -> None:
        """An agent or service failed by itself (caller holds the lock, or is the only thread)."""
        self.crash_count += 1
        if len(self.crashes) < 20:
            self.crashes.append(what)

    def _hang(self, key: tuple, agent: str, op: Any, peer: Any, why: str) -> None:
        if key not in self.hung:
            self.hung.add(key)
            self.hangs.append({"agent": agent, "op": op, "peer": peer, "why": why})

    def _ended(self, proc: AgentProc, key: tuple, ev: dict) -> None:
        agent = f"soak-a{proc.index}"
        if ev.get("pending_after_wait"):
            self.pending_after_wait += 1
        if ev.get("hung"):
            self._hang(key, agent, ev["op"], ev["peer"], "still pending past its timeout plus the margin")
        t_phase = ev["tp"] if ev["tp"] is not None else ev["te"]
        connect_s = t_phase - ev["tb"]
        connect_own = connect_s - self.stopped_within(proc.index, ev["tb"], t_phase)
        if self.longest_connect is None or connect_s > self.longest_connect["wall_s"]:
            self.longest_connect = {"wall_s": connect_s, "agent": agent, "peer": ev["peer"], "op": ev["op"]}
        if connect_own > self.connect_bound_s:
            self._hang(key, agent, ev["op"], ev["peer"], f"connect took {connect_own:.1f} s")
        if ev["tp"] is not None:
            wait_s = ev["te"] - ev["tp"]
            own_s = wait_s - self.stopped_within(proc.index, ev["tp"], ev["te"])
            if self.longest_wait is None or wait_s > self.longest_wait["wall_s"]:
                self.longest_wait = {
                    "wall_s": wait_s,
                    "excluding_own_stop_s": own_s,
                    "agent": agent,
                    "peer": ev["peer"],
                    "op": ev["op"],
                    "outcome": "done" if ev["ok"] else ev.get("cls"),
                }
            if own_s > self.transfer_bound_s:
                self._hang(key, agent, ev["op"], ev["peer"], f"the transfer took {own_s:.1f} s")
        if ev["ok"] is None:
            self.skipped += 1
        elif ev["ok"]:
            self.done[ev["op"]] += 1
            self.bytes += ev["bytes"]
        elif not ev.get("kvx_error"):
            self.errors[f"not a kvx error: {ev['cls']}"] += 1
            if len(self.foreign) < 20:
                self.foreign.append(
                    {k: ev.get(k) for k in ("op", "peer", "cls", "msg", "trace")} | {"agent": agent}
                )
        else:
            self.errors[ev["cls"]] += 1
            self._attribute(agent, ev)

    def _attribute(self, agent: str, ev: dict) -> None:
        """The fault that most likely caused this error, and how long it took to
        surface. Candidates: faults on the initiator or its peer, and, for an
        error before the transfer was posted (finding the peer by name), on the
        metadata service or etcd; active during the operation or in the 5 s
        before it. The latency runs from the fault, or from the start of the
        operation when the fault came first; the most direct cause (the
        shortest latency) wins."""
        t_err, t_begin = ev["te"], ev["tb"]
        targets = {agent, ev["peer"]} | ({"metadata", "etcd"} if ev["tp"] is None else set())
        best: tuple[float, Fault] | None = None
        for fault in reversed(self.faults):
            if fault.end is not None and fault.end < t_begin - 5.0:
                if fault.end < t_err - 120.0:
                    break  # faults are in start order and none lasts this long
                continue
            if fault.start > t_err or fault.target not in targets:
                continue
            latency = t_err - max(fault.start, t_begin)
            if best is None or latency < best[0]:
                best = (latency, fault)
        if best is None:
            self.unattributed_count += 1
            if len(self.unattributed) < 10:
                self.unattributed.append(
                    {k: ev[k] for k in ("op", "peer", "cls", "msg")} | {"agent": agent, "t": ev["te"]}
                )
            return
        latency, fault = best
        kind = (
            fault.kind
            if fault.target not in (agent, ev["peer"])
            else f"{fault.kind} of the {'initiator' if fault.target == agent else 'peer'}"
        )
        known = self.fault_to_error.get(kind)
        if known is None or latency > known["s"]:
            self.fault_to_error[kind] = {
                "s": round(latency, 3),
                "fault": f"{fault.kind} {fault.target} {fault.detail}".strip(),
                "error": f"{ev['cls']} at {agent} ({ev['op']} {ev['peer']}): {ev['msg'][:200]}",
            }

    def check_outstanding(self, procs: dict[int, AgentProc], now: float, final: bool = False) -> None:
        """Operations older than every bound they could legitimately take are hangs."""
        bound = self.connect_bound_s + self.transfer_bound_s
        with self.lock:
            for key, t_begin in list(self.outstanding.items()):
                index, incarnation, _ = key
                proc = procs.get(index)
                if proc is None or proc.incarnation != incarnation or proc.killed:
                    self.outstanding.pop(key)
                    self.cut_by_kill += 1
                    continue
                own = now - t_begin - self.stopped_within(index, t_begin, now)
                if own > bound or (final and not proc.bye.is_set()):
                    self._hang(key, f"soak-a{index}", None, None, f"unfinished after {own:.1f} s")
