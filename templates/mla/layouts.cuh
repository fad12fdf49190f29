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

#include "config.cuh"

namespace mla {

using namespace cute;

// kTileN: KV tokens per tile, kBlockN (64) except in the short-split fp8 kernel (kShortTileN, 32). P
// (64 x kTileN) is one 128-byte swizzle atom wide at 64 tokens and a 64-byte one at 32 (p_offset).
template <class Element, int kTileN = kBlockN>
struct KernelLayouts {
  static_assert(kTileN == 64 || kTileN == 32, "tile width");
  using SmemLayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kTileN>, Int<kHeadDimK>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDimV>, Int<kTileN>>{}, Step<_2, _1>{}));
  using SmemLayoutP = decltype(tile_to_shape(
      std::conditional_t<kTileN == 64, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>{},
      Shape<Int<kBlockM>, Int<kTileN>>{}));

  // S[64 x kTileN] = Q[64 x 576] K^T, the whole tile by one warpgroup ("seesaw" consumer).
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kTileN>, Int<kHeadDimK>>>()));
  // O[64 x 256] += P[64 x kTileN] V_half[kTileN x 256], one warpgroup per half of the 512 output columns.
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kHeadDimV / kNumWarpgroups>, Int<kTileN>>,
                           GMMA::Major::K, GMMA::Major::MN>()));
};

// The 64-row path: 72 KiB Q + 2 x 72 KiB KV ring (kShort, the short-split fp8 kernel: 4 x 36 KiB of 32 tokens) + row statistics
// and barriers: 216 KiB, one CTA per SM. Sub-tile c of a KV stage (columns 64c .. 64c+63 of all 64
// tokens) is the contiguous 8 KiB at byte offset c * 8192 (4 KiB at c * 4096 for 32 tokens),
// because the swizzle atoms are laid out column-block-major. The consumer writes a tile's P into the
// tile's own RoPE sub-tile (read by S only; P is 64 x 64 in the same swizzle, or 64 x 32 in the
// 64-byte one: p_offset).
template <class Cache, bool kShort = false>
struct SharedStorage {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  static_assert(!kShort || Types::kFp8, "short tiles: the fp8 kernel of short splits (config.cuh)");
  static constexpr int kRowsPerCta = kBlockM;
  static constexpr int kTileN = kShort ? kShortTileN : kBlockN;  // KV tokens per tile
  static constexpr int kRing = kShort ? kShortStages : kStages;  // tile t in stage t % kRing
  static constexpr bool kRegWiden = false;  // fp8: the producer's widening warps widen in shared memory
  // setmaxnreg budgets (config.cuh)
  static constexpr uint32_t kProducerRegsUsed = Types::kFp8 ? kProducerRegsFp8 : kProducerRegs;
  static constexpr uint32_t kMathRegsUsed = Types::kFp8 ? kMathRegsFp8 : kMathRegs;
  alignas(1024) Element q[kBlockM * kHeadDimK];
  alignas(1024) Element kv[kRing][kTileN * kHeadDimK];
  float row_max[kNumWarpgroups][kBlockM];  // row maxima passed between the math warpgroups
  float row_sum[2][kNumWarpgroups][kBlockM];  // each warpgroup's row sums, combined at the end
                                              // (two buffers: a scheduled CTA's segments alternate)
  uint64_t q_full;                         // Q has landed (one arrival per producer thread)
  uint64_t q_empty;                        // a scheduled CTA's math warps are done with Q (8 arrivals)
  uint64_t kv_full[kRing * kSubTiles];   // slot stage * kSubTiles + c has landed (fp8: widened)
  uint64_t kv_empty[kRing * kSubTiles];  // every math warp that reads the slot is done
  uint64_t raw_full[Types::kFp8 ? kRing * kSubTiles : 1];  // fp8: the slot's raw bytes have landed
  // fp8: raw row m of a slot sits at kRawSlotOffset + 64 m (the fp16 slot's upper half); its copies
  // arrive on raw_full (the widening warps then arrive on kv_full).
  static constexpr uint32_t kRawSlotOffset = kTileN * kSubTileCols;
  static constexpr int kMathWgs = kNumWarpgroups;
  static constexpr int kThreads = kProducerThreads + 128 * kMathWgs;
  __device__ uint64_t* raw_landed(int slot) { return &raw_full[slot]; }
  __host__ __device__ static constexpr int raw_chunk_offset(int row, int chunk) { return row * kSubTileCols + 16 * chunk; }
};

