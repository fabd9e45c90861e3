#!/usr/bin/env bash
# Runs the verbs provider's hardware tests (tests/rdma/) and
# the rdma benchmarks, on a host with an RDMA device.
#
#   scripts/rdma_check.sh [DEVICE]     (default: the first device ibv_devices lists)
#
# Needs: rdma-core (ibv_devices, libibverbs1 and the NIC's provider), kvx built
# with libibverbs-dev present (python3 setup.py build_ext --inplace), memlock
# unlimited (ulimit -l unlimited), and CuPy for the GPU memory cases.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v ibv_devices >/dev/null || [ -z "$(ibv_devices | tail -n +3)" ]; then
    echo "rdma_check: no RDMA device (ibv_devices lists none); run this on a host with one" >&2
    exit 2
fi
export KVX_RDMA_DEVICE="${1:-$(ibv_devices | awk 'NR>2 {print $1; exit}')}"
echo "== device $KVX_RDMA_DEVICE"
ibv_devinfo -d "$KVX_RDMA_DEVICE" | grep -E 'hca_id|port:|state|active_mtu|link_layer' || true
echo "== memlock: $(ulimit -l)"
python3 -c 'import kvx._verbs' || {
    echo "rdma_check: kvx._verbs is not built (apt-get install libibverbs-dev; python3 setup.py build_ext --inplace)" >&2
    exit 2
}
python3 -m pytest tests/rdma -v -rs -p no:randomly
echo "== benchmarks/rdma_post_rate.py (the posting layer, no NIC)"
python3 benchmarks/rdma_post_rate.py --no-tcp
echo "== benchmarks/rdma_hw.py (registration per GiB, the curve against line rate, striping)"
python3 benchmarks/rdma_hw.py --provider verbs
