"""Children that die with their parent, started with no Python in the fork."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvx._spawn import PARENT_GONE, dying_with_parent, launched
from tests.conftest import native_pass_only

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's"),
    native_pass_only,
]


def test_children_start_beside_a_live_grpc_channel(tmp_path: Path) -> None:
    """The daemon holds a metadata channel when it starts its engine. Started
    with preexec_fn, about one child in 15 aborted before exec: gRPC restarted
    its poller in the forked child, which then closed the poller's epoll
    descriptor (grpc/grpc#43055). Every child must now run."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys
            from concurrent import futures
            import grpc
            from kvx._spawn import PARENT_GONE, dying_with_parent, launched

            server = grpc.server(futures.ThreadPoolExecutor(2))
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(channel).result(timeout=10)
            codes = []
            for _ in range(int(sys.argv[1])):
                child = subprocess.Popen(
                    dying_with_parent(["true"]),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                child.stdout.read()
                codes.append(child.wait())
            print(" ".join(map(str, codes)))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), "120"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    codes = out.stdout.split()
    assert len(codes) == 120
    assert set(codes) == {"0"}, f"children failed: {sorted(set(codes))}"


def test_the_child_dies_with_a_parent_killed_outright(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; from kvx._spawn import PARENT_GONE, dying_with_parent, launched\n"
            "c = subprocess.Popen(dying_with_parent(['sh', '-c', 'echo $$ > ' + sys.argv[1] + '; exec sleep 600']))\n"
            "c.wait()\n",
            str(pidfile),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline and parent.poll() is None, "the child did not start"
            time.sleep(0.02)
        child = int(pidfile.read_text())
        os.kill(child, 0)  # running
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # a zombie of an orphan is reaped by init; until then it is as good as gone
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_child_whose_parent_is_already_gone_does_not_run(tmp_path: Path) -> None:
    """The launcher checks its parent after prctl: a parent that died before
    prctl would never send the signal, and the command would run orphaned."""
    marker = tmp_path / "ran"
    argv = dying_with_parent(["touch", str(marker)])
    at = next(i for i, a in enumerate(argv) if a.startswith("{"))
    what = json.loads(argv[at])
    assert what["parent"] == os.getpid()
    argv[at] = json.dumps({**what, "parent": 1})  # as if ours had died and init adopted us
    assert subprocess.run(argv, timeout=30).returncode == PARENT_GONE
    assert not marker.exists()
    argv[at] = json.dumps(what)
    assert subprocess.run(argv, timeout=30).returncode == 0
    assert marker.exists()


def test_the_launcher_pins_cpus() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    out = subprocess.run(
        launched([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], cpus=[cpu]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip() == f"[{cpu}]"


def test_a_missing_program_fails_in_the_parent() -> None:
    with pytest.raises(FileNotFoundError):
        dying_with_parent(["kvx-no-such-program-here"])
    with pytest.raises(FileNotFoundError):
        dying_with_parent(["python3"], env={"PATH": "/nonexistent"})
    with pytest.raises(ValueError):
        dying_with_parent([])


def test_the_command_gets_its_arguments_and_signals_as_given(tmp_path: Path) -> None:
    out = subprocess.run(
        dying_with_parent([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "", "--x=1"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip() == "['a b', '', '--x=1']"
    child = subprocess.Popen(
        dying_with_parent(["sh", "-c", "echo running; exec sleep 600"]), stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    assert child.stdout.readline() == b"running\n"  # the launcher has exec'd
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM


def test_the_command_gets_the_signal_dispositions_popen_gives() -> None:
    """Python ignores SIGPIPE and SIGXFSZ at start-up, and ignored signals
    stay ignored across exec: the launcher must restore them, or `yes | head`
    in the engine's shell would complain of a broken pipe."""
    probe = ["grep", "^SigIgn", "/proc/self/status"]
    direct = subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout
    launched_ = subprocess.run(dying_with_parent(probe), capture_output=True, text=True, timeout=30).stdout
    assert direct.startswith("SigIgn:")
    assert launched_ == direct


def test_a_relative_program_runs_from_the_cwd_popen_is_given(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    tool = tmp_path / "sub" / "tool"
    tool.write_text('#!/bin/sh\necho sub-tool "$0"\n')
    tool.chmod(0o755)
    out = subprocess.run(
        dying_with_parent(["./tool"]), cwd=tmp_path / "sub", capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip() == "sub-tool ./tool"


def test_no_python_runs_between_fork_and_exec() -> None:
    """Any preexec_fn brings the abort above back in a process that holds
    gRPC: kvx's daemon and demo, and the test runner itself once a test has
    opened a channel. kvx, its benchmarks and its tests use the launcher. (A fork
    server is allowed: it is started by exec, and never opens a channel itself.)"""
    root = Path(__file__).parents[2]
    hazard = re.compile(r"preexec_fn\s*=|os\.fork\(|get_context\(\s*[\"']fork[\"']")
    users = [
        str(p.relative_to(root))
        for folder in ("kvx", "benchmarks", "tests")
        for p in (root / folder).rglob("*.py")
        # Virtual environments (benchmarks/peers' own) hold other projects' code.
        if p != Path(__file__)
        and not any(part.startswith(".venv") for part in p.relative_to(root).parts)
        and hazard.search(p.read_text(errors="replace"))
    ]
    assert users == []
