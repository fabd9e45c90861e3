// The launch loop of the CPU shim (shim.h).
#include "shim.h"

thread_local kvx_dim3 blockIdx, threadIdx, gridDim, blockDim;

extern "C" void kvx_copy(const unsigned long long* src, const unsigned long long* dst,
                         const unsigned long long* len, unsigned int n);

extern "C" void kvx_copy_launch(unsigned int grid, unsigned int threads, const unsigned long long* src,
                                const unsigned long long* dst, const unsigned long long* len,
                                unsigned int n) {
  gridDim.x = grid;
  blockDim.x = threads;
  for (unsigned int b = 0; b < grid; ++b) {
    for (unsigned int t = 0; t < threads; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kvx_copy(src, dst, len, n);
    }
  }
}
