"""Workers started from the fork server (kvx._worker.use_forkserver, which the
suite uses): each has the environment of its own start, and none outlives the
process that started it, even while another process holds its pipe open."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import native_pass_only, wait_until
from tests.unit.test_spawn import _alive

pytestmark = native_pass_only


def test_a_worker_has_the_environment_its_parent_has_when_it_starts(make_worker, monkeypatch) -> None:
    make_worker("first")  # the fork server runs from here on, with the environment it had
    monkeypatch.setenv("KVX_WORKER_START_MARK", "set after the server started")
    assert make_worker("second").call("getenv", "KVX_WORKER_START_MARK") == "set after the server started"
    # HOME was set when the server started, whenever that was: a worker must not keep it.
    assert os.environ.get("HOME")
    monkeypatch.delenv("HOME")
    assert make_worker("third").call("getenv", "HOME") is None


def test_a_forked_worker_dies_with_a_parent_killed_outright(tmp_path: Path) -> None:
    pidfile = tmp_path / "worker.pid"
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from kvx._worker import Worker, WorkerConfig, use_forkserver
        if __name__ == "__main__":
            use_forkserver()
            worker = Worker(WorkerConfig("orphan", 4096))
            # A child that outlives this process holds the pipe to the worker open, so the
            # worker must notice the death by its parent (the fork server) going away.
            holder = subprocess.Popen(["sleep", "600"], pass_fds=[worker._conn.fileno()])
            open(sys.argv[1], "w").write(f"{worker.pid} {holder.pid}")
            time.sleep(600)
        """
    )
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py"), str(pidfile)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        started = wait_until(lambda: len(pidfile.read_text().split()) == 2, 60, (FileNotFoundError,))
        assert started and parent.poll() is None, "the worker did not start"
        worker = int(pidfile.read_text().split()[0])
        assert _alive(worker)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not _alive(worker), 15), "the worker outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if pidfile.exists() and len(pidfile.read_text().split()) == 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text().split()[1]), signal.SIGKILL)
