// Host side of the TMA path: the tensor maps of a paged KV cache that the 64-row kernels load full
// tiles with (config.cuh kTmaPages; producer.cuh tma_full_tiles, and fp8_fast.cuh produce).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "abi.h"
#include "config.cuh"

namespace mla {

// cuTensorMapEncodeTiled, found once through the runtime's driver entry point (the library links only
// the CUDA runtime, never libcuda), or null when the driver does not offer it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
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
// fp8: the same map over bytes, without swizzle (the raw rows of a slot are row-major); the fast kernel's
// (Fp8FastCache): box {128 bytes, 64, 1} with the 128-byte swizzle, one K-major slot of its tile
// (fp8_fast.cuh), the fifth box's bytes past 576 zero-filled.
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
  constexpr bool kFast = CacheTypes<Cache>::kFast;
  const cuuint32_t box[3] = {cuuint32_t(kFast ? 128 : kSubTileCols), cuuint32_t(kBlockN), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType dtype = kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                    : std::is_same<Cache, cutlass::bfloat16_t>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, dtype, 3, const_cast<void*>(a.kv_cache), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            kFp8 && !kFast ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace mla
