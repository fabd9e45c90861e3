"""Chaos soak: kvx agents in their own network namespaces move verified blocks
while faults hit them at random.

    sudo python3 benchmarks/soak.py --duration-s 600 --seed 1

Needs root, iproute2 (ip, tc), iptables and etcd (/usr/bin/etcd). Everything
runs inside network namespaces the soak creates (named kvxsoak-PID-*): a hub
holding a bridge, etcd (on the hub's loopback) and `kvx metadata` (store:
that etcd), and one namespace per agent, joined to the bridge by a veth pair.
Each agent (benchmarks/soak_agent.py, tcp backend) READs blocks from its
peers and WRITEs blocks into them without pause; every block's bytes derive
from (agent, region, block, generation), so the reader checks every byte it
got and a WRITE's target checks every byte that landed.

Faults, drawn from --seed: SIGKILL of an agent and its restart (new epoch),
SIGSTOP then SIGCONT, packet loss on an agent's link (iptables statistic
DROP), a bandwidth cap on it (tc tbf), and restarts of the metadata service
and of etcd. At the end it prints a report (--json-out writes it as JSON)
and exits 1 if a block was corrupted (or overwritten by a WRITE that had
failed for its writer, unless --allow-late-writes), a transfer hung (did not finish
within its timeout plus --margin-s), an error was not a kvx error, an agent
crashed, or nothing was transferred; 2 if the soak itself could not run.
Namespaces, processes and rules are removed on exit, on failure and on
Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from soak_ledger import Fault, Ledger
from soak_net import (
    ETCD_CLIENT,
    ETCD_PEER,
    HUB_IP,
    METADATA_PORT,
    START_TIMEOUT_S,
    Network,
    Service,
    SoakError,
    check_tools,
    etcd_healthy,
    kill_process,
    metadata_serving,
    remove_stale,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
AGENT_SCRIPT = Path(__file__).with_name("soak_agent.py")
FAULT_KINDS = ("kill", "stop", "loss", "bandwidth", "metadata", "etcd")
# How long an agent told to exit at the end may take: Agent.close() stops its watcher
# (up to 10 s), joins its renewer (4 s), unregisters (metadata_timeout_s, 3 s) and joins
# its links (close_s, 3 s), one after another, right after the last heal; and a margin.
EXIT_BOUND_S = 30.0
# The etcd lease behind each agent's 4 s lease. Once the service that tracked
# a lease restarts, or etcd restarts (it resets every lease's time left), a
# killed agent's record lasts until this runs out, and its next incarnation
# waits for its name that long (docs/metadata.md). The default, 60 s, is
# longer than the soak's restarts are apart (about 13 s each for the service
# and etcd): killed agents could not start again.
ETCD_BACKSTOP_S = 8


# An agent event's times (time.monotonic() in the agent, which shares the
# clock): the op's begin, post and end, and a plain event's own.
EVENT_TIMES = ("t", "tb", "tp", "te")


def relative_times(ev: dict, started: float) -> dict[str, float]:
    """The event's times, in seconds from the soak's start (events.jsonl).
    Only numbers: a field that is not a time (a traceback, a missing post) is
    left out rather than ending the thread that reads the agent's events."""
    return {
        k: round(v - started, 3)
        for k, v in ev.items()
        if k in EVENT_TIMES and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class AgentProc:
    """One incarnation of an agent process, and the thread that reads its events."""

    def __init__(self, soak: Soak, index: int, incarnation: int) -> None:
        self.index, self.incarnation = index, incarnation
        self.ready = threading.Event()
        self.bye = threading.Event()
        self.started_at = time.monotonic()
        self.killed = False
        cfg = dict(soak.agent_cfg, index=index, incarnation=incarnation, ip=soak.net.agent_ip[index])
        log = open(soak.workdir / f"agent-{index}.log", "ab")  # noqa: SIM115 - the child owns it
        with log:
            self.proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    soak.net.agent_ns[index],
                    sys.executable,
                    str(AGENT_SCRIPT),
                    json.dumps(cfg),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=soak.env,
                text=True,
                bufsize=1,
            )
        self._reader = threading.Thread(
            target=soak.read_events, args=(self,), name=f"events-a{index}.{incarnation}", daemon=True
        )
        self._reader.start()

    def send(self, command: str) -> None:
        stdin = self.proc.stdin
        assert stdin is not None  # Popen(stdin=PIPE)
        with contextlib.suppress(OSError, ValueError):
            stdin.write(command + "\n")
            stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.killed = True
        kill_process(self.proc)


