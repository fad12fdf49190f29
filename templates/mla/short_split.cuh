#pragma once
// The fp8 short-split kernel's launch (kernel.cuh mla_decode_kernel<..., SCHED = false, SHORT = true>:
// 32-token tiles in four stages, S first), compiled in a translation unit of its own
// (templates/variant_short.cu.j2, one per fp8 split variant) so that the variant's own unit holds
// only the 64-token kernels and NVVM schedules each kernel as it would alone. launch.cuh declares
// launch_short_split and calls it when every split of a launch has at most MLA_FP8_SHORT_SPLIT_KEYS keys.
#include "launch.cuh"

namespace mla {

template <class Cache, int NUM_HEADS, int PAGE_SIZE>
cudaError_t launch_short_split(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (kHasShortKernel<Cache, NUM_HEADS, true>) {
    using ShortStorage = KernelStorage<Cache, kBlockM, true>;
    static_assert(ShortStorage::kThreads == KernelStorage<Cache, kRowBlock<NUM_HEADS, true>>::kThreads,
                  "one block size per variant");
    return launch_decode_kernel<ShortStorage>(mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, true, false, true>, p, grid,
                                              stream);
  } else {
    return cudaErrorInvalidValue;  // never called: this variant has no short-split kernel
  }
}

}  // namespace mla
