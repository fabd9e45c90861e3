"""kvx._datapath._cuda (csrc/kvx_cuda.c), the copy kernel's launch and wait
through the CUDA driver, against a stand-in libcuda.so.1
(tests/unit/cuda_cpu/fake_libcuda.c) in a process of its own, so that no
other test, and no real CuPy there, ever binds to the stand-in. tests/gpu
runs the same calls on a GPU, where they are the default.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvx._datapath import gpu
from kvx.errors import ConfigError
from tests.conftest import native_pass_only

pytestmark = native_pass_only

ROOT = Path(__file__).parents[2]
FAKE = Path(__file__).with_name("cuda_cpu") / "fake_libcuda.c"


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        from kvx._datapath import _cuda  # noqa: F401
    except ImportError:
        if os.environ.get("KVX_NATIVE") == "1":
            raise
        pytest.skip("kvx._datapath._cuda is not built (python setup.py build_ext --inplace)")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (the stand-in libcuda is compiled by the test)")
    directory = tmp_path_factory.mktemp("libcuda")
    subprocess.run(
        [gcc, "-O1", "-Wall", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
         str(directory / "libcuda.so.1"), str(FAKE)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return directory


def run(fake_dir: Path, body: str, **env: str) -> dict:
    """Run ``body`` in a fresh interpreter whose libcuda.so.1 is the stand-in;
    it prints one JSON object, which is returned."""
    prelude = textwrap.dedent(
        """
        import ctypes, json
        import numpy as np
        from kvx._datapath import _cuda
        fake = ctypes.CDLL("libcuda.so.1")
        def counts():
            out = (ctypes.c_ulonglong * 5)()
            fake.fake_counts(out)
            return dict(zip(("htod", "launch", "queries", "syncs", "stream_syncs"), out))
        def last():
            out = (ctypes.c_ulonglong * 8)()
            fake.fake_last(out)
            return list(out)
        """
    )
    environment = {**os.environ, "LD_LIBRARY_PATH": str(fake_dir), "PYTHONPATH": str(ROOT), **env}
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=60, env=environment, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


LAUNCH = """
    _cuda.load()
    n = 5
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    lens = np.array([16, 4000, 1, 333, 7], np.uint64)
    srcs = src.ctypes.data + np.array([0, 100, 5000, 6000, 9000], np.uint64)
    dsts = dst.ctypes.data + np.array([40000, 20, 30000, 8000, 12000], np.uint64)
    host = np.concatenate([srcs, dsts, lens]).astype(np.uint64)
    dev = np.zeros(3 * n, np.uint64)
    event = ctypes.c_int(0)
    error = None
    try:
        _cuda.launch(0xF00, 0x5EA, host.ctypes.data, dev.ctypes.data, 24 * n, n, 3, 256, ctypes.addressof(event))
    except RuntimeError as exc:
        error = str(exc)
    expected = np.zeros_like(src)
    for s, d, k in zip(srcs.tolist(), dsts.tolist(), lens.tolist()):
        o, p = s - src.ctypes.data, d - dst.ctypes.data
        expected[p:p + k] = src[o:o + k]
    print(json.dumps({
        "error": error, "copied": bool((dst == expected).all()), "args_on_device": bool((dev == host).all()),
        "last": last(), "dev": dev.ctypes.data, "pending": event.value, "counts": counts(),
    }))
"""


def test_launch_copies_the_arguments_then_launches_the_kernel_on_them_and_records(fake_dir: Path) -> None:
    got = run(fake_dir, LAUNCH, FAKE_CUDA_NOT_READY="3")
    assert got["error"] is None
    assert got["args_on_device"] and got["copied"]
    dev, n = got["dev"], 5
    # function, grid, threads, then kvx_copy's own arguments: srcs, dsts, lens, n; the stream.
    assert got["last"] == [0xF00, 3, 256, dev, dev + 8 * n, dev + 16 * n, n, 0x5EA]
    assert got["pending"] == 3  # recorded: the stand-in's event now answers "not ready" 3 times
    assert got["counts"]["htod"] == 1 and got["counts"]["launch"] == 1
    assert got["counts"]["stream_syncs"] == 0  # nothing waits on the host


@pytest.mark.parametrize("call", ["htod", "launch", "record"])
def test_a_failed_step_raises_with_the_drivers_error_and_goes_no_further(fake_dir: Path, call: str) -> None:
    got = run(fake_dir, LAUNCH, FAKE_CUDA_FAIL=call, FAKE_CUDA_NOT_READY="3")
    name = {"htod": "cuMemcpyHtoDAsync", "launch": "cuLaunchKernel", "record": "cuEventRecord"}[call]
    assert got["error"] == f"{name}: CUDA_ERROR_ILLEGAL_ADDRESS (700)"
    assert got["counts"]["launch"] == (0 if call == "htod" else 1)
    assert got["copied"] == (call == "record")
    assert got["pending"] == 0  # no event recorded after a failed step
    # What was queued before the failed step (the argument copy; the kernel) has ended
    # when the error is raised: nothing still reads the caller's buffers.
    assert got["counts"]["stream_syncs"] == (0 if call == "htod" else 1)


WAIT = """
    import time
    _cuda.load()
    event = ctypes.c_int(int(NOT_READY))
    error = None
    started = time.perf_counter()
    try:
        _cuda.wait(ctypes.addressof(event), SPIN_US)
    except RuntimeError as exc:
        error = str(exc)
    print(json.dumps({"error": error, "counts": counts(), "pending": event.value,
                      "took_s": time.perf_counter() - started}))