# The soak.


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.net = Network(args.agents)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvxsoak-{os.getpid()}-"))
        self.env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.agent_cfg = {
            "parent": os.getpid(),
            "agents": args.agents,
            "seed": args.seed,
            "secret": secrets.token_hex(16),
            "metadata": f"{HUB_IP}:{METADATA_PORT}",
            "block_bytes": args.block_kib * 1024,
            "source_blocks": 64,
            "slot_blocks": 16,
            "max_blocks": 16,
            "timeouts": {"connect_s": 3.0, "io_s": 3.0, "transfer_s": 10.0, "close_s": 3.0},
            "lease_ttl_s": 4,
            "metadata_timeout_s": 3.0,
            "margin_s": args.margin_s,
            "pause_s": 0.01,
            "quiesce_s": 0.0,
        }
        self.ledger = Ledger(args, self.agent_cfg)
        self.agent_cfg["quiesce_s"] = self.ledger.connect_bound_s + self.ledger.transfer_bound_s
        self.procs: dict[int, AgentProc] = {}
        self.incarnations = collections.Counter()
        # Agents restarted and not ready since (through kills of their incarnations).
        self.unready_since: dict[int, float] = {}
        self.etcd = Service(
            "etcd",
            [
                shutil.which("etcd") or "/usr/bin/etcd",
                "--name", "soak",
                "--data-dir", str(self.workdir / "etcd-data"),
                "--listen-client-urls", f"http://127.0.0.1:{ETCD_CLIENT}",
                "--advertise-client-urls", f"http://127.0.0.1:{ETCD_CLIENT}",
                "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PEER}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PEER}",
                "--initial-cluster", f"soak=http://127.0.0.1:{ETCD_PEER}",
                "--initial-cluster-state", "new",
            ],
            self.workdir / "etcd.log",
        )  # fmt: skip
        self.metadata = Service(
            "metadata",
            [
                sys.executable, "-m", "kvx", "metadata",
                "--listen", f"{HUB_IP}:{METADATA_PORT}",
                "--store", f"etcd://127.0.0.1:{ETCD_CLIENT}",
                "--etcd-lease-backstop-s", str(ETCD_BACKSTOP_S),
                "--admin-listen", "off",
                "--event-loop", args.event_loop,
            ],
            self.workdir / "metadata.log",
            self.env,
        )  # fmt: skip
        self.actions: list[tuple[float, str, Any]] = []  # (when, what, how): heals and restarts
        self.busy: set[str] = set()
        self.deck: list[str] = []
        self.fault_counts = collections.Counter()
        self.started = time.monotonic()
        self.data_paths: set[str] = set()
        self.events_lock = threading.Lock()

    # Events from the agents.

    def read_events(self, proc: AgentProc) -> None:
        stdout = proc.proc.stdout
        assert stdout is not None  # Popen(stdout=PIPE)
        for line in stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("k") not in ("b", "e", "landed") or ev.get("ok") is False:
                # What went wrong, with times from the start, for --keep-logs.
                with self.events_lock, open(self.workdir / "events.jsonl", "a") as log:
                    rel = relative_times(ev, self.started)
                    log.write(
                        json.dumps(dict(ev, agent=proc.index, incarnation=proc.incarnation, rel=rel)) + "\n"
                    )
            if ev.get("k") == "ready":
                self.data_paths.add(str(ev.get("data_path")))
                proc.ready.set()
            elif ev.get("k") == "bye":
                proc.bye.set()
            self.ledger.on_event(proc, ev)

    # Setup.

    def setup(self) -> None:
        self.net.create()
        self.net.enter_hub()
        self.etcd.start()
        wait_for("etcd", etcd_healthy, self.etcd)
        self.metadata.start()
        wait_for("the metadata service", metadata_serving, self.metadata)
        for i in range(self.args.agents):
            self._start_agent(i)
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc in self.procs.values():
            if not proc.ready.wait(max(0.0, deadline - time.monotonic())):
                raise SoakError(f"agent soak-a{proc.index} did not start:\n{self._agent_log(proc.index)}")
        for proc in self.procs.values():
            proc.send("go")

    def _start_agent(self, index: int) -> None:
        self.incarnations[index] += 1
        self.procs[index] = AgentProc(self, index, self.incarnations[index])

    def _agent_log(self, index: int) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / f"agent-{index}.log").read_text(errors="replace")[-2000:]
        return ""

    # Faults.

    def _fault(self, now: float) -> None:
        if not self.deck:
            self.deck = list(FAULT_KINDS)
            self.rng.shuffle(self.deck)
        kind = self.deck[0]
        if kind in ("metadata", "etcd"):
            if "metadata" in self.busy or "etcd" in self.busy:
                return  # one of the two at a time, so each restart is seen alone
            target = kind
        else:
            free = [i for i in range(self.args.agents) if f"soak-a{i}" not in self.busy]
            if not free:
                return
            target = f"soak-a{self.rng.choice(free)}"
        self.deck.pop(0)
        fault = Fault(kind, target, now)
        rng, index = self.rng, int(target[6:]) if target.startswith("soak-a") else -1
        if kind == "kill":
            self.procs[index].kill()
            duration = rng.uniform(0.5, 3.0)
        elif kind == "stop":
            self.procs[index].proc.send_signal(signal.SIGSTOP)
            self.ledger.stopped[index].append([now, None])
            duration = rng.uniform(0.5, 2 * self.agent_cfg["timeouts"]["io_s"] + 1)
        elif kind == "loss":
            probability = rng.choice((0.02, 0.1, 0.3, 1.0))
            self.net.set_loss(index, probability, True)
            fault.detail = f"p={probability}"
            duration = rng.uniform(2.0, 8.0)
        elif kind == "bandwidth":
            rate = rng.choice(("512kbit", "2mbit", "8mbit"))
            self.net.set_bandwidth(index, rate)
            fault.detail = rate
            duration = rng.uniform(2.0, 8.0)
        else:
            (self.metadata if kind == "metadata" else self.etcd).kill()
            duration = rng.uniform(0.5, 4.0)
        with self.ledger.lock:
            self.ledger.faults.append(fault)
        self.fault_counts[kind] += 1
        self.busy.add(target)
        self.actions.append((now + duration, "heal", fault))

    def _heal(self, fault: Fault, now: float, restart: bool = True) -> None:
        index = int(fault.target[6:]) if fault.target.startswith("soak-a") else -1
        if fault.kind == "kill":
            if restart:
                self.unready_since.setdefault(index, now)
                self._start_agent(index)
                self.actions.append((now + START_TIMEOUT_S, "go", self.procs[index]))
        elif fault.kind == "stop":
            self.procs[index].proc.send_signal(signal.SIGCONT)
            with self.ledger.lock:
                self.ledger.stopped[index][-1][1] = now
        elif fault.kind == "loss":
            self.net.set_loss(index, float(fault.detail[2:]), False)
        elif fault.kind == "bandwidth":
            self.net.set_bandwidth(index, None)
        elif fault.kind == "metadata":
            self.metadata.start()
        else:
            self.etcd.start()
        with self.ledger.lock:
            fault.end = now
        self.busy.discard(fault.target)

    def _due(self, now: float) -> None:
        keep = []
        for when, what, how in self.actions:
            if what == "go" and how.killed:
                continue  # killed again before it was ready: its successor has a "go" of its own
            if what == "go" and how.ready.is_set():
                self.unready_since.pop(how.index, None)
                how.send("go")
            elif what == "go" and now >= when:
                self.unready_since[how.index] = now  # counted: a chain starts again from here
                with self.ledger.lock:
                    self.ledger.crash({"agent": f"soak-a{how.index}", "msg": "did not start again"})
            elif what == "heal" and now >= when:
                self._heal(how, now)
            else:
                keep.append((when, what, how))
        self.actions = keep
        # Kills that each come before the start bound must not hide an agent that never
        # starts: twice the bound through any number of incarnations is a crash too.
        for index, since in list(self.unready_since.items()):
            if now - since > 2 * START_TIMEOUT_S:
                self.unready_since[index] = now
                with self.ledger.lock:
                    self.ledger.crash(
                        {
                            "agent": f"soak-a{index}",
                            "msg": f"not ready for {now - since:.0f} s, through "
                            f"{self.incarnations[index]} incarnations in all",
                        }
                    )

    def _watch_processes(self, now: float) -> None:
        for index, proc in list(self.procs.items()):
            if not proc.killed and not proc.alive():
                with self.ledger.lock:
                    self.ledger.crash(
                        {
                            "agent": f"soak-a{index}",
                            "msg": f"exited with {proc.proc.returncode}",
                            "log": self._agent_log(index),
                        }
                    )
                self.unready_since.setdefault(index, now)
                self._start_agent(index)
                self.actions.append((now + START_TIMEOUT_S, "go", self.procs[index]))
        for service in (self.metadata, self.etcd):
            if service.name not in self.busy and service.proc is not None and service.proc.poll() is not None:
                with self.ledger.lock:
                    self.ledger.crash({"agent": service.name, "msg": "exited", "log": service.tail()})
                service.start()

    # The run.

    def run(self) -> None:
        start = self.started = time.monotonic()
        end = start + self.args.duration_s
        next_fault = start + 2.0
        while (now := time.monotonic()) < end:
            self._due(now)
            if now >= next_fault and len(self.busy) < self.args.max_faults:
                self._fault(now)
                next_fault = now + self.rng.uniform(0.5, 3.0)
            self._watch_processes(now)
            self.ledger.check_outstanding(self.procs, now)
            time.sleep(0.1)
        self.elapsed_s = time.monotonic() - start
        # Heal what is still broken (killed agents stay down), then let every agent finish.
        now = time.monotonic()
        for _, what, how in self.actions:
            if what == "heal":
                self._heal(how, now, restart=False)
        self.actions.clear()
        live = [p for p in self.procs.values() if p.alive() and not p.killed]
        for proc in live:
            proc.send("quiesce" if proc.ready.is_set() else "exit")
        deadline = time.monotonic() + self.agent_cfg["quiesce_s"] + 10.0
        for proc in live:
            if proc.ready.is_set():
                proc.bye.wait(max(0.0, deadline - time.monotonic()))
        self.ledger.check_outstanding(self.procs, time.monotonic(), final=True)
        for proc in live:
            proc.send("exit")
        self.finish_agents(EXIT_BOUND_S)
        for service in (self.metadata, self.etcd):  # restarted by the last heal, or running since
            if service.proc is not None and service.proc.poll() is not None:
                with self.ledger.lock:
                    self.ledger.crash(
                        {"agent": service.name, "msg": "exited at the end", "log": service.tail()}
                    )

    def finish_agents(self, bound_s: float) -> None:
        """The agents' logs are read once they have exited, so that an error while
        closing counts too. An agent not yet ready (still registering: it retries for
        up to a minute after the last heal, and reads "exit" only once ready) never ran
        traffic: it is stopped as a kill stops it. Every other one, including one that
        exited by itself a moment ago, ready or not, is awaited."""
        ending = [p for p in self.procs.values() if not p.killed]
        for proc in ending:
            if not proc.ready.is_set() and proc.alive():
                proc.kill()
        self.await_exit([p for p in ending if not p.killed], bound_s)

    def await_exit(self, procs: list[AgentProc], bound_s: float) -> None:
        """Waits up to ``bound_s`` in all for ``procs`` to exit; one that is still
        running then, or exited with an error, counts as a crash."""
        deadline = time.monotonic() + bound_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(max(0.0, deadline - time.monotonic()))
            code = proc.proc.poll()
            if code != 0:
                msg = f"still running {bound_s:g} s after 'exit'" if code is None else f"exited with {code}"
                with self.ledger.lock:
                    self.ledger.crash(
                        {"agent": f"soak-a{proc.index}", "msg": msg, "log": self._agent_log(proc.index)}
                    )

    def teardown(self) -> list[str]:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                proc.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(max(0.1, deadline - time.monotonic()))
            kill_process(proc.proc)
        self.metadata.kill()
        self.etcd.kill()
        problems = self.net.remove()
        if self.args.keep_logs:
            shutil.copytree(
                self.workdir,
                self.args.keep_logs,
                ignore=shutil.ignore_patterns("etcd-data"),
                dirs_exist_ok=True,
            )
        shutil.rmtree(self.workdir, ignore_errors=True)
        return problems

    def report(self) -> dict:
        led = self.ledger
        try:  # the service runs still (the agents have exited): its log holds every record it wrote
            records, errors = scan_log((self.workdir / "metadata.log").read_text(errors="replace"))
        except OSError:
            records, errors = 0, []
        agent_errors = []  # every incarnation of an agent appends to its log
        for log in sorted(self.workdir.glob("agent-*.log")):
            with contextlib.suppress(OSError):
                agent_errors += [f"{log.stem}: {e}" for e in scan_log(log.read_text(errors="replace"))[1]]
        return {
            "duration_s": round(getattr(self, "elapsed_s", 0.0), 1),
            "seed": self.args.seed,
            "event_loop": self.args.event_loop,
            "agents": self.args.agents,
            "data_path": "/".join(sorted(self.data_paths)) or "none",
            "faults": dict(self.fault_counts),
            "transfers_done": sum(led.done.values()),
            "reads_done": led.done["read"],
            "writes_done": led.done["write"],
            "bytes": led.bytes,
            "landed_blocks_verified": led.landed["ok"],
            "landed_blocks_superseded": led.landed["superseded"],
            "skipped": led.skipped,
            "errors": dict(led.errors.most_common()),
            "not_kvx_errors": led.foreign,
            "corrupted_blocks": led.corrupt_count,
            "late_writes": led.late_count,
            "late_write_examples": led.late,
            "late_writes_allowed": self.args.allow_late_writes,
            "corruptions": led.corrupt,
            "hangs": len(led.hangs),
            "hang_details": led.hangs[:20],
            "crashes": led.crash_count,
            "crash_details": led.crashes,
            "pending_after_wait": led.pending_after_wait,
            "cut_by_kill": led.cut_by_kill,
            "agent_start_retries": led.start_retries,
            "longest_fault_to_error": max(led.fault_to_error.values(), key=lambda v: v["s"], default=None),
            "longest_fault_to_error_by_kind": dict(sorted(led.fault_to_error.items())),
            "longest_transfer_wait": led.longest_wait,
            "longest_connect": led.longest_connect,
            "unattributed_errors": led.unattributed_count,
            "unattributed_examples": led.unattributed,
            "service_log_records": records,
            "service_log_errors": len(errors),
            "service_log_error_examples": errors[:5],
            "agent_log_errors": len(agent_errors),
            "agent_log_error_examples": agent_errors[:5],
            "bounds_s": {"connect": led.connect_bound_s, "transfer": led.transfer_bound_s},
            "fault_timeline": [
                {
                    "kind": f.kind,
                    "target": f.target,
                    "detail": f.detail,
                    "at_s": round(f.start - self.started, 2),
                    "for_s": None if f.end is None else round(f.end - f.start, 2),
                }
                for f in led.faults
            ],
        }


