"""The chaos soak's bookkeeping of agent events (benchmarks/soak.py,
soak_ledger.py): an operation that fails with an error that is not a kvx
error carries its traceback in ``trace`` and its begin time in ``tb``, and
both reach the report; a field that is not a time never ends the thread that
reads an agent's events (it did: a traceback in ``tb`` stopped it, and every
later event of that agent was lost)."""

import argparse
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402
from soak_ledger import Ledger  # noqa: E402

CFG = {
    "timeouts": {"connect_s": 3.0, "io_s": 3.0, "transfer_s": 10.0, "close_s": 3.0},
    "metadata_timeout_s": 3.0,
}


def test_a_foreign_error_is_counted_with_its_trace_and_times():
    ledger = Ledger(argparse.Namespace(margin_s=10.0), CFG)
    proc = SimpleNamespace(index=1, incarnation=2)
    ledger.on_event(proc, {"k": "b", "i": 7, "t": 100.0})
    end = {"k": "e", "i": 7, "op": "read", "peer": "soak-a0", "tb": 100.0, "tp": 100.5, "te": 101.0}
    end |= {
        "ok": False,
        "cls": "ValueError",
        "msg": "boom",
        "kvx_error": False,
        "trace": "Traceback (most...",
    }
    ledger.on_event(proc, end)
    assert ledger.errors == {"not a kvx error: ValueError": 1}
    assert ledger.foreign == [
        {"op": "read", "peer": "soak-a0", "cls": "ValueError", "msg": "boom", "trace": "Traceback (most...",
         "agent": "soak-a1"}
    ]  # fmt: skip
    assert ledger.outstanding == {} and ledger.longest_wait["wall_s"] == 0.5


def test_relative_times_keep_only_numbers():
    crash = {"k": "crash", "where": "start", "msg": "x", "trace": "Traceback", "tb": "not a time", "t": 12.5}
    assert soak.relative_times(crash, 10.0) == {"t": 2.5}
    ended = {"k": "e", "tb": 11.0, "tp": None, "te": 13.25, "ok": False}
    assert soak.relative_times(ended, 10.0) == {"tb": 1.0, "te": 3.25}


def _incarnation(index: int, ready: bool, killed: bool):
    sent: list[str] = []
    ready_event = SimpleNamespace(is_set=lambda: ready)
    return SimpleNamespace(index=index, ready=ready_event, killed=killed, send=sent.append, sent=sent)


def _harness(actions, unready_since=None):
    harness = soak.Soak.__new__(soak.Soak)
    harness.ledger = Ledger(argparse.Namespace(margin_s=10.0), CFG)
    harness.actions = actions
    harness.unready_since = dict(unready_since or {})
    harness.incarnations = {0: 1, 1: 1, 2: 1, 3: 5}
    return harness


def test_an_incarnation_killed_before_it_was_ready_is_not_a_crash():
    """A kill may hit an agent that is still starting: that incarnation never becomes
    ready, and its "go" (due when its start bound runs out) is not its failure to
    start. Its successor's is, if it comes to that."""
    killed = _incarnation(3, ready=False, killed=True)
    late = _incarnation(2, ready=False, killed=False)
    started = _incarnation(1, ready=True, killed=False)
    waiting = _incarnation(0, ready=False, killed=False)
    harness = _harness(
        [(100.0, "go", killed), (100.0, "go", late), (100.0, "go", started), (500.0, "go", waiting)],
        {1: 50.0, 2: 10.0, 3: 150.0},
    )
    harness._due(200.0)
    assert [crash["agent"] for crash in harness.ledger.crashes] == ["soak-a2"]
    assert started.sent == ["go"] and killed.sent == [] == late.sent
    assert harness.actions == [(500.0, "go", waiting)]
    # Agent 1 is ready; agent 2 was counted now (its chain starts again); agent 3 starts on.
    assert harness.unready_since == {2: 200.0, 3: 150.0}


