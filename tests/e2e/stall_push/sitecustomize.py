"""Loaded at start-up by the prefill engine of ``test_vllm_push.py`` (its
``PYTHONPATH`` names this folder, and its processes inherit it): a push whose
id starts with ``$E2E_STALL_PUSH_PREFIX`` stops mid-push, at a known point.

Once ``kvx.connectors.vllm.push`` is imported, ``PushWorker._write`` is
wrapped: the first WRITE of such a push is posted, and once it has landed in
decode's blocks (its completion came back), a line saying so goes to stderr
(the engine's log) and every thread that would post another WRITE of that
push waits for good. The test stops and kills the engine once it reads that
line, so the kill lands mid-push however the host schedules the processes,
rather than racing prefill's chunks with a watch of its log.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
from typing import Any

_TARGET = "kvx.connectors.vllm.push"
_PREFIX = os.environ.get("E2E_STALL_PUSH_PREFIX", "")
_LANDED_WAIT_S = 20.0  # within the test's 30 s wait for the line


def _stall(worker_class: Any) -> None:
    write, written = worker_class._write, worker_class._written
    first_landed = threading.Event()
    errors: list[Any] = []
    claimed = threading.Lock()

    def _written(self: Any, s: Any, error: Any, t: Any = None, count: int = 0) -> None:
        written(self, s, error, t, count)
        # t is None when _write posted nothing (no block of decode's to write): not a landing.
        if s.push_id.startswith(_PREFIX) and (t is not None or error is not None):
            errors.append(error)
            first_landed.set()

    def _write(self: Any, s: Any, layer: int, touched: list[int]) -> None:
        if not s.push_id.startswith(_PREFIX):
            write(self, s, layer, touched)
            return
        if claimed.acquire(blocking=False):  # the first WRITE of the push goes out
            write(self, s, layer, touched)
            answered = first_landed.wait(_LANDED_WAIT_S)
            how = (
                "not answered" if not answered else "landed" if errors[0] is None else f"failed: {errors[0]}"
            )
            print(
                f"e2e: push {s.push_id} stalled after its first WRITE ({how})",
                file=sys.stderr,
                flush=True,
            )
        threading.Event().wait()  # no other WRITE of it: the test kills this process

    worker_class._write, worker_class._written = _write, _written


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module: Any) -> None:
            exec_module(module)
            _stall(module.PushWorker)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


if _PREFIX:
    sys.meta_path.insert(0, _PatchOnImport())
