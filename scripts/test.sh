#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite, twice: on the C data
# path (KVX_NATIVE=1, which must be built) and on its pure-Python twin
# (KVX_NATIVE=0). Extra arguments go to pytest. Runs unattended (CI=true, no stdin).
set -euo pipefail
cd "$(dirname "$0")/.."
# The etcd metadata-store tests need a real etcd (Debian package etcd-server: /usr/bin/etcd).
if ! command -v etcd >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if [ "$(id -u)" -eq 0 ]; then
        as_root=()
    elif sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        echo "scripts/test.sh: the tests need etcd (Debian package etcd-server) and this user cannot" \
             "install it; run: apt-get install etcd-server (as root), then this script again" >&2
        exit 1
    fi
    "${as_root[@]}" apt-get update -qq </dev/null
    "${as_root[@]}" apt-get install -y -qq --no-install-recommends etcd-server </dev/null
    # The package may start a system etcd on the default ports; the tests start their own.
    "${as_root[@]}" systemctl disable --now etcd >/dev/null 2>&1 || true
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]' </dev/null
export PYTHONUNBUFFERED=1
echo "== kvx tests: native data path (KVX_NATIVE=1)"
KVX_NATIVE=1 python3 -m pytest "$@" </dev/null
echo "== kvx tests: pure-Python twin (KVX_NATIVE=0)"
KVX_NATIVE=0 python3 -m pytest "$@" </dev/null