def test_an_agent_kept_from_starting_by_kills_is_a_crash_past_twice_the_bound():
    bound = soak.START_TIMEOUT_S
    harness = _harness([], {3: 1000.0})
    harness._due(1000.0 + 2 * bound - 1)
    assert harness.ledger.crashes == []
    harness._due(1000.0 + 2 * bound + 1)
    assert [crash["agent"] for crash in harness.ledger.crashes] == ["soak-a3"]
    assert "through 5 incarnations" in harness.ledger.crashes[0]["msg"]
    harness._due(1000.0 + 2 * bound + 2)
    assert len(harness.ledger.crashes) == 1  # once, not at every tick


def test_the_service_logs_errors_fail_the_soak(tmp_path):
    """An error in the metadata service's log fails the soak, read while the service
    runs (report() comes before the teardown): an ERROR or CRITICAL record (an
    asyncio task destroyed while pending, as every etcd outage caused before),
    a traceback Python printed outside any record, a gRPC C-core error line; each
    with the line after it. INFO and WARNING records, a message that merely says
    ERROR, and the traceback of an ERROR record already counted do not count again."""
    log = [
        "2026-11-29 12:55:09,592 INFO kvx.metadata.etcd: etcd read mirror stopped (ERROR here is text)",
        "2026-11-29 12:55:09,700 WARNING kvx.metadata.store: the metadata service stalled for 0.6 s",
        "2026-11-29 12:55:09,795 ERROR asyncio: Task was destroyed but it is pending!",
        "task: <Task pending name='Task-206' coro=<_StreamRequestMixin._consume_request_iterator()>>",
        "2026-11-29 12:55:09,800 ERROR kvx.metadata.etcd: etcd read mirror failed; loading it again",
        "Traceback (most recent call last):",
        '  File "etcd.py", line 1, in _mirror_loop',
        "2026-11-29 12:55:10,001 CRITICAL kvx.metadata.service: something worse",
        "2026-11-29 12:55:10,002 INFO kvx.metadata.etcd: etcd read mirror synced: 3 records",
        "Exception ignored in: <function Call.__del__ at 0x7f>",
        "RuntimeError: Event loop is closed",
        "E1129 12:55:11.000000  4242 chttp2_transport.cc:1] a C-core error",
    ]
    records, errors = soak.scan_log("\n".join(log))
    assert records == 6
    assert errors == [
        "\n".join(log[2:4]),
        "\n".join(log[4:6]),
        log[7] + "\n" + log[8],
        "\n".join(log[9:11]),
        log[11],
    ]
    assert soak.scan_log("\n".join(log[:2] + log[8:9])) == (3, [])

    # The report of a soak reads the log as it is then.
    run = soak.Soak(soak.parse_args([]))
    try:
        (run.workdir / "metadata.log").write_text("\n".join(log[:4]) + "\n")
        # An agent's log: a thread that died, and a record the agent logged at ERROR.
        (run.workdir / "agent-1.log").write_text(
            "\n".join(
                [
                    "2026-11-29 12:55:09,000 WARNING kvx.metadata.client: watch ended; reconnecting",
                    "Exception in thread kvx-reader:",
                    "Traceback (most recent call last):",
                    "2026-11-29 12:55:09,500 ERROR kvx.metadata.client: lease renewal failed; trying again",
                    "Traceback (most recent call last):",
                ]
            )
        )
        (run.workdir / "agent-0.log").write_text(log[1] + "\n")
        report = run.report()
        assert (report["service_log_records"], report["service_log_errors"]) == (3, 1)
        assert report["service_log_error_examples"] == ["\n".join(log[2:4])]
        assert report["agent_log_errors"] == 2
        assert report["agent_log_error_examples"] == [
            "agent-1: Exception in thread kvx-reader:\nTraceback (most recent call last):",
            "agent-1: 2026-11-29 12:55:09,500 ERROR kvx.metadata.client: lease renewal failed; trying again\n"
            "Traceback (most recent call last):",
        ]
        clean = report | {"transfers_done": 10, "service_log_errors": 0, "agent_log_errors": 0}
        assert soak.verdict(clean) == []
        assert soak.verdict(clean | {"service_log_errors": 1}) == ["1 error(s) in the metadata service's log"]
        assert soak.verdict(report | {"transfers_done": 10}) == [
            "1 error(s) in the metadata service's log",
            "2 error(s) in the agents' logs",
        ]
        assert soak.verdict(clean | {"service_log_records": 0}) == [
            "no record read in the metadata service's log (has its format changed?)"
        ]
    finally:
        shutil.rmtree(run.workdir)


