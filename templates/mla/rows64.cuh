#pragma once
// The 64-row kernel of a 17..32-head bf16 / fp16 variant (kernel.cuh mla_decode_kernel<..., ROWS =
// kBlockM>), whose own kernel is the transposed one with 32 rows per CTA. launch.cuh calls this when
// every split of a launch is shorter than MLA_ST32_MIN_KEYS (constants.cuh); it is compiled in a
// translation unit of its own (templates/variant_rows64.cu.j2), as short_split.cuh is, so that each
// unit holds one path's kernels.
#include "launch.cuh"

namespace mla {

template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
cudaError_t launch_rows64(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (kHasRows64Kernel<Cache, NUM_HEADS>) {
    return launch_decode_kernel<KernelStorage<Cache, kBlockM>>(
        mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, false, false, kBlockM>, p, grid, stream);
  } else {
    return cudaErrorInvalidValue;  // never called: this variant has no 64-row kernel beside its own
  }
}

}  // namespace mla
