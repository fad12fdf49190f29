// Host side of one variant: checks the arguments the kernel relies on, picks the variant's own or its
// second kernel, sizes the grid, launches the decode kernel and, for split-KV calls, the combine
// kernel. Included by each generated translation unit, which instantiates
// launch<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, PathFacts<...>> (Cache: the kv_cache element type).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled (before the CUTLASS headers, which include it differently)
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "abi.h"
#include "combine.cuh"
#include "config.cuh"
#include "fp8_fast.cuh"
#include "kernel.cuh"
#include "tma_map.cuh"

namespace mla {

// Sets up and launches a variant's second kernel (config.cuh SecondKernel); defined in second_kernel.cuh
// and compiled in the variant's second translation unit, so that each unit holds one path's kernels.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
cudaError_t launch_second(const DecodeParams& p, dim3 grid, cudaStream_t stream);

// Launches one decode kernel whose CTA holds a Storage in dynamic shared memory (+ 1 KiB of room to
// align it to 1024 bytes).
template <class Storage, class Kernel>
cudaError_t launch_decode_kernel(Kernel kernel, const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  static_assert(sizeof(Storage) + 1024 <= 227 * 1024, "shared memory per CTA");
  const int smem_bytes = int(sizeof(Storage)) + 1024;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Storage::kThreads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// The most keys one split of this launch can get: split_range's whole tiles per split for the longest
// request the caller announces (max_seq_len, when set and below the block table's capacity) or the
// block table can address. A performance choice only: every kernel is exact for any seq_lens.
inline int64_t max_split_keys(const MlaDecodeArgs& a, int page_size) {
  const int64_t capacity = int64_t(a.max_pages_per_seq) * page_size;
  const int64_t bound = a.max_seq_len > 0 && a.max_seq_len < capacity ? a.max_seq_len : capacity;
  const int64_t tiles = (bound + kBlockN - 1) / kBlockN;
  return (tiles + a.num_kv_splits - 1) / a.num_kv_splits * kBlockN;
}

// Launches the transposed kernel of ROWS rows per CTA when rows == ROWS, else the next larger one (up
// to kStMaxRows): the row blocks a transposed variant has (config.cuh rows_for).
// SCHED: the balanced schedule's instantiation (one segment per CTA on this path).
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT, int ROWS, bool SCHED = false>
cudaError_t launch_st_rows(int rows, const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (ROWS < kStMaxRows) {
    if (rows > ROWS) return launch_st_rows<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, 2 * ROWS, SCHED>(rows, p, grid, stream);
  }
  return launch_decode_kernel<KernelStorage<Cache, ROWS>>(
      mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, SCHED, false, ROWS>, p, grid, stream);
}

// The combine after a split decode grid (combine.cuh): a warp per row for 2-8 splits, a warp per 128
// columns for 9-16, kCombineWideGroups CTAs per row from kCombineWideMinSplits, else a CTA per row;
// the scheduled combine (a warp per row) for a balanced schedule. combine_rows and wide_combine as the launcher
// checked them. P: the decode kernel's partials (workspace.cuh).
template <class Out, class P>
cudaError_t launch_combine(const MlaDecodeArgs& a, cudaStream_t stream, int64_t combine_rows, bool scheduled,
                           bool wide_combine) {
  cudaError_t err;
  int64_t rows = combine_rows;
  unsigned threads = kCombineThreads;
  auto combine_kernel = scheduled ? mla_combine_scheduled_kernel<Out, P> : mla_combine_kernel<Out, P>;
  if (!scheduled && a.num_kv_splits <= kCombineWarpMaxSplits) {  // a warp per row (combine.cuh)
    static_assert(kCombineWarpMaxSplits == 8, "one instantiation per split count below");
    switch (a.num_kv_splits) {
      case 2: combine_kernel = mla_combine_warp_kernel<Out, P, 2>; break;
      case 3: combine_kernel = mla_combine_warp_kernel<Out, P, 3>; break;
      case 4: combine_kernel = mla_combine_warp_kernel<Out, P, 4>; break;
      case 5: combine_kernel = mla_combine_warp_kernel<Out, P, 5>; break;
      case 6: combine_kernel = mla_combine_warp_kernel<Out, P, 6>; break;
      case 7: combine_kernel = mla_combine_warp_kernel<Out, P, 7>; break;
      default: combine_kernel = mla_combine_warp_kernel<Out, P, 8>; break;
    }
    rows = (rows + kCombineWarpRows - 1) / kCombineWarpRows;
    threads = 32 * kCombineWarpRows;
  } else if (!scheduled && a.num_kv_splits <= kCombineColsMaxSplits) {  // a warp per 128 columns (combine.cuh)
    combine_kernel = mla_combine_cols_kernel<Out, P>;
    threads = 32 * kCombineWideGroups;
  } else if (scheduled) {  // a warp per row of the shared requests (combine.cuh)
    rows = (rows + kCombineWarpRows - 1) / kCombineWarpRows;
    threads = 32 * kCombineWarpRows;
  } else if (wide_combine) {  // column groups of a row, 8 warps over the splits (combine.cuh)
    combine_kernel = mla_combine_wide_kernel<Out, P>;
    rows *= kCombineWideGroups;
    threads = 32 * kCombineWideWarps;
  }
  // A programmatic dependent launch: set up while the decode grid finishes; the decode CTAs allow
  // it only after their stores (params.cuh allow_dependent_launch), so no combine CTA can wait on
  // an SM that a decode CTA still needs, and the combine waits for the whole grid (combine.cuh).
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(rows), 1, 1);
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  err = cudaLaunchKernelEx(&config, combine_kernel, a);
  if (err != cudaSuccess) (void)cudaGetLastError();  // do not leave it for the next call's check
  return err;
}

// One variant's launcher. Facts: the variant's path facts as codegen rendered them (config.cuh
// PathFacts); they must equal the C++ traits, so the Python runtime, which reads the same facts from
// the manifest, predicts exactly what this launcher does.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT, class Facts>
int launch(const MlaDecodeArgs* args) {
  static_assert(NUM_HEADS >= 1 && PAGE_SIZE >= 1, "variant fields must be positive");
  using Traits = VariantTraits<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>;
  static_assert(facts_match<Facts, Traits>(), "codegen's path facts and config.cuh's VariantTraits agree");
  if (args == nullptr || args->abi_version != MLA_ABI_VERSION) return int(cudaErrorInvalidValue);
  const MlaDecodeArgs& a = *args;
  if (a.batch < 0 || a.q_len < 1 || a.num_heads < 1 || a.num_heads > NUM_HEADS || a.num_kv_splits < 1 ||
      a.num_kv_splits > 65535 || (!SPLIT && a.num_kv_splits != 1) || a.max_pages_per_seq < 1 || a.max_seq_len < 0 ||
      a.tma_mode < MlaTmaAuto || a.tma_mode > MlaTmaRequire ||
      (a.query_start_loc != nullptr && a.total_q_tokens < 0)) {
    return int(cudaErrorInvalidValue);
  }
  if (CacheTypes<Cache>::kFp8 && a.k_scale_ptr == nullptr && !(a.k_scale > 0.f && a.k_scale < INFINITY)) {
    return int(cudaErrorInvalidValue);
  }
  if (a.batch == 0) return int(cudaSuccess);
  // A balanced schedule (schedule.cuh) runs on split variants of the 64-row path with 16-bit caches, of
  // the transposed path, and on fast-mode split variants (VariantTraits::kBalanced).
  const bool scheduled = a.schedule != nullptr;
  if (scheduled && (!Facts::kBalanced || a.sched_ctas < 1 ||
                    reinterpret_cast<uintptr_t>(a.schedule) % 8 != 0)) {
    return int(cudaErrorInvalidValue);
  }
  const bool combine = SPLIT && (scheduled || a.num_kv_splits > 1);
  if (combine) {
    const int64_t need = workspace_pieces(a) * a.q_len * a.num_heads * (kHeadDimV + 1) * 4;
    // 16-byte aligned: the decode kernel stores partial outputs in words of up to 16 bytes (16-bit:
    // uint4 and 4-byte words; fp32: float2 and float4) and the combine loads uint2 or float4 words.
    if (a.workspace == nullptr || a.workspace_bytes < need || reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0) {
      return int(cudaErrorInvalidValue);
    }
  }
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);

