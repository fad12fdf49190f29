// Library-wide exports shared by every variant: the ABI version, CUDA error strings, and the phase
// trace buffer of an MLA_TRACE build (trace.cuh; lab/trace.py reads it).
#include <cuda_runtime.h>

#include "abi.h"
#include "trace.cuh"

extern "C" int mla_variants_abi_version() { return MLA_ABI_VERSION; }

extern "C" const char* mla_variants_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

#if MLA_TRACE
namespace {
uint64_t* g_trace = nullptr;  // the library's one trace buffer (kTraceBytes), on device g_trace_device
int g_trace_device = -1;
bool g_trace_on = true;

// Allocates and zeroes the buffer on the current device the first time; a failure is not cached.
bool trace_ready() {
  if (g_trace != nullptr) return true;
  int dev = -1;
  void* p = nullptr;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaMalloc(&p, mla::kTraceBytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (cudaMemset(p, 0, mla::kTraceBytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    (void)cudaFree(p);
    (void)cudaGetLastError();
    return false;
  }
  g_trace = static_cast<uint64_t*>(p);
  g_trace_device = dev;
  return true;
}
}  // namespace

namespace mla {
uint64_t* trace_buffer_for_launch() {
  int dev = -1;
  if (g_trace == nullptr || !g_trace_on || cudaGetDevice(&dev) != cudaSuccess || dev != g_trace_device) return nullptr;
  return g_trace;
}
}  // namespace mla
#endif

// Bytes of the trace buffer, allocating it on the current device the first time (0: not a trace
// build, or it could not be allocated). The buffer holds 8 64-bit stamps per decode CTA of the last
// launch, CTA (x, y) at word 16 (x + gridDim.x y).
extern "C" int64_t mla_variants_trace_bytes() {
#if MLA_TRACE
  return trace_ready() ? mla::kTraceBytes : 0;
#else
  return 0;
#endif
}

// Whether the following launches stamp (on = 1, the default) or not (0): a call made only to warm
// the kernels' code leaves the buffer as it is. Returns a cudaError_t code.
extern "C" int mla_variants_trace_enable(int on) {
#if MLA_TRACE
  g_trace_on = on != 0;
  return int(cudaSuccess);
#else
  (void)on;
  return int(cudaErrorInvalidValue);
#endif
}

// Copies the first `bytes` of the trace buffer to host memory after every queued GPU operation
// (cudaDeviceSynchronize); returns a cudaError_t code (cudaErrorInvalidValue without a buffer).
extern "C" int mla_variants_trace_read(void* host_dst, int64_t bytes) {
#if MLA_TRACE
  if (!trace_ready() || host_dst == nullptr || bytes < 0 || bytes > mla::kTraceBytes) return int(cudaErrorInvalidValue);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(host_dst, g_trace, size_t(bytes), cudaMemcpyDeviceToHost);
  return int(err);
#else
  (void)host_dst;
  (void)bytes;
  return int(cudaErrorInvalidValue);
#endif
}

// Zeroes the trace buffer (synchronously), so the next launch's CTAs that do not stamp read as 0.
extern "C" int mla_variants_trace_clear() {
#if MLA_TRACE
  if (!trace_ready()) return int(cudaErrorInvalidValue);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemset(g_trace, 0, size_t(mla::kTraceBytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return int(err);
#else
  return int(cudaErrorInvalidValue);
#endif
}
