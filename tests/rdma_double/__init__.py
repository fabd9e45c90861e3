"""The libibverbs double (fake_ibverbs.c) and how the tests build and load it.

kvx._verbs opens one libibverbs per process, for good: once any test made it
open the system's (an agent under ``backend="auto"`` asks it for devices),
the double cannot be loaded in that process any more. :func:`load` says so,
and :func:`run_apart` runs a test module in a fresh process instead.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fake_ibverbs.c")
HEADER = Path("/usr/include/infiniband/verbs.h")
# Set in the process run_apart starts: it must load the double itself or fail.
APART_ENV = "KVX_TEST_VERBS_APART"

_built: Path | str | None = None  # one build per process: kvx._verbs keeps the first path it loads


def build(directory: Path) -> Path | str:
    """Compile the double into ``directory``; returns its path, or why it cannot be built."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return "gcc is not installed (the libibverbs double is compiled by the tests)"
    if not HEADER.exists():
        return "rdma-core's headers are missing (Debian: apt-get install libibverbs-dev)"
    target = directory / "libfake_ibverbs.so"
    result = subprocess.run(
        [gcc, "-O1", "-g", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", str(target), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        return f"the libibverbs double did not compile: {result.stderr[-2000:]}"
    return target


class Unavailable(Exception):
    """The double cannot be used in this process; ``args[0]`` says why,
    ``loaded_other`` whether another libibverbs is in the way."""

    def __init__(self, why: str, loaded_other: bool = False) -> None:
        super().__init__(why)
        self.loaded_other = loaded_other


def built_path() -> Path:
    """The double's path, once load() built it."""
    assert isinstance(_built, Path), "rdma_double.load() first"
    return _built


def use_double(monkeypatch: Any, path: Path) -> None:
    """For one test: agents (and their workers) load the double, and kvx._verbs's
    libcuda calls go to it."""
    monkeypatch.setenv("KVX_IBVERBS_LIB", str(path))
    monkeypatch.setenv("KVX_CUDA_LIB", str(path))


def load() -> tuple[Any, ctypes.CDLL, Path]:
    """Build the double once per process and make kvx._verbs (and its libcuda
    calls) use it: (kvx._verbs, the double as a CDLL, its path)."""
    global _built
    try:
        import kvx._verbs as verbs
    except ImportError:
        raise Unavailable("kvx was built without rdma-core's headers") from None
    if _built is None:
        _built = build(Path(tempfile.mkdtemp(prefix="kvx-verbs-double-")))
    if isinstance(_built, str):
        raise Unavailable(_built)
    # Not put in os.environ for good: later tests (and their subprocesses) would load the
    # double too. A test that needs them sets KVX_IBVERBS_LIB/KVX_CUDA_LIB (use_double).
    try:
        verbs.load(str(_built))
    except verbs.Error as error:
        raise Unavailable(f"another libibverbs is loaded in this process: {error.args[1]}", True) from None
    lib = ctypes.CDLL(str(_built))
    lib.fake_check_transition.restype = ctypes.c_char_p
    return verbs, lib, _built


def run_apart(path: str, timeout_s: float = 300) -> dict[str, tuple[str, str]]:
    """Run the test module ``path`` in a fresh Python process (where the
    double loads first); per test name, (outcome, message) with outcome
    "passed", "failed" or "skipped"."""
    with tempfile.TemporaryDirectory(prefix="kvx-verbs-apart-") as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, APART_ENV: "1"}
        env.pop("KVX_IBVERBS_LIB", None)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
        if not report.exists():
            return {
                "": (
                    "failed",
                    f"the test process wrote no report: {proc.stdout[-3000:]}{proc.stderr[-2000:]}",
                )
            }
        out = {}
        for case in ET.parse(report).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
                elif child.tag == "skipped":
                    outcome, message = "skipped", child.get("message", "")
            out[case.get("name", "")] = (outcome, message)
        return out
