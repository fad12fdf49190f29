// A variant's second kernel (config.cuh SecondKernel), compiled in a translation unit of its own
// (templates/variant_second.cu.j2) so that the variant's own unit holds only its own kernels and NVVM
// schedules each kernel as it would alone. launch.cuh declares launch_second and calls it when every
// split of a launch holds at most the variant's kSecondMaxSplitKeys keys, or for kRows64 when a
// request's q_len x NUM_HEADS rows exceed kStMaxRows:
// - kShortSplit (fp8 split variants of the 64-row path, exact and fast): 32-token tiles in four
//   stages, S first (mla_decode_kernel<cutlass::float_e4m3_t, ..., SHORT = true>);
// - kRows64 (transposed bf16/fp16 variants, at most 32 heads): the 64-row kernel
//   (mla_decode_kernel<..., ROWS = kBlockM>).
#pragma once
#include "launch.cuh"

namespace mla {

template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
cudaError_t launch_second(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  using Traits = VariantTraits<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>;
  if constexpr (Traits::kSecond == SecondKernel::kShortSplit) {
    // The exact fp8 kernel also for a fast-mode variant (the same cache bytes, q and out; its 16-bit
    // pieces are the fast kernel's type at >= kPartial16MinHeads heads, the only fast head counts).
    using Exact = std::conditional_t<CacheTypes<Cache>::kFast, cutlass::float_e4m3_t, Cache>;
    using ShortStorage = KernelStorage<Exact, kBlockM, true>;
    static_assert(CacheTypes<Cache>::kFast || ShortStorage::kThreads == KernelStorage<Cache, Traits::kRows>::kThreads,
                  "one block size per variant");
    return launch_decode_kernel<ShortStorage>(mla_decode_kernel<Exact, NUM_HEADS, PAGE_SIZE, true, false, true>, p, grid,
                                              stream);
  } else if constexpr (Traits::kSecond == SecondKernel::kRows64) {
    return launch_decode_kernel<KernelStorage<Cache, kBlockM>>(
        mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, false, false, kBlockM>, p, grid, stream);
  } else {
    return cudaErrorInvalidValue;  // never called: this variant has no second kernel
  }
}

}  // namespace mla