// The transposed path (consumer_st.cuh) for kRows = 8, 16 or 32 query rows per CTA. Tokens sit on wgmma
// M = 64 and query rows on N = kRows:
//   S^T[64 x kRows]  = K[64 x 576] Q^T: A = the KV tile as K (SmemLayoutKV), B = Q (kRows x 576),
//                      both K-major;
//   O^T[512 x kRows] += V^T[512 x 64] P^T[64 x kRows]: A = the same KV stage as V^T (SmemLayoutVt,
//                      MN-major), B = P^T stored as kRows x 64 (K-major, element (n, token)); one
//                      warpgroup covers all 512 rows of O^T as 8 atoms of 64 along M.
template <class Element, int kRows>
struct StLayouts {
  static_assert(kRows == 8 || kRows == 16 || kRows == 32, "wgmma n8 / n16 / n32");
  using SmemLayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kRows>, Int<kHeadDimK>>{}));
  using SmemLayoutPt =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kRows>, Int<kBlockN>>{}));
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kRows>, Int<kHeadDimK>>>()));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kRows>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::K>()));
};

// Shared memory of the transposed path, bf16/fp16 (fp8: SharedStorageStFp8 below): Q (kRows x 576,
// 18 KiB at 16 rows), the same 2 x 9-slot KV ring as SharedStorage (each stage now read by one
// warpgroup only), a P^T tile per math warpgroup,
// the per-warp column statistics of each warpgroup (max during the loop, sums at the end), and an
// fp32 [kRows][512] exchange buffer where the two warpgroups' O^T are merged and transposed back to
// row-major for coalesced stores. Its row stride is padded by 4 floats so that the scattered
// accumulator writes (row n = 2 * (lane % 4) + ..., column d = lane / 4 + ...) hit 32 distinct banks.
// (The fp8 register path's row order, d = 128 warp + 16 (lane / 4) + ..., does not; merge_st writes it
// as swizzled float4 instead, kMergeV4 in consumer_st.cuh.)
// At 32 rows the exchange buffer (66 KiB) does not fit beside Q (36 KiB) and the ring (144 KiB), so it
// takes the ring's first bytes (kOxInRing): merge_st writes it only after both math warpgroups passed
// their loops (kBarStMerge), when every tile has landed (cp.async, waited for by the producer before
// its arrival on kv_full) and every wgmma that read a stage has completed (warpgroup_wait<0>).
constexpr int kOxStride = kHeadDimV + 4;
// Q, the ring, P^T and o_x of SharedStorageSt (a base, so that the members keep their order and names).
template <class Element, int kRows, bool kOxInRing = (kRows > 16)>
struct StOperands {
  alignas(1024) Element q[kRows * kHeadDimK];
  alignas(1024) Element kv[kStages][kBlockN * kHeadDimK];
  alignas(1024) Element pt[kNumWarpgroups][kRows * kBlockN];  // P^T of the warpgroup's current tile
  alignas(16) float o_x[kRows * kOxStride];                   // merged O (row n at n * kOxStride)
};
template <class Element, int kRows>
struct StOperands<Element, kRows, true> {
  alignas(1024) Element q[kRows * kHeadDimK];
  union {
    alignas(1024) Element kv[kStages][kBlockN * kHeadDimK];
    alignas(16) float o_x[kRows * kOxStride];  // merged O, in the idle ring (merge_st)
  };
  alignas(1024) Element pt[kNumWarpgroups][kRows * kBlockN];
  static_assert(kRows * kOxStride * 4 <= kStages * kBlockN * kHeadDimK * 2, "o_x fits in the ring");
};
template <class Cache, int kRows>
struct SharedStorageSt : StOperands<typename CacheTypes<Cache>::Mma, kRows> {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  static constexpr int kRowsPerCta = kRows;
  static constexpr int kRing = kStages;
  static constexpr bool kRegWiden = false;
  static constexpr uint32_t kProducerRegsUsed = kProducerRegsSt;
  static constexpr uint32_t kMathRegsUsed = kMathRegsSt;
  static constexpr int kMathWgs = kNumWarpgroups;
  static constexpr int kThreads = kProducerThreads + 128 * kMathWgs;
  static_assert(!Types::kFp8, "fp8 caches on the transposed path use SharedStorageStFp8");
  float col_stat[kNumWarpgroups][4][kRows];  // per warp of a warpgroup: column max (loop), sum (end)
  float wg_max[kNumWarpgroups][kRows];       // each warpgroup's final running max per column
  uint64_t q_full;
  uint64_t kv_full[kStages * kSubTiles];
  uint64_t kv_empty[kStages * kSubTiles];  // 4 arrivals: the owning warpgroup's warps
  float row_out[2][kRows];  // per query row: output scale (v_scale / l) and lse (merge_st)
};

