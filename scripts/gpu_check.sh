#!/usr/bin/env bash
# On a machine with a CUDA device and CuPy: builds kvx in place (nothing is
# downloaded), then runs the GPU tests, the unit tests and the GPU benchmark,
# and writes their logs to OUTDIR (default: gpu-check/). kvx's own dependencies
# (pyproject.toml: pydantic-settings, fastapi and grpcio-health-checking among them) must be importable;
# the script stops at once, naming those that are not.
#
#   bash scripts/gpu_check.sh [OUTDIR] [benchmark rounds]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
rounds="${2:-3}"
mkdir -p "$out"
missing="$(python3 - <<'PY'
import importlib
# What tests/gpu, tests/unit and the benchmark import (tests/unit starts the metadata
# service, which serves gRPC health and reflection).
names = ["numpy", "google.protobuf", "grpc", "grpc_health", "grpc_reflection", "fastapi", "uvicorn",
         "prometheus_client", "pydantic_settings", "yaml", "httpx", "cupy", "pytest"]
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
print("; ".join(missing))
PY
)"
if [ -n "$missing" ]; then
    echo "gpu_check.sh: not importable here: $missing (carry their wheels, with their own dependencies)" \
        | tee "$out/device.txt" >&2
    exit 1
fi
{
    date -u
    nvidia-smi -L 2>&1
    python3 -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" 2>&1
    if [ -d /sys/class/infiniband ] && [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
        echo "RDMA devices: $(ls /sys/class/infiniband)"
    else
        echo "RDMA devices: none"
    fi
} >"$out/device.txt"
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || echo "C extensions not built: see build.log" >>"$out/device.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pytest tests/gpu tests/unit -v -rs -p no:cacheprovider 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
python3 benchmarks/gpu_side_by_side.py --rounds "$rounds" --iters 20 --json-out "$out/gpu.json" 2>&1 | tee "$out/bench.md"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench" | tee -a "$out/device.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
