// Host side of one variant: checks the arguments the kernel relies on, sizes the grid, launches the
// decode kernel and, for split-KV variants, the combine kernel. Included by each generated
// translation unit, which instantiates launch<Cache, NUM_HEADS, PAGE_SIZE, SPLIT> (Cache: the kv_cache element type).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "abi.h"
#include "combine.cuh"
#include "kernel.cuh"

namespace mla {

#if MLA_TMA
// The environment variable MLA_TMA, read once: "0" turns the TMA path off (every tile takes cp.async:
// an A/B without a rebuild); "require" makes a page-64/128 launch (bf16/fp16, and fp8's 64-token
// kernel with MLA_FP8_TMA, the default) whose tensor map cannot be encoded fail with
// cudaErrorNotSupported instead of falling back to cp.async, so an A/B or a test can prove that the
// TMA path ran; anything else (or unset) is the default: TMA where it can be encoded.
enum class TmaMode { kOff, kAuto, kRequire };
inline TmaMode tma_mode() {
  static const TmaMode mode = [] {
    const char* env = std::getenv("MLA_TMA");
    if (env != nullptr && std::strcmp(env, "0") == 0) return TmaMode::kOff;
    if (env != nullptr && std::strcmp(env, "require") == 0) return TmaMode::kRequire;
    return TmaMode::kAuto;
  }();
  return mode;
}
inline bool tma_required() { return tma_mode() == TmaMode::kRequire; }

// cuTensorMapEncodeTiled, found once through the runtime's driver entry point (the library links only
// the CUDA runtime, never libcuda), or null when the driver does not offer it or MLA_TMA=0.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    if (tma_mode() == TmaMode::kOff) return nullptr;
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || f == nullptr) {
      (void)cudaGetLastError();  // a failed look-up must not surface as the launch's error
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor map of a 16-bit cache: {576 values, PAGE_SIZE tokens, pages}, byte strides {token, page},
// box {64, 64, 1} (one 8 KiB sub-tile), 128-byte swizzle. False (the launch then uses cp.async for
// every tile) when TMA cannot address the cache: a base that is not 16-byte aligned, strides that are
// not positive multiples of 16 bytes below 2^40, or an encoder error.
//
// The page count is not in MlaDecodeArgs. The map's third extent only bounds which page indices TMA
// accepts (an index past it would read zeros), and the driver checks each extent alone (<= 2^32), not
// extent times stride, so the map claims pages up to 2^44 bytes (16 TiB) past the base, capped at
// 2^31 - 1 pages (block_table holds int32): far more than any cache one GPU can hold. Only in-range
// coordinates (page ids from block_table) are ever formed.
// fp8 (MLA_FP8_TMA): the same map over bytes, without swizzle (the raw rows of a slot are row-major).
template <class Cache, int PAGE_SIZE>
bool encode_kv_map(const MlaDecodeArgs& a, CUtensorMap* map) {
  constexpr bool kFp8 = CacheTypes<Cache>::kFp8;
  static_assert(sizeof(Cache) == (kFp8 ? 1 : 2), "16-bit caches, or fp8 bytes");
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr uint64_t kLimit = uint64_t(1) << 40;
  if (reinterpret_cast<uintptr_t>(a.kv_cache) % 16 != 0 || a.kv_stride_token <= 0 || a.kv_stride_page <= 0 ||
      uint64_t(a.kv_stride_token) >= kLimit / 2 || uint64_t(a.kv_stride_page) >= kLimit / 2) {
    return false;
  }
  const uint64_t token_bytes = uint64_t(a.kv_stride_token) * sizeof(Cache), page_bytes = uint64_t(a.kv_stride_page) * sizeof(Cache);
  if (token_bytes % 16 != 0 || page_bytes % 16 != 0) return false;
  uint64_t pages = (uint64_t(1) << 44) / page_bytes;
  if (pages > 0x7fffffffu) pages = 0x7fffffffu;
  const cuuint64_t dims[3] = {cuuint64_t(kHeadDimK), cuuint64_t(PAGE_SIZE), cuuint64_t(pages)};
  const cuuint64_t strides[2] = {cuuint64_t(token_bytes), cuuint64_t(page_bytes)};
  const cuuint32_t box[3] = {cuuint32_t(kSubTileCols), cuuint32_t(kBlockN), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType dtype = kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                    : std::is_same<Cache, cutlass::bfloat16_t>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, dtype, 3, const_cast<void*>(a.kv_cache), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, kFp8 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}
#endif

// Variants with a short-split kernel (constants.cuh MLA_FP8_SHORT_SPLIT_KEYS): fp8 split variants of
// the 64-row path.
template <class Cache, int NUM_HEADS, bool SPLIT>
constexpr bool kHasShortKernel = MLA_FP8_SHORT_SPLIT_KEYS > 0 && CacheTypes<Cache>::kFp8 && !kUseSt<NUM_HEADS, CacheTypes<Cache>::kFp8> && SPLIT;
// Sets up and launches the short-split kernel; defined in short_split.cuh and compiled in the variant's
// second unit (<variant>_short.cu), so this one never instantiates that kernel.
template <class Cache, int NUM_HEADS, int PAGE_SIZE>
cudaError_t launch_short_split(const DecodeParams& p, dim3 grid, cudaStream_t stream);

// Launches one decode kernel whose CTA holds a Storage in dynamic shared memory (+ 1 KiB of room to
// align it to 1024 bytes): the main kernel, the fp8 short-split one and the 64-row one of 17..32 heads.
template <class Storage, class Kernel>
cudaError_t launch_decode_kernel(Kernel kernel, const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  static_assert(sizeof(Storage) + 1024 <= 227 * 1024, "shared memory per CTA");
  const int smem_bytes = int(sizeof(Storage)) + 1024;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Storage::kThreads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// Variants with a 64-row kernel beside their transposed one (constants.cuh MLA_ST32_MIN_KEYS): bf16 /
// fp16 variants of 17..32 heads.
template <class Cache, int NUM_HEADS>
constexpr bool kHasRows64Kernel = MLA_ST32_MIN_KEYS > 0 && !CacheTypes<Cache>::kFp8 && kRowBlock<NUM_HEADS, false> == 32;
// Sets up and launches that kernel; defined in rows64.cuh and compiled in the variant's second unit
// (<variant>_rows64.cu).
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
cudaError_t launch_rows64(const DecodeParams& p, dim3 grid, cudaStream_t stream);

// The most keys one split of this launch can get: split_range's whole tiles per split for the longest
// request the caller announces (max_seq_len, when set and below the block table's capacity) or the
// block table can address. A performance choice only: either kernel is exact for any seq_lens.
inline int64_t short_split_keys(const MlaDecodeArgs& a, int page_size) {
  const int64_t capacity = int64_t(a.max_pages_per_seq) * page_size;
  const int64_t bound = a.max_seq_len > 0 && a.max_seq_len < capacity ? a.max_seq_len : capacity;
  const int64_t tiles = (bound + kBlockN - 1) / kBlockN;
  return (tiles + a.num_kv_splits - 1) / a.num_kv_splits * kBlockN;
}

template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
int launch(const MlaDecodeArgs* args) {
  static_assert(NUM_HEADS >= 1 && PAGE_SIZE >= 1, "variant fields must be positive");
  if (args == nullptr || args->abi_version != MLA_ABI_VERSION) return int(cudaErrorInvalidValue);
  const MlaDecodeArgs& a = *args;
  if (a.batch < 0 || a.q_len < 1 || a.num_heads < 1 || a.num_heads > NUM_HEADS || a.num_kv_splits < 1 ||
      a.num_kv_splits > 65535 || (!SPLIT && a.num_kv_splits != 1) || a.max_pages_per_seq < 1 || a.max_seq_len < 0) {
    return int(cudaErrorInvalidValue);
  }
  if (CacheTypes<Cache>::kFp8 && a.k_scale_ptr == nullptr && !(a.k_scale > 0.f && a.k_scale < INFINITY)) {
    return int(cudaErrorInvalidValue);
  }
  if (a.batch == 0) return int(cudaSuccess);
  // A balanced schedule (schedule.cuh) runs on split variants of the 64-row path with 16-bit caches.
  const bool scheduled = a.schedule != nullptr;
  if (scheduled && (!SPLIT || !kSchedulable<Cache, NUM_HEADS> || a.sched_ctas < 1 ||
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
  constexpr int kRows = kRowBlock<NUM_HEADS, CacheTypes<Cache>::kFp8>;  // 64, or 8 / 16 / 32 on the transposed path (MLA_ST)
  // 17..32-head 16-bit variants: the 64-row kernel when every split is short (MLA_ST32_MIN_KEYS).
  bool rows64 = false;
  if constexpr (kHasRows64Kernel<Cache, NUM_HEADS>) {
    rows64 = short_split_keys(a, PAGE_SIZE) < MLA_ST32_MIN_KEYS;
  }
  const int rows = rows64 ? kBlockM : kRows;
  p.num_m_blocks = (NUM_HEADS * a.q_len + rows - 1) / rows;
  p.scale_log2 = a.softmax_scale * kLog2e;
#if MLA_TRACE
  p.trace = trace_buffer_for_launch();
#endif
  // fp8 split variants of the 64-row path: the short-split kernel when every split is short.
  bool short_split = false;
  if constexpr (kHasShortKernel<Cache, NUM_HEADS, SPLIT>) {
    short_split = short_split_keys(a, PAGE_SIZE) <= MLA_FP8_SHORT_SPLIT_KEYS;
  }
#if MLA_TMA
  p.use_tma = 0;
  p.kv_map = CUtensorMap{};
  // MLA_FP8_TMA's map serves the 64-token fp8 kernel only, not the short-split one.
  if constexpr (kTmaPages<Cache, PAGE_SIZE, kBlockM>) {
    if (!short_split && rows == kBlockM) {
      p.use_tma = encode_kv_map<Cache, PAGE_SIZE>(a, &p.kv_map) ? 1 : 0;
      if (!p.use_tma && tma_required()) return int(cudaErrorNotSupported);
    }
  }
#endif
  const int64_t grid_x = int64_t(p.num_m_blocks) * (scheduled ? a.sched_ctas : a.batch);
  const unsigned grid_y = scheduled ? 1u : unsigned(a.num_kv_splits);
  if (grid_x > 0x7fffffff) return int(cudaErrorInvalidConfiguration);

  // The combine's grid, checked before anything is launched. Uniform split: per (request, query
  // token, head) row, one warp for 2-8 splits (kCombineWarpRows rows per CTA), one CTA for 9-31 (four
  // warps, one per 128 columns, for 9-16),
  // kCombineWideGroups CTAs for 32 or more (below). Scheduled: one CTA per row of the most requests that can be shared
  // (schedule.cuh), at most kCombineCtasPerSm per SM of the decode grid (its CTAs stride over the
  // schedule's list); none when one CTA covers the batch.
  const int64_t rows_per_req = int64_t(a.q_len) * a.num_heads;
  const int64_t combine_rows =
      !combine ? 0
      : scheduled ? min(rows_per_req * min(int64_t(a.batch), int64_t(a.sched_ctas) - 1),
                        int64_t(kCombineCtasPerSm) * grid_x)
                  : int64_t(a.batch) * rows_per_req;
  const bool wide_combine = !scheduled && a.num_kv_splits >= kCombineWideMinSplits;
  if (combine_rows * (wide_combine ? kCombineWideGroups : 1) > 0x7fffffff) return int(cudaErrorInvalidConfiguration);

  auto kernel = mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>;
  if constexpr (SPLIT && kSchedulable<Cache, NUM_HEADS>) {
    if (scheduled) kernel = mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT, true>;
  }
  const dim3 grid(unsigned(grid_x), grid_y, 1);
  cudaError_t err = cudaSuccess;
  if (short_split) {
    if constexpr (kHasShortKernel<Cache, NUM_HEADS, SPLIT>) err = launch_short_split<Cache, NUM_HEADS, PAGE_SIZE>(p, grid, stream);
  } else if (rows64) {
    if constexpr (kHasRows64Kernel<Cache, NUM_HEADS>) err = launch_rows64<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>(p, grid, stream);
  } else {
    err = launch_decode_kernel<KernelStorage<Cache, kRows>>(kernel, p, grid, stream);
  }
  if (err != cudaSuccess) return int(err);

  if (combine_rows > 0) {
    using Out = typename CacheTypes<Cache>::Out;
    using P = Partial<Out, NUM_HEADS>;  // the decode kernel's partials (kernel.cuh)
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
    } else if (wide_combine) {  // column groups of a row, 8 warps over the splits (combine.cuh)
      combine_kernel = mla_combine_wide_kernel<Out, P>;
      rows *= kCombineWideGroups;
      threads = 32 * kCombineWideWarps;
    }
#if MLA_PDL
    // A programmatic dependent launch: set up while the decode grid finishes; the decode CTAs allow
    // it only after their stores (kernel.cuh allow_dependent_launch), so no combine CTA can wait on
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
#else
    // A plain launch (docs/perf-notes.md, v3: an early-triggered dependent launch lost up to 18 us).
    combine_kernel<<<unsigned(rows), threads, 0, stream>>>(a);
    err = cudaGetLastError();
#endif
  }
  return int(err);
}

}  // namespace mla
