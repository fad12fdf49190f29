// Library-wide exports shared by every variant: the ABI version, CUDA error strings, and the phase
// trace buffer of an MLA_TRACE build (trace.cuh; benchmarks/trace.py reads it).
#include <cuda_runtime.h>

#include "abi.h"
#include "trace.cuh"

extern "C" int mla_variants_abi_version() { return MLA_ABI_VERSION; }

extern "C" const char* mla_variants_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Bytes of the trace buffer (0: not a trace build, or it could not be allocated). The buffer holds
// 8 64-bit stamps per decode CTA of the last launch, CTA (x, y) at word 8 (x + gridDim.x y).
extern "C" int64_t mla_variants_trace_bytes() {
#if MLA_TRACE
  return mla::trace_buffer() != nullptr ? mla::kTraceBytes : 0;
#else
  return 0;
#endif
}

// Copies the first `bytes` of the trace buffer to host memory after every queued GPU operation
// (cudaDeviceSynchronize); returns a cudaError_t code (cudaErrorInvalidValue without a buffer).
extern "C" int mla_variants_trace_read(void* host_dst, int64_t bytes) {
#if MLA_TRACE
  if (mla::trace_buffer() == nullptr || host_dst == nullptr || bytes < 0 || bytes > mla::kTraceBytes) {
    return int(cudaErrorInvalidValue);
  }
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(host_dst, mla::trace_buffer(), size_t(bytes), cudaMemcpyDeviceToHost);
  return int(err);
#else
  (void)host_dst;
  (void)bytes;
  return int(cudaErrorInvalidValue);
#endif
}

// Zeroes the trace buffer (synchronously), so the next launch's CTAs that do not trace read as 0.
extern "C" int mla_variants_trace_clear() {
#if MLA_TRACE
  if (mla::trace_buffer() == nullptr) return int(cudaErrorInvalidValue);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemset(mla::trace_buffer(), 0, size_t(mla::kTraceBytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return int(err);
#else
  return int(cudaErrorInvalidValue);
#endif
}
