// Runs a CUDA kernel on the CPU, one block and thread after another, so that
// tests/unit/test_copy_kernel.py can check csrc/kvx_copy.cu's arithmetic
// without a GPU. Exact for kernels without shared memory or barriers.
#pragma once
struct uint4 { unsigned int x, y, z, w; };
struct kvx_dim3 { unsigned int x, y, z; };
extern thread_local kvx_dim3 blockIdx, threadIdx, gridDim, blockDim;  // per host thread: launches may run at once
#define __global__
#define __restrict__ __restrict
