// Shared-memory layouts and tensor-core tilings of the MLA decode kernel.
//
// Every tile is K-major with the 128-byte swizzle that wgmma reads: a 1024-byte atom holds 8 rows of
// 64 16-bit values, and the 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Atoms are
// laid out column-block-major (all row blocks of columns 0..63, then columns 64..127, ...), which is
// what CuTe's tile_to_shape gives. The same KV tile is read twice:
//   as K   (tokens x 576, K-major) for S = Q K^T, and
//   as V^T (512 x tokens, MN-major) for O += P V: the MN-major atom of 64 values x 8 tokens is the
//   K-major atom of 8 tokens x 64 values, so V needs no second copy (tile_to_shape with Step<_2,_1>
//   puts the token blocks innermost, matching the K layout).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <type_traits>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include "constants.cuh"

namespace mla {

using namespace cute;

template <class Element>
struct KernelLayouts {
  using SmemLayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{}));
  using SmemLayoutP =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // S[64 x 64] = Q[64 x 576] K^T, the whole tile by one warpgroup ("seesaw" consumer).
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDimK>>>()));
  // O[64 x 256] += P[64 x 64] V_half[64 x 256], one warpgroup per half of the 512 output columns.
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kHeadDimV / kNumWarpgroups>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>()));
};

// What a cache dtype computes in. bf16 and fp16 caches run the tensor cores in their own type. An fp8
// e4m3 cache is widened to fp16 in shared memory by the producer (exact: every e4m3 value is an fp16
// value); q (bf16) is converted to fp16 times kFp8QPrescale on load (exact unless |q| < 2^-6, where
// fp16 subnormals keep fewer bits; the factor keeps |q| up to 2^24 finite) and out is bf16. The raw
// fp8 bytes of a slot land in the upper half of that same fp16 slot and are widened in place
// (producer.cuh), so fp8 keeps the two fp16 stages of the other dtypes.
template <class Cache>
struct CacheTypes {
  using Mma = Cache;
  using Q = Cache;
  using Out = Cache;
  static constexpr bool kFp8 = false;
};
template <>
struct CacheTypes<cutlass::float_e4m3_t> {
  using Mma = cutlass::half_t;
  using Q = cutlass::bfloat16_t;
  using Out = cutlass::bfloat16_t;
  static constexpr bool kFp8 = true;
};
constexpr float kFp8QPrescale = 1.f / 256.f;

// 72 KiB Q + 2 x 72 KiB KV ring + row statistics and barriers: 216 KiB, one CTA per SM. Sub-tile c of
// a KV stage (columns 64c .. 64c+63 of all 64 tokens) is the contiguous 8 KiB at byte offset c * 8192,
// because the swizzle atoms are laid out column-block-major. The consumer writes a tile's P into the
// tile's own RoPE sub-tile (read by S only, and P has the same 64 x 64 swizzled layout).
template <class Cache>
struct SharedStorage {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  alignas(1024) Element q[kBlockM * kHeadDimK];
  alignas(1024) Element kv[kStages][kBlockN * kHeadDimK];
  float row_max[kNumWarpgroups][kBlockM];  // row maxima passed between the math warpgroups
  float row_sum[kNumWarpgroups][kBlockM];  // each warpgroup's row sums, combined at the end
  uint64_t q_full;                         // Q has landed (one arrival per producer thread)
  uint64_t kv_full[kStages * kSubTiles];   // slot stage * kSubTiles + c has landed (fp8: widened)
  uint64_t kv_empty[kStages * kSubTiles];  // every math warp that reads the slot is done
  uint64_t raw_full[Types::kFp8 ? kStages * kSubTiles : 1];  // fp8: the slot's raw bytes have landed
};

// The RoPE sub-tile of a KV stage, where the two-stage consumer keeps the tile's P.
template <class Element>
__device__ __forceinline__ Element* stage_p(Element* stage) {
  return stage + (kSubTiles - 1) * kBlockN * kSubTileCols;
}

// Byte offset of element (row, col) in a K-major, 128-byte-swizzled tile of `rows` rows (a multiple
// of 8) of 16-bit values; must agree with tile_to_shape(Layout_K_SW128_Atom, (rows, cols)).
__device__ __forceinline__ uint32_t swizzled_offset(int row, int col, int rows) {
  const uint32_t atom = uint32_t(row >> 3) + uint32_t(col >> 6) * uint32_t(rows >> 3);
  const uint32_t chunk = uint32_t((col & 63) >> 3) ^ uint32_t(row & 7);
  return atom * 1024u + uint32_t(row & 7) * 128u + chunk * 16u + uint32_t(col & 7) * 2u;
}

}  // namespace mla