def test_the_logs_format_is_the_one_the_soak_reads():
    """The service and the agents log through kvx's format (kvx.cli.LOG_FORMAT): a
    change to it that the soak could no longer read would pass every soak silently,
    so each level's record, formatted as a kvx process writes it, is read here."""
    import logging

    from kvx.cli import LOG_FORMAT

    fmt = logging.Formatter(LOG_FORMAT)
    lines = [
        fmt.format(logging.LogRecord("kvx.metadata.etcd", level, __file__, 1, "the message", None, None))
        for level in (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
    ]
    records, errors = soak.scan_log("\n".join(lines))
    assert records == 4
    assert errors == [lines[2] + "\n" + lines[3], lines[3]]  # each error with the line after it


def test_an_agent_that_does_not_exit_at_the_end_has_crashed():
    """At the end of a soak the agents are told to exit and their logs are read
    after that: one still running past the bound, or exiting with an error, is a
    crash; one that exits cleanly is not."""
    import subprocess

    run = soak.Soak(soak.parse_args([]))
    procs = [
        SimpleNamespace(index=i, proc=subprocess.Popen([sys.executable, "-c", code]))
        for i, code in enumerate(("pass", "raise SystemExit(3)", "import time; time.sleep(60)"))
    ]
    try:
        run.await_exit(procs, bound_s=4.0)
        assert run.ledger.crash_count == 2
        assert [(c["agent"], c["msg"]) for c in run.ledger.crashes] == [
            ("soak-a1", "exited with 3"),
            ("soak-a2", "still running 4 s after 'exit'"),
        ]
    finally:
        procs[2].proc.kill()
        procs[2].proc.wait()
        shutil.rmtree(run.workdir)


def test_at_the_end_agents_still_starting_are_stopped_and_the_others_awaited():
    """The end of a soak: an agent still starting (registering) is stopped as a kill
    stops it and is not a crash; one that already died before it was ready is; a
    ready one is awaited; one killed earlier is left alone."""
    import subprocess

    run = soak.Soak(soak.parse_args([]))

    def agent(index: int, ready: bool, code: str, killed: bool = False):
        proc = SimpleNamespace(
            index=index,
            ready=SimpleNamespace(is_set=lambda: ready),
            killed=killed,
            proc=subprocess.Popen([sys.executable, "-c", code]),
        )
        proc.alive = lambda: proc.proc.poll() is None

        def kill():
            proc.killed = True
            proc.proc.kill()
            proc.proc.wait()

        proc.kill = kill
        return proc

    sleeper = "import time; time.sleep(60)"
    starting = agent(0, ready=False, code=sleeper)
    died_starting = agent(1, ready=False, code="raise SystemExit(5)")
    ready = agent(2, ready=True, code="pass")
    killed = agent(3, ready=True, code=sleeper, killed=True)
    run.procs = {p.index: p for p in (starting, died_starting, ready, killed)}
    try:
        died_starting.proc.wait(30)
        run.finish_agents(bound_s=10.0)
        assert starting.killed and starting.proc.returncode is not None
        assert [(c["agent"], c["msg"]) for c in run.ledger.crashes] == [("soak-a1", "exited with 5")]
        assert ready.proc.returncode == 0 and killed.proc.poll() is None
    finally:
        for p in run.procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        shutil.rmtree(run.workdir)