  DecodeParams p;
  p.a = a;
  // The second kernel when every split of a uniform launch is short enough (config.cuh SecondKernel).
  bool second = false;
  if constexpr (Facts::kSecondMaxSplitKeys > 0) {
    second = !scheduled && max_split_keys(a, PAGE_SIZE) <= Facts::kSecondMaxSplitKeys;
  }
  const int rows = second ? Facts::kSecondRows : rows_for(NUM_HEADS * a.q_len, Facts::kRows, Facts::kMaxRows);
  // A transposed 16-bit variant's 64-row kernel, in its second unit, also serves requests of more than
  // kStMaxRows rows.
  if constexpr (Facts::kSecond == SecondKernel::kRows64) second = second || rows == kBlockM;
  p.num_m_blocks = (NUM_HEADS * a.q_len + rows - 1) / rows;
  p.scale_log2 = a.softmax_scale * kLog2e;
#if MLA_TRACE
  p.trace = trace_buffer_for_launch();
#endif
  p.use_tma = 0;
  p.kv_map = CUtensorMap{};
  if (second ? Facts::kSecondTma : Facts::kTma) {
    if (a.tma_mode != MlaTmaOff) p.use_tma = encode_kv_map<Cache, PAGE_SIZE>(a, &p.kv_map) ? 1 : 0;
    if (!p.use_tma && a.tma_mode == MlaTmaRequire) return int(cudaErrorNotSupported);
  }
  // A scheduled launch runs one CTA per segment (at most batch + sched_ctas - 1; schedule.cuh) where
  // Facts::kSegmentCtas, else one per run.
  if (scheduled && second) return int(cudaErrorInvalidValue);  // the 64-row second kernel has no scheduled form
  const int64_t grid_x = int64_t(p.num_m_blocks) *
                         (!scheduled ? a.batch : Facts::kSegmentCtas ? int64_t(a.batch) + a.sched_ctas : a.sched_ctas);
  const unsigned grid_y = scheduled ? 1u : unsigned(a.num_kv_splits);
  if (grid_x > 0x7fffffff) return int(cudaErrorInvalidConfiguration);