"""


def wait(fake_dir: Path, not_ready: int, spin_us: float, **env: str) -> dict:
    return run(fake_dir, WAIT.replace("NOT_READY", str(not_ready)).replace("SPIN_US", repr(spin_us)), **env)


def test_wait_polls_then_blocks(fake_dir: Path) -> None:
    # Ends while polled: queries only, no blocking wait.
    got = wait(fake_dir, 50, 1e6)
    assert got["error"] is None and got["counts"]["queries"] == 51 and got["counts"]["syncs"] == 0
    # Not ended within the poll (a billion queries would take minutes): it blocks.
    got = wait(fake_dir, 10**9, 2000.0)
    assert got["error"] is None and got["counts"]["syncs"] == 1 and got["pending"] == 0
    assert got["counts"]["queries"] >= 2 and got["took_s"] < 30
    # No poll at all: one query, then it blocks.
    got = wait(fake_dir, 5, 0.0)
    assert got["counts"]["queries"] == 1 and got["counts"]["syncs"] == 1


@pytest.mark.parametrize("call", ["query", "sync"])
def test_wait_raises_a_failed_copy(fake_dir: Path, call: str) -> None:
    got = wait(fake_dir, 10**9 if call == "sync" else 0, 0.0, FAKE_CUDA_FAIL=call)
    name = {"query": "cuEventQuery", "sync": "cuEventSynchronize"}[call]
    assert got["error"] == f"{name}: CUDA_ERROR_ILLEGAL_ADDRESS (700)"


def test_the_calls_refuse_to_run_unloaded_and_null_handles(fake_dir: Path) -> None:
    got = run(
        fake_dir,
        """
        errors = []
        for call in (lambda: _cuda.launch(1, 1, 0, 8, 0, 1, 1, 1, 0), lambda: _cuda.wait(8, 0.0)):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        _cuda.load()
        for call in (
            lambda: _cuda.launch(0, 1, 0, 8, 0, 1, 1, 1, 0),          # no function
            lambda: _cuda.launch(1, 1, 0, 8, 24, 1, 1, 1, 0),         # arguments to copy from nowhere
            lambda: _cuda.launch(1, 1, 8, 0, 24, 1, 1, 1, 0),         # ... or to nowhere
            lambda: _cuda.launch(1, 1, 8, 8, 48, 1, 1, 1, 0),         # not 24 bytes per triple
            lambda: _cuda.launch(1, 1, 8, 8, 0, 0, 1, 1, 0),          # no triples
            lambda: _cuda.launch(1, 1, 8, 8, 0, 2**32, 1, 1, 0),      # more than 32 bits of them
            lambda: _cuda.launch(1, 1, 8, 8, 0, 1, 0, 1, 0),          # an empty grid
            lambda: _cuda.launch(1, 1, 8, 8, 0, 1, 2**31, 1, 0),      # a grid past CUDA's limit
            lambda: _cuda.launch(1, 1, 8, 8, 0, 1, 1, 1025, 0),       # a block past it
            lambda: _cuda.wait(0, 0.0),                               # no event
        ):
            try:
                call()
            except ValueError as exc:
                errors.append(type(exc).__name__)
        for call in (lambda: _cuda.launch(-1, 1, 8, 8, 0, 1, 1, 1, 0), lambda: _cuda.launch(1, 1, 8, 2**64, 0, 1, 1, 1, 0)):
            try:
                call()
            except OverflowError as exc:  # not wrapped around into some other address
                errors.append(type(exc).__name__)
        print(json.dumps({"errors": errors, "counts": counts()}))
        """,
    )
    assert (
        got["errors"]
        == ["kvx._datapath._cuda: call load() first"] * 2 + ["ValueError"] * 10 + ["OverflowError"] * 2
    )
    assert got["counts"] == {"htod": 0, "launch": 0, "queries": 0, "syncs": 0, "stream_syncs": 0}


ENGINE = """
    import sys, types
    from tests.unit import fake_cuda

    cupy = fake_cuda.make(None)  # CuPy's stand-in, with a CUfunction and events the driver can use
    cupy.RawModule.get_function = lambda self, name: types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    plain_init = cupy.cuda.Event.__init__

    def event_init(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        self.cell = ctypes.c_int(0)
        self.ptr = ctypes.addressof(self.cell)

    cupy.cuda.Event.__init__ = event_init
    sys.modules["cupy"] = cupy
    from kvx._datapath import gpu

    engine = gpu.Engine(0)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    dst = np.zeros_like(src)
    landed = []
    for n in (40, 3000):  # the second grows the argument buffer: pack is called again
        srcs = (src.ctypes.data + rng.permutation(8192)[:n] * 512).astype(np.uint64)
        dsts = (dst.ctypes.data + rng.permutation(8192)[:n] * 512).astype(np.uint64)
        lens = np.full(n, 256, np.uint64)

        def pack(out, words, srcs=srcs, dsts=dsts, lens=lens, n=n):
            if words < 3 * n:
                return (3, n)
            packed = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * n)).from_address(out))
            packed[:n], packed[n : 2 * n], packed[2 * n :] = srcs, dsts, lens
            return n

        dst[:] = 0
        event = engine.copy_packed(pack)
        engine.wait(event)
        landed.append(all(
            np.array_equal(dst[d - dst.ctypes.data : d - dst.ctypes.data + 256], src[s - src.ctypes.data : s - src.ctypes.data + 256])
            for s, d in zip(srcs.tolist(), dsts.tolist())
        ) and int(np.count_nonzero(dst)) <= n * 256)
    print(json.dumps({
        "driver": engine.driver is not None, "landed": landed, "counts": counts(), "last": last(),
        "slot_idle": engine._slots[2].event is None, "grid_limit": engine.grid_limit,
        "refused": list(engine.copy_packed(lambda out, words: (1, 5))),
    }))