// Shared memory of the transposed path for fp8 caches: the ring holds raw e4m3
// bytes only (slot c of a stage: 64 tokens x 64 values, token m at byte 64 m, 4 KiB; a stage 36 KiB),
// four stages, stage t % 4 for tile t (with two math warpgroups each alternates between two of them;
// with three, Storage::kMathWgs, the stages rotate among them); at 32 rows three stages and two math
// warpgroups (the stages rotate). Q is
// fp16 in the transposed path's layout but with its 576 values permuted within each 64-value block
// (producer.cuh st_q_dim), the order in which a thread's register fragment of K holds them.
// Before the first tile o_x stages Q's bf16 rows (row-major, 1152 bytes a row) for that permutation:
// the producer arrives on q_full once they have landed, and the math threads wait for it and read the
// staging bytes (convert_q_st_fp8) before they meet at kBarStQ, so o_x is written only in merge_st,
// after both. A CTA without tiles copies no Q.
// Byte offset of raw row `row`'s 16-byte chunk `chunk` (values 16 chunk .. 16 chunk + 15) in a 4 KiB
// slot of the transposed fp8 ring: rows of 64 bytes, chunks swizzled by (row >> 1) & 3, so that the
// V^T loads of a quarter warp hit distinct bank groups (rows 8 apart share a position).
__host__ __device__ __forceinline__ constexpr int raw_offset(int row, int chunk) {
  return row * kSubTileCols + 16 * (chunk ^ ((row >> 1) & 3));
}

