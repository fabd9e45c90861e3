#!/usr/bin/env bash
# Builds a Python environment that runs a real SGLang 0.5.23 engine (and a
# prefill/decode pair) on a CPU-only machine, with kvx installed in it.
#
#   scripts/sglang_env.sh [ENV_DIR]      (default: .venv-sglang in the repo root)
#
# Runs unattended (no stdin) and is idempotent: the install is skipped when the
# environment already imports everything. See tests/sglang_env/README.md.
#
# SGLang pins a CUDA torch and CUDA-only kernels. uv installs it with torch
# overridden to the CPU build 2.13.0 (its wheel is in a $PIP_FIND_LINKS
# directory) and the CUDA-only packages excluded. Two test-environment fixes
# make it import on CPU:
#   - the PyPI torchvision is CUDA-linked and fails at import ("torchvision::nms
#     does not exist"); its _meta_registrations.py is replaced by one that
#     registers its ops only when the C++ extension loaded;
#   - sgl_kernel has no CPU build on PyPI; a stub package
#     (tests/sglang_env/stubs) goes on PYTHONPATH. On a CPU without AMX none of
#     it is called.
# The same directory holds a test-only SGLang plugin (sglang_cpu_test_fixes, found
# through its entry point) without which a mooncake prefill engine dies at its
# first request on CPU (it pins memory).
# mooncake's engine.so links libibverbs.so.1 even in the non-CUDA build; when
# the system lacks it, the Debian packages' shared objects are unpacked into
# ENV_DIR/lib/native (nothing is installed system-wide; needs apt-get).
# At the end it prints the environment a caller needs to run SGLang from it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
ENV_DIR="${1:-.venv-sglang}"
case "$ENV_DIR" in /*) ;; *) ENV_DIR="$REPO/$ENV_DIR" ;; esac
PY="$ENV_DIR/bin/python"
FIXES="$REPO/tests/sglang_env"
STUBS="$FIXES/stubs"

SGLANG_VERSION=0.5.23
TORCH_PIN=torch==2.13.0+cpu
# torchvision matching torch 2.13 (SGLang leaves it unpinned; the newest needs torch 2.14).
TORCHVISION_PIN=torchvision==0.28.0
# SGLang's CUDA-only dependencies: none of them installs or imports without CUDA.
EXCLUDES=(cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl
          nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla
          sglang-kernel tilelang torch-memory-saver torchaudio torchcodec deepseek-recipe timm)
# Also in the environment: mooncake's transfer engine without CUDA (the
# mooncake_tcp disaggregation backend), SGLang's router (module sglang_router),
# and what the tests need.
EXTRAS=(mooncake-transfer-engine-non-cuda sglang-router pytest pytest-timeout httpx)
# What an environment built by this script imports.
NATIVE="$ENV_DIR/lib/native"
CHECK='import sglang, sglang_router, mooncake.engine, torchvision, pytest, pytest_timeout, httpx'

export PYTHONPATH="$STUBS${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$NATIVE${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if uv --version >/dev/null 2>&1; then
    UV=(uv)
else
    python3 -m uv --version >/dev/null 2>&1 \
        || python3 -m pip install --quiet --disable-pip-version-check uv </dev/null
    UV=(python3 -m uv)
fi

# Copies the torchvision fix over the installed file (a no-op when already there).
fix_torchvision() {
    local dest
    dest="$("$PY" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("torchvision")
print(os.path.join(os.path.dirname(spec.origin), "_meta_registrations.py") if spec else "")
EOF
)"
    if [ -n "$dest" ] && ! cmp -s "$FIXES/torchvision_meta_registrations.py" "$dest"; then
        # Keep the original beside the shim, which imports it when the extension loaded.
        if [ ! -e "$(dirname "$dest")/_meta_registrations_upstream.py" ]; then
            mv "$dest" "$(dirname "$dest")/_meta_registrations_upstream.py"
        fi
        cp "$FIXES/torchvision_meta_registrations.py" "$dest"
        rm -f "$(dirname "$dest")/__pycache__/_meta_registrations".*.pyc
    fi
}

# libibverbs (and the libnl it links) for mooncake, unless the system has it.
native_libs() {
    if ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null || [ -e "$NATIVE/libibverbs.so.1" ]; then
        return
    fi
    if ! command -v apt-get >/dev/null; then
        echo "scripts/sglang_env.sh: mooncake needs libibverbs.so.1 (package libibverbs1);" \
             "install it, or put it in $NATIVE, then run this script again" >&2
        exit 1
    fi
    local tmp
    tmp="$(mktemp -d)"
    download() {
        (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root \
            libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null </dev/null)
    }
    if ! download; then
        # No package lists yet (a fresh container): fetch them, as root.
        if [ "$(id -u)" -eq 0 ]; then
            apt-get update -qq </dev/null
        else
            sudo -n apt-get update -qq </dev/null
        fi
        download
    fi
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
    mkdir -p "$NATIVE"
    find "$tmp/root" \( -name 'libibverbs.so.1*' -o -name 'libnl-3.so.200*' \
        -o -name 'libnl-route-3.so.200*' \) -exec cp -a {} "$NATIVE/" \;
    rm -rf "$tmp"
    echo "== unpacked libibverbs1, libnl-3-200, libnl-route-3-200 into $NATIVE"
}

if [ -x "$PY" ] && version="$("$PY" -c "$CHECK; print(sglang.__version__)" 2>/dev/null </dev/null)"; then
    echo "== $ENV_DIR already has SGLang $version"
else
    echo "== building $ENV_DIR (SGLang $SGLANG_VERSION on CPU $TORCH_PIN)"
    start=$SECONDS
    [ -x "$PY" ] || "${UV[@]}" venv --quiet --python "$(command -v python3)" "$ENV_DIR" </dev/null
    overrides="$(mktemp)"
    excludes="$(mktemp)"
    trap 'rm -f "$overrides" "$excludes"' EXIT
    printf '%s\n' "$TORCH_PIN" >"$overrides"
    printf '%s\n' "${EXCLUDES[@]}" >"$excludes"
    args=(--python "$PY" --overrides "$overrides" --excludes "$excludes")
    for dir in ${PIP_FIND_LINKS:-}; do args+=(--find-links "$dir"); done
    "${UV[@]}" pip install --quiet "${args[@]}" "sglang==$SGLANG_VERSION" "$TORCH_PIN" \
        "$TORCHVISION_PIN" "${EXTRAS[@]}" </dev/null
    fix_torchvision
    native_libs
    "$PY" -c "$CHECK" </dev/null
    echo "== $ENV_DIR built in $((SECONDS - start)) s"
fi
fix_torchvision
"${UV[@]}" pip install --quiet --python "$PY" -e . </dev/null

# What a caller needs to run SGLang from this environment (the interpreter is
# KVX_SGLANG_PYTHON), e.g. python -m sglang.launch_server --device cpu ...
echo "== environment for SGLang from $ENV_DIR:"
echo "KVX_SGLANG_PYTHON=$PY"
echo "PYTHONPATH=$STUBS"
if [ -d "$NATIVE" ]; then echo "LD_LIBRARY_PATH=$NATIVE"; fi
echo "SGLANG_USE_CPU_ENGINE=1"