def verdict(report: dict) -> list[str]:
    """What makes the soak fail; empty when it passes."""
    failures = []
    if report["corrupted_blocks"]:
        failures.append(f"{report['corrupted_blocks']} corrupted block(s)")
    if report["late_writes"] and not report["late_writes_allowed"]:
        failures.append(
            f"{report['late_writes']} block(s) overwritten by an older WRITE that had failed for its writer"
        )
    if report["hangs"]:
        failures.append(f"{report['hangs']} hung transfer(s)")
    if report["not_kvx_errors"]:
        failures.append(
            f"{sum(v for k, v in report['errors'].items() if k.startswith('not a kvx'))} non-kvx error(s)"
        )
    if report["crashes"]:
        failures.append(f"{report['crashes']} crash(es) of an agent or service")
    if report["service_log_errors"]:
        failures.append(f"{report['service_log_errors']} error(s) in the metadata service's log")
    if report["agent_log_errors"]:
        failures.append(f"{report['agent_log_errors']} error(s) in the agents' logs")
    if not report["service_log_records"]:
        failures.append("no record read in the metadata service's log (has its format changed?)")
    if not report["transfers_done"]:
        failures.append("no transfer completed")
    return failures


_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ")  # kvx's log format
_CORE_ERROR = re.compile(r"[EF]\d{4} \d\d:\d\d:\d\d")  # gRPC's C core, to stderr
_UNLOGGED = ("Traceback (most recent call last):", "Exception ignored in", "Exception in thread")