template <int kRows>
struct SharedStorageStFp8 {
  using Types = CacheTypes<cutlass::float_e4m3_t>;
  using Element = cutlass::half_t;
  static constexpr int kRowsPerCta = kRows;
  static constexpr int kTileN = kBlockN;
  // 32 rows: three stages and two math warpgroups (Q 36 KiB + ring 108 KiB + P^T 8 KiB + o_x 66 KiB).
  static constexpr int kRing = kRows > 16 ? kStagesStFp8Rows32 : kStagesStFp8;
  static constexpr bool kRegWiden = true;  // the math warpgroups convert fp8 in registers (consumer_st_fp8.cuh)
  static constexpr int kMathWgs = kRows > 16 ? 2 : kStMathWgsFp8;  // tile t belongs to warpgroup t % kMathWgs
  // consume_st_regs waits on a stage's full barrier by parity: sound only if the fill of tile t - kRing
  // completed before the warpgroup's previous tile t - kMathWgs, or is the warpgroup's own previous
  // tile (kRing == kMathWgs) (tests/design/st_ring_protocol_sim.py).
  static_assert(kRing >= kMathWgs, "at least as many stages as math warpgroups");
  static constexpr int kThreads = kProducerThreads + 128 * kMathWgs;
  static constexpr uint32_t kProducerRegsUsed =
      kMathWgs == 3 ? kProducerRegsSt3 : kRows > 16 ? kProducerRegsSt32Fp8 : kProducerRegsSt;
  static constexpr uint32_t kMathRegsUsed = kMathWgs == 3 ? kMathRegsSt3 : kRows > 16 ? kMathRegsSt32Fp8 : kMathRegsSt;
  static_assert(regs_fit(kProducerRegsUsed, kMathRegsUsed, kMathWgs), "register file");
  alignas(1024) Element q[kRows * kHeadDimK];
  alignas(1024) uint8_t kv[kRing][kSubTiles][kBlockN * kSubTileCols];
  alignas(1024) Element pt[kMathWgs][kRows * kBlockN];
  alignas(16) float o_x[kRows * kOxStride];
  float col_stat[kMathWgs][4][kRows];
  float wg_max[kMathWgs][kRows];
  int key_limit[kMathWgs * 4][kRows];  // three warpgroups or 32 rows: per math warp, each column's mask limit
  float row_out[2][kRows];  // per query row: output scale (v_scale / l) and lse (store_rows_st_to)
  uint64_t q_full;
  uint64_t kv_full[kRing * kSubTiles];   // 128 arrivals: every producer thread's copies of the slot
  uint64_t kv_empty[kRing * kSubTiles];  // 4 arrivals: the owning warpgroup's warps
  static_assert(kRows * kHeadDimK * 2 <= kRows * kOxStride * 4, "o_x stages Q's bf16 rows");
  // Raw row m of a slot at byte 64 m; the copies arrive on kv_full (nobody widens in shared memory).
  static constexpr uint32_t kRawSlotOffset = 0;
  __device__ uint64_t* raw_landed(int slot) { return &kv_full[slot]; }
  __host__ __device__ static constexpr int raw_chunk_offset(int row, int chunk) { return raw_offset(row, chunk); }
};

// The shared storage of a kernel with ROWS query rows per CTA: kBlockM the 64-row path (kShort: its
// short-split fp8 kernel), 8 / 16 / 32 the transposed one.
template <class Cache, int ROWS, bool kShort = false>
using KernelStorage = std::conditional_t<
    ROWS != kBlockM,
    std::conditional_t<CacheTypes<Cache>::kFp8, SharedStorageStFp8<ROWS>, SharedStorageSt<Cache, ROWS>>,
    SharedStorage<Cache, kShort>>;

// The RoPE sub-tile of a KV stage of kTileN tokens, where the seesaw consumer keeps the tile's P.
template <int kTileN = kBlockN, class Element>
__device__ __forceinline__ Element* stage_p(Element* stage) {
  return stage + (kSubTiles - 1) * kTileN * kSubTileCols;
}

// Byte offset of element (row, col) in a K-major, 128-byte-swizzled tile of `rows` rows (a multiple
// of 8) of 16-bit values; must agree with tile_to_shape(Layout_K_SW128_Atom, (rows, cols)).
__host__ __device__ __forceinline__ uint32_t swizzled_offset(int row, int col, int rows) {
  const uint32_t atom = uint32_t(row >> 3) + uint32_t(col >> 6) * uint32_t(rows >> 3);
  const uint32_t chunk = uint32_t((col & 63) >> 3) ^ uint32_t(row & 7);
  return atom * 1024u + uint32_t(row & 7) * 128u + chunk * 16u + uint32_t(col & 7) * 2u;
}

// Byte offset of element (row, col) of P (kBlockM x kTileN, KernelLayouts::SmemLayoutP): at 64 tokens the
// 128-byte swizzle above; at 32 the 64-byte one (atoms of 8 rows x 32 values stacked along the rows,
// 16-byte chunk c of row r at chunk position c ^ ((r >> 1) & 3)).
template <int kTileN>
__host__ __device__ __forceinline__ uint32_t p_offset(int row, int col) {
  if constexpr (kTileN == 64) {
    return swizzled_offset(row, col, kBlockM);
  } else {
    const uint32_t chunk = uint32_t(col >> 3) ^ uint32_t((row >> 1) & 3);
    return uint32_t(row) * 64u + chunk * 16u + uint32_t(col & 7) * 2u;
  }
}

}  // namespace mla
