"""The libibverbs double (fake_ibverbs.c) and how the tests build it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_ibverbs.c")
HEADER = Path("/usr/include/infiniband/verbs.h")


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
