"""GPU tests: CUDA regions, the copy kernel, staging over tcp, cuda_ipc.

They need CuPy (the kvx[gpu] extra) and a CUDA device, and are skipped
without them, as in CI. Run them on a GPU machine:

    pip install -e '.[gpu,test]' && pytest tests/gpu -v
"""

import pytest

from kvx._datapath import gpu

HAVE_GPU = gpu.available()
needs_gpu = pytest.mark.skipif(
    not HAVE_GPU, reason="needs CuPy (kvx[gpu]) and a CUDA device; runs on a GPU machine: pytest tests/gpu"
)


@pytest.fixture
def cp():
    return gpu.cupy_module()