  // The combine's grid, checked before anything is launched. Uniform split: per (request, query
  // token, head) row, one warp for 2-8 splits (kCombineWarpRows rows per CTA), one CTA for 9-31 (four
  // warps, one per 128 columns, for 9-16),
  // kCombineWideGroups CTAs for 32 or more (below). Scheduled: one warp per row of the most requests
  // that can be shared (schedule.cuh), at most kCombineCtasPerSm CTAs of kCombineWarpRows warps per SM
  // of the decode grid (its warps stride over the schedule's list); none when one CTA covers the batch.
  const int64_t rows_per_req = int64_t(a.q_len) * a.num_heads;
  const int64_t combine_rows =
      !combine ? 0
      : scheduled ? min(rows_per_req * min(int64_t(a.batch), int64_t(a.sched_ctas) - 1),
                        int64_t(kCombineCtasPerSm) * kCombineWarpRows * grid_x)
                  : int64_t(a.batch) * rows_per_req;
  const bool wide_combine = !scheduled && a.num_kv_splits >= kCombineWideMinSplits;
  if (combine_rows * (wide_combine ? kCombineWideGroups : 1) > 0x7fffffff) return int(cudaErrorInvalidConfiguration);

  const dim3 grid(unsigned(grid_x), grid_y, 1);
  cudaError_t err = cudaSuccess;
  if (second) {  // the variant's second kernel (second_kernel.cuh), fast variants' included
    if constexpr (Facts::kSecond != SecondKernel::kNone) err = launch_second<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>(p, grid, stream);
  } else if constexpr (CacheTypes<Cache>::kFast) {  // scheduled implies Facts::kBalanced (checked above)
    err = launch_decode_kernel<fast::Storage>(
        scheduled ? fast::mla_decode_fp8_fast_kernel<NUM_HEADS, PAGE_SIZE, SPLIT, Facts::kBalanced>
                  : fast::mla_decode_fp8_fast_kernel<NUM_HEADS, PAGE_SIZE, SPLIT>, p, grid, stream);
  } else if constexpr (Facts::kMaxRows > Facts::kRows) {
    err = scheduled ? launch_st_rows<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, Facts::kRows, Facts::kBalanced>(rows, p, grid, stream)
                    : launch_st_rows<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, Facts::kRows>(rows, p, grid, stream);
  } else {
    err = launch_decode_kernel<KernelStorage<Cache, Facts::kRows>>(
        scheduled ? mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, Facts::kBalanced>
                  : mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>, p, grid, stream);
  }
  if (err != cudaSuccess) return int(err);

  if (combine_rows > 0) {
    using Out = typename CacheTypes<Cache>::Out;
    // The fast kernel's pieces are fast::Piece (16-bit) at every head count (fp8_fast.cuh); the exact
    // kernels' (a fast variant's second kernel too) are Partial: fp32 below kPartial16MinHeads heads.
    static_assert(!CacheTypes<Cache>::kFast || std::is_same_v<Out, fast::Piece>, "the fast kernel stores out as fast::Piece");
    if (CacheTypes<Cache>::kFast && !second) {
      err = launch_combine<Out, fast::Piece>(a, stream, combine_rows, scheduled, wide_combine);
    } else {
      err = launch_combine<Out, Partial<Out, NUM_HEADS>>(a, stream, combine_rows, scheduled, wide_combine);
    }
  }
  if (err == cudaSuccess && a.query_start_loc != nullptr && a.total_q_tokens > 0) {  // combine.cuh
    const unsigned blocks = unsigned((int64_t(a.total_q_tokens) + kVarlenFillTokens - 1) / kVarlenFillTokens);
    mla_varlen_fill_kernel<typename CacheTypes<Cache>::Out><<<blocks, kVarlenFillThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  }
  return int(err);
}

}  // namespace mla
