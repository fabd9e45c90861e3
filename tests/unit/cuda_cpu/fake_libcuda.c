// A stand-in libcuda.so.1 for tests/unit/test_cuda_launch.py: the few driver
// calls kvx._datapath._cuda makes, on host memory. "Device" pointers are host
// addresses; cuLaunchKernel runs kvx_copy's work (every triple, in full) and
// records what it was given; an event is an int counting the queries still
// to answer "not ready". FAKE_CUDA_FAIL=htod|launch|record|query|sync makes
// that call fail with CUDA_ERROR_ILLEGAL_ADDRESS (700).
#include <stdlib.h>
#include <string.h>

typedef int CUresult;

static unsigned long long last[8];  // function, grid, threads, srcs, dsts, lens, n, stream
static unsigned long long counts[5];  // htod, launch, queries, syncs, stream syncs

static int fails(const char* call) {
  const char* which = getenv("FAKE_CUDA_FAIL");
  return which != NULL && strcmp(which, call) == 0;
}

CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream) {
  (void)stream;
  counts[0]++;
  if (fails("htod")) return 700;
  memcpy((void*)(size_t)dst, src, n);
  return 0;
}

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
  (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)extra;
  counts[1]++;
  if (fails("launch")) return 700;
  const unsigned long long* srcs = *(unsigned long long**)params[0];
  const unsigned long long* dsts = *(unsigned long long**)params[1];
  const unsigned long long* lens = *(unsigned long long**)params[2];
  unsigned n = *(unsigned*)params[3];
  unsigned long long values[8] = {(unsigned long long)(size_t)f, gx, bx, (unsigned long long)(size_t)srcs,
                                  (unsigned long long)(size_t)dsts, (unsigned long long)(size_t)lens, n,
                                  (unsigned long long)(size_t)stream};
  memcpy(last, values, sizeof last);
  for (unsigned i = 0; i < n; i++) memcpy((void*)(size_t)dsts[i], (const void*)(size_t)srcs[i], lens[i]);
  return 0;
}

CUresult cuEventRecord(void* event, void* stream) {
  (void)stream;
  if (fails("record")) return 700;
  *(int*)event = atoi(getenv("FAKE_CUDA_NOT_READY") ? getenv("FAKE_CUDA_NOT_READY") : "0");
  return 0;
}

CUresult cuEventQuery(void* event) {
  counts[2]++;
  if (fails("query")) return 700;
  int* pending = event;
  if (*pending > 0) {
    (*pending)--;
    return 600;  // CUDA_ERROR_NOT_READY
  }
  return 0;
}

CUresult cuEventSynchronize(void* event) {
  counts[3]++;
  if (fails("sync")) return 700;
  *(int*)event = 0;
  return 0;
}

CUresult cuStreamSynchronize(void* stream) {
  (void)stream;
  counts[4]++;
  return 0;
}

CUresult cuGetErrorName(CUresult rc, const char** name) {
  *name = rc == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
  return 0;
}

void fake_last(unsigned long long* out) { memcpy(out, last, sizeof last); }
void fake_counts(unsigned long long* out) { memcpy(out, counts, sizeof counts); }
