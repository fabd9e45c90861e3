#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite, twice: on the C data
# path (KVX_NATIVE=1, which must be built) and on its pure-Python twin
# (KVX_NATIVE=0). Extra arguments go to pytest. Runs unattended (CI=true, no stdin).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]' </dev/null
export PYTHONUNBUFFERED=1
echo "== kvx tests: native data path (KVX_NATIVE=1)"
KVX_NATIVE=1 python3 -m pytest "$@" </dev/null
echo "== kvx tests: pure-Python twin (KVX_NATIVE=0)"
KVX_NATIVE=0 python3 -m pytest "$@" </dev/null
