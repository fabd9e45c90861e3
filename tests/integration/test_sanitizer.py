"""The C data path under AddressSanitizer: the byte-path and transfer tests
run against a KVX_ASAN=1 build of kvx._native in a copy of the package."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NATIVE

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    NATIVE == "0",
    reason="builds and runs the C data path whatever KVX_NATIVE says: runs once, in the KVX_NATIVE=1 pass",
)


@pytest.mark.slow
def test_native_data_path_under_asan(tmp_path):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build the sanitizer variant (present on every CI machine)")
    libasan = subprocess.run(
        [gcc, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("gcc has no libasan (Debian: libasan8, pulled in by gcc)")
    build = tmp_path / "build"
    env = {**os.environ, "KVX_ASAN": "1", "KVX_NATIVE": "1"}
    subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(build / "lib"),
            "--build-temp",
            str(build / "tmp"),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    site = tmp_path / "site"
    shutil.copytree(ROOT / "kvx", site / "kvx", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    built = sorted((build / "lib" / "kvx" / "_datapath").glob("_*.so"))
    assert {so.name.split(".")[0] for so in built} == {"_native", "_cma", "_cuda"}
    for so in built:
        shutil.copy(so, site / "kvx" / "_datapath" / so.name)
    env.update(
        PYTHONPATH=f"{site}{os.pathsep}{ROOT}",
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
    )
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kvx, kvx._datapath._native as n, kvx._datapath._cma; print(n.__file__)",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.stdout.strip().startswith(str(site)), check.stderr
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT),
            str(ROOT / "tests/unit/test_io.py"),
            str(ROOT / "tests/unit/test_cma.py"),
            str(ROOT / "tests/unit/test_leased_triples.py"),
            str(ROOT / "tests/unit/test_conn_leased_post.py"),
            str(ROOT / "tests/unit/test_post_check.py"),
            str(ROOT / "tests/integration/test_transfer.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0 and "AddressSanitizer" not in result.stderr, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
