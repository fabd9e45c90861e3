// The copy kernel of kvx's GPU paths: many (src, dst, len) triples in one launch.
//
// Used for the cuda_ipc backend (local blocks <-> a peer's blocks opened through
// CUDA IPC) and for staging over tcp (scattered blocks <-> one contiguous
// staging buffer). Compiled at run time with CuPy's RawModule (kvx/gpu.py);
// tests/unit/test_copy_kernel.py also builds it for the CPU, through a shim
// that runs every block and thread in turn, to check its arithmetic where no
// GPU is present.
//
// The host cuts long ranges into pieces of at most kvx.gpu.PIECE_BYTES, so
// that the work spreads over the blocks; block b copies triples b, b + grid,
// b + 2 grid, ... Each triple is copied 16 bytes per thread and step when its
// addresses and length allow it, else 8, else 1.

extern "C" __global__ void kvx_copy(const unsigned long long* __restrict__ src,
                                    const unsigned long long* __restrict__ dst,
                                    const unsigned long long* __restrict__ len,
                                    unsigned int n) {
  for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
    const unsigned long long s = src[i];
    const unsigned long long d = dst[i];
    const unsigned long long l = len[i];
    const unsigned long long any = s | d | l;
    if ((any & 15ull) == 0) {
      const uint4* sp = reinterpret_cast<const uint4*>(s);
      uint4* dp = reinterpret_cast<uint4*>(d);
      const unsigned long long words = l >> 4;
      for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x) {
        dp[k] = sp[k];
      }
    } else if ((any & 7ull) == 0) {
      const unsigned long long* sp = reinterpret_cast<const unsigned long long*>(s);
      unsigned long long* dp = reinterpret_cast<unsigned long long*>(d);
      const unsigned long long words = l >> 3;
      for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x) {
        dp[k] = sp[k];
      }
    } else {
      const unsigned char* sp = reinterpret_cast<const unsigned char*>(s);
      unsigned char* dp = reinterpret_cast<unsigned char*>(d);
      for (unsigned long long k = threadIdx.x; k < l; k += blockDim.x) {
        dp[k] = sp[k];
      }
    }
  }
}