"""


def test_the_engine_launches_a_leased_copy_through_the_driver_and_waits_for_it(fake_dir: Path) -> None:
    """kvx/_datapath/gpu.py's driver branch, with CuPy's stand-in for the
    buffers and the stand-in libcuda for the calls: the triples packed into
    the pinned buffer go to the device in the launch's call, the kernel
    copies them, the slot's event is waited for (polled, then blocked on)."""
    got = run(fake_dir, ENGINE, FAKE_CUDA_NOT_READY="2")
    assert got["driver"] and got["landed"] == [True, True]
    assert got["counts"]["htod"] == 2 and got["counts"]["launch"] == 2
    assert got["counts"]["queries"] >= 2 * 3  # not ready twice, then done
    function, grid, threads, srcs, dsts, lens, n, _ = got["last"]
    assert (function, grid, threads, n) == (0xF00, min(3000, got["grid_limit"]), gpu.THREADS, 3000)
    assert (dsts - srcs, lens - srcs) == (8 * 3000, 16 * 3000)
    assert got["slot_idle"]  # waited: the slot's next copy need not wait for it again
    assert got["refused"] == [1, 5]
    assert got["counts"]["launch"] == 2  # the refusal launched nothing


def test_launch_method_is_checked_and_cupy_or_a_stand_in_kernel_launch_through_cupy(monkeypatch) -> None:
    monkeypatch.setenv("KVX_CUDA_LAUNCH", "fast")
    with pytest.raises(ConfigError, match="KVX_CUDA_LAUNCH must be one of driver, cupy"):
        gpu.launch_method()
    monkeypatch.setenv("KVX_CUDA_LAUNCH", "cupy")
    assert gpu._driver(object()) is None
    monkeypatch.delenv("KVX_CUDA_LAUNCH")
    # No CUfunction behind it (tests/unit/fake_cuda.py's kernels), or no kernel at all.
    assert gpu._driver(object()) is None
    assert gpu._driver(None) is None
    # With a CUfunction, where libcuda.so.1 opens (the driver branch itself is
    # test_the_engine_launches_a_leased_copy_through_the_driver_and_waits_for_it).
    from kvx._datapath import _cuda

    try:
        _cuda.load()
    except OSError:
        pass
    else:
        kernel = type("Kernel", (), {"ptr": 0xF00})()
        assert gpu._driver(kernel) == (_cuda, 0xF00)
    # The extension missing: CuPy launches, unless the C build is required.
    import kvx._datapath

    monkeypatch.delattr(kvx._datapath, "_cuda", raising=False)
    monkeypatch.setitem(sys.modules, "kvx._datapath._cuda", None)
    monkeypatch.setenv("KVX_NATIVE", "")
    assert gpu._driver(object()) is None
    monkeypatch.setenv("KVX_NATIVE", "1")
    with pytest.raises(
        ConfigError, match="KVX_NATIVE=1 but the C extension kvx._datapath._cuda is not built"
    ):
        gpu._driver(object())
