#!/usr/bin/env bash
# The quality gate: lint, formatting and types, with the configuration in pyproject.toml.
# Fails on any finding. Runs unattended; the tools come from the `test` extra
# (pip install -e '.[test]'), at the versions pinned there. Fix most findings with:
#   ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
echo "-- ruff check"
python3 -m ruff check --no-cache . </dev/null || status=1
echo "-- ruff format --check"
# One line per file; `ruff format --diff .` shows the changes.
python3 -m ruff format --check --no-cache --output-format concise . </dev/null || status=1
echo "-- mypy"
python3 -m mypy </dev/null || status=1
# All three run even when one fails, so one pass shows every finding.
exit "$status"