def scan_log(text: str) -> tuple[int, list[str]]:
    """The records of a kvx process's log (its stderr too), and its errors: each
    ERROR or CRITICAL record, a traceback or an "Exception ignored" that Python
    printed outside any record, and an error line of gRPC's C core; each with
    the line after it. A service or an agent under faults logs what they do to
    it at INFO and WARNING: an error is a bug (an unexpected exception, an
    asyncio task lost, a thread that died) that the transfers' checks may never
    see."""
    lines = text.splitlines()
    records, errors = 0, []
    in_error = False  # within an error's lines (a record's traceback)
    for i, line in enumerate(lines):
        if (record := _RECORD.match(line)) is not None:
            records += 1
            in_error = record.group(1) in ("ERROR", "CRITICAL")
        elif _CORE_ERROR.match(line):
            in_error = True
        elif in_error or not line.startswith(_UNLOGGED):
            continue
        else:
            in_error = True
        if in_error:
            errors.append("\n".join(lines[i : i + 2]))
    return records, errors


def render(report: dict, failures: list[str]) -> str:
    gib = report["bytes"] / (1 << 30)
    lines = [
        f"kvx soak: {report['duration_s']} s, seed {report['seed']}, {report['agents']} agents "
        f"(tcp, {report['data_path']} data path), metadata service on etcd "
        f"({report['event_loop']} event loop)",
        f"faults: {sum(report['faults'].values())} ("
        + ", ".join(f"{k} {report['faults'].get(k, 0)}" for k in FAULT_KINDS)
        + ")",
        f"transfers done: {report['transfers_done']} (reads {report['reads_done']}, writes "
        f"{report['writes_done']}), {gib:.2f} GiB; blocks verified on WRITE targets: "
        f"{report['landed_blocks_verified']} (superseded before the check: {report['landed_blocks_superseded']})",
        "errors: "
        + (", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none")
        + f" (unattributed to a fault: {report['unattributed_errors']})",
        f"corrupted blocks: {report['corrupted_blocks']}",
        f"late writes (a failed WRITE landed over a later one): {report['late_writes']}"
        + (" (allowed: --allow-late-writes)" if report["late_writes_allowed"] else ""),
        f"hangs: {report['hangs']} (bounds: connect {report['bounds_s']['connect']:.0f} s, "
        f"transfer {report['bounds_s']['transfer']:.0f} s)",
        f"errors in the metadata service's log: {report['service_log_errors']} "
        f"(of {report['service_log_records']} records); in the agents' logs: {report['agent_log_errors']}",
    ]
    fte = report["longest_fault_to_error"]
    if fte:
        lines.append(f"longest fault to error: {fte['s']:.2f} s ({fte['fault']} -> {fte['error']})")
        lines.append(
            "  by fault: "
            + ", ".join(f"{k} {v['s']:.2f} s" for k, v in report["longest_fault_to_error_by_kind"].items())
        )
    wait = report["longest_transfer_wait"]
    if wait:
        lines.append(
            f"longest transfer wait: {wait['wall_s']:.2f} s ({wait['op']} {wait['agent']} -> {wait['peer']}, "
            f"{wait['outcome']}; {wait['excluding_own_stop_s']:.2f} s without the initiator's own SIGSTOP)"
        )
    connect = report["longest_connect"]
    if connect:
        lines.append(f"longest connect (metadata lookup and handshake): {connect['wall_s']:.2f} s")
    for item in (
        report["corruptions"][:5]
        + report["late_write_examples"][:3]
        + report["hang_details"][:5]
        + report["not_kvx_errors"][:5]
    ):
        lines.append(f"  {item}")
    for crash in report["crash_details"][:5]:
        lines.append(f"  crash: {crash}")
    for record in report["service_log_error_examples"][:3]:
        lines.append("  metadata service: " + record.replace("\n", "\n    "))
    for record in report["agent_log_error_examples"][:3]:
        lines.append("  " + record.replace("\n", "\n    "))
    lines.append("verdict: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration-s", type=float, default=60.0, help="how long faults and traffic run (default: 60)"
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the fault schedule and the traffic (default: 1)"
    )
    parser.add_argument("--agents", type=int, default=4, help="agent processes, 2 to 200 (default: 4)")
    parser.add_argument("--block-kib", type=int, default=16, help="block size in KiB (default: 16)")
    parser.add_argument("--max-faults", type=int, default=2, help="faults active at once (default: 2)")
    parser.add_argument(
        "--margin-s",
        type=float,
        default=10.0,
        help="a transfer unfinished this long past its timeout is a hang (default: 10)",
    )
    parser.add_argument(
        "--allow-late-writes",
        action="store_true",
        help="do not fail when a WRITE that failed for its writer lands later (a known kvx issue; "
        "see docs/soak.md); they are counted either way",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the metadata service's event loop (kvx metadata --event-loop; default: asyncio)",
    )
    parser.add_argument("--json-out", help="write the report to this file as JSON")
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="copy the agents', etcd's and the service's logs here"
    )
    args = parser.parse_args(argv)
    if not 2 <= args.agents <= 200:
        parser.error("--agents must be between 2 and 200")
    if args.duration_s <= 0 or args.margin_s <= 0 or args.block_kib < 1 or args.max_faults < 1:
        parser.error("--duration-s, --margin-s, --block-kib and --max-faults must be positive")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_tools()
    except SoakError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a background job ignores it
        signal.signal(signum, _interrupt)
    remove_stale()
    soak = Soak(args)
    status = 2
    try:
        soak.setup()
        soak.run()
        report = soak.report()
        failures = verdict(report)
        print(render(report, failures), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(dict(report, failures=failures), indent=2))
        status = 1 if failures else 0
    except SoakError as exc:
        print(f"soak: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("soak: interrupted; cleaning up", file=sys.stderr)
        status = 130
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            for signum in (
                signal.SIGINT,
                signal.SIGTERM,
                signal.SIGHUP,
            ):  # a second one must not skip the clean-up
                signal.signal(signum, signal.SIG_IGN)
            for problem in soak.teardown():
                print(f"soak: clean-up: {problem}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
