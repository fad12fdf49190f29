// The MLA decode kernel body: one CTA computes attention for one block of 64 query rows
// (q_len x num_heads) of one request over one split of its keys.
//
// Math (FlashAttention-2 online softmax, Dao 2023, with the MLA latent cache of DeepSeek-V2,
// arXiv:2405.04434): for query row i, s_ij = softmax_scale * <q_i, k_j> over the 576 values,
// p_ij = exp(s_ij - m_i), o_i = sum_j p_ij v_j / sum_j p_ij, lse_i = m_i + log(sum_j p_ij).
// Scores live in the exp2 domain (scale folded with log2 e); masked scores are -inf and a row whose
// max is still -inf subtracts 0, so no inf - inf can appear; KV rows past the split are zero in shared
// memory, so a NaN in an unused cache slot never meets a zero probability.
//
// Structure per CTA (384 threads = 3 warpgroups, warp-specialized):
//   - warpgroup 0 (producer, producer.cuh, 40 registers; fp8 80) gathers Q once and then the KV tiles through
//     block_table with 16-byte cp.async (bf16/fp16 with pages of 64 or 128 tokens: full tiles with TMA) into a ring of 2 tiles x 9 sub-tiles of 64 columns; each
//     sub-tile slot has a "full" mbarrier (the copies landed) and an "empty" one (every math warp that
//     reads it is done), so loads for tile t+2 start as soon as the slots of tile t are released;
//   - math warpgroups 1 and 2 (consumer.cuh, 232 registers; fp8 208) compute S = Q K^T with wgmma, starting on
//     each 64-column sub-tile as it lands, the online softmax, and O += P V; warpgroup w owns
//     O[:, 256w : 256w+256] in registers. The two warpgroups own alternate tiles' S and
//     softmax and hand the row max over ("seesaw"); fp8 caches widen to fp16 in the same slots
//     (two producer warps widen in place);
//   - the epilogue below adds the two warpgroups' row sums and writes out and lse (or the split
//     workspace).
// With MLA_ST (default) variants of at most 16 heads, and those of 17..32 (MLA_ST32), take the
// transposed path instead (consumer_st.cuh): blocks of 8, 16 or 32 query rows, S^T = K Q^T with tokens on wgmma M, each math
// warpgroup owning whole tiles, the two partial softmaxes merged through shared memory at the end
// (store_rows_st). For bf16 / fp16 the producer and the KV ring are the same (cp.async only, no TMA);
// only Q's row count differs. fp8 caches there keep raw e4m3 bytes in a 4-stage ring and the math
// warpgroups convert them in registers for register-sourced wgmma (consumer_st_regs.cuh). Register
// budgets on this path: 56 (producer) / 224 (math); the fp8 variants there run three math warpgroups
// (MLA_FP8_ST_WGS, 512 threads, 56 / 152), tile t owned by warpgroup t % 3, their three partial
// softmaxes merged the same way; with 32 rows (17..32 heads) two (40 / 232) and a 3-stage ring. The
// 17..32-head bf16/fp16 variants also instantiate the 64-row kernel (ROWS = kBlockM, rows64.cuh) for
// launches whose splits are short (MLA_ST32_MIN_KEYS).
// Rows are ordered qi * NUM_HEADS + h; rows with h >= num_heads or qi >= q_len are padding (Q zero,
// never stored).
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the library does not link libcuda)
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "abi.h"
#include "constants.cuh"
#include "layouts.cuh"
#include "primitives.cuh"
#include "consumer.cuh"
#include "consumer_st.cuh"
#include "consumer_st_regs.cuh"
#include "producer.cuh"
#include "schedule.cuh"
#include "trace.cuh"

namespace mla {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Kernel parameters: the ABI struct plus values derived once on the host.

struct DecodeParams {
  MlaDecodeArgs a;
  int num_m_blocks;     // ceil(NUM_HEADS * q_len / ROWS) of the launched kernel (launch.cuh)
  float scale_log2;     // softmax_scale * log2(e)
#if MLA_TMA
  // kTmaPages variants: use_tma = 1 when the host encoded kv_map (launch.cuh), else every tile takes
  // the cp.async path. kv_map: the cache as {576 values, PAGE_SIZE tokens, pages}, box {64, 64, 1},
  // 128-byte swizzle (fp8, MLA_FP8_TMA: bytes, no swizzle). CUtensorMap is 64-byte aligned (128 with CUDA 13's headers), so is DecodeParams; the kernel takes it as a
  // __grid_constant__ parameter, which TMA reads through its generic address.
  int use_tma;
  CUtensorMap kv_map;
#endif
#if MLA_TRACE
  uint64_t* trace;      // the library's trace buffer (trace.cuh), or null
#endif
};

// The calling CTA's phase-trace sink for thread `thread` (trace.cuh); a no-op unless MLA_TRACE.
__device__ __forceinline__ TraceSink trace_at(const DecodeParams& p, int thread) {
#if MLA_TRACE
  return trace_sink(p.trace, thread);
#else
  return TraceSink{nullptr};
#endif
}

// Where the split-KV partial results live inside the workspace: one [q_len, num_heads] block of rows
// per piece. Uniform split: piece split * batch + b; balanced schedule: the pieces schedule.cuh numbers,
// at most batch + sched_ctas - 1 (the workspace holds batch + sched_ctas).
// The partial outputs' element type of a variant with NUM_HEADS heads: the output's 16-bit type or
// fp32 (MLA_PARTIAL_16, constants.cuh). The workspace keeps its fp32 size and layout either way (the
// o region is then half used). The decode kernel and its combine take it from the same template
// arguments (launch.cuh), so they cannot disagree.
template <class Out, int NUM_HEADS>
using Partial = std::conditional_t<kPartial16<NUM_HEADS>, Out, float>;

// P: the partial outputs' element type (Partial).
template <class P>
struct SplitWorkspace {
  P* o;        // [pieces, q_len, num_heads, 512], already divided by the row sum
  float* lse;  // [pieces, q_len, num_heads], natural log, -inf for a piece that saw no key
};

// Eight consecutive partial values (a thread's share of a transposed-path row): two float4, or one
// 16-byte word of packed 16-bit values.
template <class P>
__device__ __forceinline__ void store_partial8(P* dst, float4 lo, float4 hi) {
  if constexpr (std::is_same_v<P, float>) {
    reinterpret_cast<float4*>(dst)[0] = lo;
    reinterpret_cast<float4*>(dst)[1] = hi;
  } else {
    *reinterpret_cast<uint4*>(dst) =
        make_uint4(pack2<P>(lo.x, lo.y), pack2<P>(lo.z, lo.w), pack2<P>(hi.x, hi.y), pack2<P>(hi.z, hi.w));
  }
}

// Four consecutive partial values as loaded (float4, or a uint2 of packed 16-bit values) and widened to
// fp32 apart: the combines load every split's words before they widen any.
template <class P>
using PartialWords4 = std::conditional_t<std::is_same_v<P, float>, float4, uint2>;
template <class P>
__device__ __forceinline__ PartialWords4<P> load_partial4(const P* src) {
  if constexpr (std::is_same_v<P, float>) {
    return *reinterpret_cast<const float4*>(src);
  } else {
    uint2 v;
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(src));
    return v;
  }
}
template <class P>
__device__ __forceinline__ PartialWords4<P> zero_partial4() {
  if constexpr (std::is_same_v<P, float>) {
    return make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
    return make_uint2(0u, 0u);
  }
}
template <class P>
__device__ __forceinline__ decltype(auto) widen_partial4(const PartialWords4<P>& v) {
  if constexpr (std::is_same_v<P, float>) {
    return (v);  // the float4 itself: the fp32 combines compile as before
  } else {
    const float2 a = unpack2<P>(v.x), b = unpack2<P>(v.y);
    return make_float4(a.x, a.y, b.x, b.y);
  }
}

__host__ __device__ __forceinline__ int64_t workspace_pieces(const MlaDecodeArgs& a) {
  return a.schedule != nullptr ? int64_t(a.batch) + a.sched_ctas : int64_t(a.num_kv_splits) * a.batch;
}

template <class P>
__host__ __device__ __forceinline__ SplitWorkspace<P> split_workspace(const MlaDecodeArgs& a) {
  const int64_t rows = workspace_pieces(a) * a.q_len * a.num_heads;
  return SplitWorkspace<P>{reinterpret_cast<P*>(a.workspace), a.workspace + rows * kHeadDimV};
}

// Whole kBlockN-key tiles that hold `keys` keys (keys >= 0; no overflow near INT_MAX).
__host__ __device__ __forceinline__ int tiles_of(int keys) { return keys / kBlockN + (keys % kBlockN != 0); }
// The same in a storage's own tiles (SharedStorage::kTileN: 32 in the short-split fp8 kernel). Splits and
// schedules stay in kBlockN units, so a split's keys start at a multiple of either tile.
template <int kTileN>
__host__ __device__ __forceinline__ int tiles_of_n(int keys, int tiles_64) {
  if constexpr (kTileN == kBlockN) {
    return tiles_64;
  } else {
    return keys / kTileN + (keys % kTileN != 0);
  }
}

// The key range [begin, end) that split `split` of a request with `seq_len` keys covers. Every
// split of a request gets the same whole number of kBlockN tiles, so the work divides evenly.
__host__ __device__ __forceinline__ void split_range(int seq_len, int num_splits, int split, int& begin,
                                                     int& end) {
  const int tiles = tiles_of(seq_len);
  const int64_t keys_per_split = int64_t((tiles + num_splits - 1) / num_splits) * kBlockN;
  begin = int(min(int64_t(seq_len), split * keys_per_split));
  end = int(min(int64_t(seq_len), begin + keys_per_split));
}

// ---------------------------------------------------------------------------------------------
// Epilogue: normalised O and lse for the thread's two rows, to `out`/`lse` or to the workspace.

// Row row0 + 8 r of a warpgroup's 64 x 256 block in a 16-bit type T, straight from the accumulators:
// in the accumulator layout lane q = lane % 4 holds 4 bytes (columns 2q, 2q + 1) of
// every 8-column group j, so one store per group writes 16 bytes of a row per quad, half a 32-byte
// sector. Here groups j and j + 1 (32 contiguous bytes) go together: lanes q and q ^ 1 swap one value,
// then lane q stores 8 bytes, bytes 8 (q >> 1) .. + 7 of group j + (q & 1), so a warp instruction
// writes 8 rows x 32 bytes: full sectors and half the store instructions. scripts/store_probe.cu
// (docs/perf-notes.md v3.22): 1.0 us of store issue for one CTA's 64 KiB (1.9 us with 132 CTAs at
// once) against 4.0 (6.6) one group at a time; the scheduled kernel pays it once per segment (its 16-bit
// pieces: 0.925 over 50 balanced anchors at 64/128 heads, v3.22). Every lane of the warp runs
// the shuffles (a divergent shuffle made ptxas serialize the kernel's wgmma, C7520); a lane whose row
// is padding (store == false) only skips its stores. row: the row's first value of the warpgroup's
// 256 columns, 8-byte aligned (out rows and workspace pieces are).
template <class T, class FragO>
__device__ __forceinline__ void store_16_pairs(T* row, bool store, FragO const& o, int r, float inv_sum, int lane) {
  static_assert(sizeof(T) == 2, "16-bit values");
  const int q = lane % 4;
  const bool odd = q & 1;
  constexpr int kPairs = size(FragO{}) / 8;
  uint2 w[kPairs];  // all shuffles first, then the stores under one branch
  CUTE_UNROLL
  for (int k = 0; k < kPairs; ++k) {
    const int j = 2 * k;
    const uint32_t v0 = pack2<T>(o(4 * j + 2 * r) * inv_sum, o(4 * j + 2 * r + 1) * inv_sum);
    const uint32_t v1 = pack2<T>(o(4 * j + 4 + 2 * r) * inv_sum, o(4 * j + 4 + 2 * r + 1) * inv_sum);
    const uint32_t recv = __shfl_xor_sync(0xffffffff, odd ? v0 : v1, 1);  // the value the partner stores
    w[k] = odd ? make_uint2(recv, v1) : make_uint2(v0, recv);
  }
  if (store) {
    uint2* base = reinterpret_cast<uint2*>(row + 8 * int(odd) + 4 * (q >> 1));
    CUTE_UNROLL
    for (int k = 0; k < kPairs; ++k) base[4 * k] = w[k];  // 16 values (32 bytes) per pair
  }
}

// Epilogue straight from the accumulators: the thread's two rows of normalised O and their lse, to
// `out`/`lse` (piece_row -1) or to the workspace piece whose (query 0, head 0) row is piece_row.
// 16-bit rows go in pairs of column groups (store_16_pairs: every split kernel's 16-bit pieces, the
// scheduled kernel's out rows, and a split variant run with one split); fp32 pieces as float2 (4 lanes
// x 8 bytes already fill a sector). Called by every thread of a warp (the shuffles); padding rows store
// nothing.
template <class Out, int NUM_HEADS, class FragO>
__device__ __forceinline__ void store_rows(const DecodeParams& p, int b, int64_t piece_row, int m_block, int wg,
                                           int row0, FragO const& o, const float (&inv_sum)[2],
                                           const float (&lse)[2]) {
  const MlaDecodeArgs& a = p.a;
  const int lane = threadIdx.x % 32;
  using P = Partial<Out, NUM_HEADS>;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int grow = m_block * kBlockM + row0 + 8 * r;
    const int qi = grow / NUM_HEADS;
    const int h = grow % NUM_HEADS;
    const bool valid = qi < a.q_len && h < a.num_heads;  // the same for the four lanes of a row
    if (piece_row >= 0) {
      const SplitWorkspace<P> ws = split_workspace<P>(a);
      const int64_t ws_row = piece_row + int64_t(qi) * a.num_heads + h;
      P* row = ws.o + ws_row * kHeadDimV + wg * (kHeadDimV / kNumWarpgroups);
      if constexpr (std::is_same_v<P, float>) {
        CUTE_UNROLL
        for (int j = 0; j < size(o) / 4; ++j) {
          const float2 v = make_float2(o(4 * j + 2 * r) * inv_sum[r], o(4 * j + 2 * r + 1) * inv_sum[r]);
          if (valid) *reinterpret_cast<float2*>(row + 2 * (lane % 4) + 8 * j) = v;
        }
      } else {
        store_16_pairs<P>(row, valid, o, r, inv_sum[r], lane);
      }
      if (valid && wg == 0 && lane % 4 == 0) ws.lse[ws_row] = lse[r];
    } else {
      Out* row = static_cast<Out*>(a.out) + int64_t(b) * a.out_stride_batch + int64_t(qi) * a.out_stride_token +
                 int64_t(h) * a.out_stride_head + wg * (kHeadDimV / kNumWarpgroups);
      store_16_pairs<Out>(row, valid, o, r, inv_sum[r], lane);
      if (valid && wg == 0 && lane % 4 == 0) {
        a.lse[int64_t(b) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(qi) * a.lse_stride_token] = lse[r];
      }
    }
  }
}

// The same epilogue through shared memory, for the non-split kernels' rows of `out` (in a uniform
// launch the KV ring is idle once both math warpgroups are past kBarEnd). Warpgroup wg stages its
// 64 x 256 block of normalised O in ring stage wg: row-major, 16-byte chunk c of row r at chunk
// c ^ (r % 8), so the accumulator-layout stores (8 rows x 16 bytes per warp) hit 32 distinct banks.
// Then each warp stores one row's 512 contiguous bytes per instruction with 16-byte stores (two
// 8-byte stores where `out` is only 8-byte aligned), against 8 rows x 16 bytes per instruction straight
// from the accumulators (store_rows before v3.22: ~7 us of a 128-head CTA's ~43 us, docs/perf-notes.md
// v3.12; its paired stores, 8 rows x 32 bytes, have not been measured against this staging). Split
// kernels' 16-bit workspace pieces were staged the same way (v3.15) until v3.22, where the paired
// stores measured 0.984 / 0.990 cold and 0.972 / 0.978 in a CUDA graph at 64 / 128 heads (batch 1-32).
template <class T, class FragO>
__device__ __forceinline__ void stage_o(char* stage, int lane, int row0, FragO const& o, const float (&inv_sum)[2]) {
  static_assert(sizeof(T) == 2, "16-bit output types");
  constexpr uint32_t kRowBytes = kHeadDimV / kNumWarpgroups * sizeof(T);
  constexpr uint32_t kGroupBytes = 8 * sizeof(T);  // an 8-column group of the accumulator layout: one chunk
  // Value (row, 8 j + 2 q + e) goes to byte 16 j' + 4 q + 2 e of the row, j' = j ^ (row % 8).
  // row % 8 is the same for both of the thread's rows, so eight base addresses, one per j % 8, serve
  // every store with an immediate offset (unsigned math: no signed-division fixups per store).
  const uint32_t x = (uint32_t(lane) >> 2) & 7u;
  const uint32_t q = uint32_t(lane) & 3u;
  char* base[8];
  CUTE_UNROLL
  for (uint32_t jj = 0; jj < 8; ++jj) base[jj] = stage + uint32_t(row0) * kRowBytes + (jj ^ x) * kGroupBytes + q * 2 * sizeof(T);
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    CUTE_UNROLL
    for (int j = 0; j < size(o) / 4; ++j) {
      char* dst = base[j % 8] + (j / 8) * 8 * kGroupBytes + r * 8 * kRowBytes;
      *reinterpret_cast<uint32_t*>(dst) = pack2<T>(o(4 * j + 2 * r) * inv_sum[r], o(4 * j + 2 * r + 1) * inv_sum[r]);
    }
  }
}
// Row `row` of the staged block -> dst_of(row) (the row's first byte, nullptr for a padding row). A
// rolled loop (4 rows' chunks in flight per trip): the epilogue runs once per CTA, so its code comes
// from DRAM on a cold call (the L2 flushed or thrashed between layers), and fully unrolled copies
// made the kernel ~69 KB larger and split calls ~12 us slower (docs/perf-notes.md v3.12).
// T: the staged values' 16-bit type; chunk c of row r sits at chunk c ^ (r % 8), as stage_o puts it.
template <class T, bool kAligned16, class DstOf>
__device__ __forceinline__ void copy_staged_rows(const char* stage, int tid_wg, DstOf&& dst_of) {
  constexpr uint32_t kRowBytes = kHeadDimV / kNumWarpgroups * sizeof(T);
  constexpr uint32_t kChunks = kRowBytes / 16;  // 32: a warp's 16-byte chunks lie in one row
  constexpr uint32_t kRowStep = 128 / kChunks;  // 4 rows per trip of the warpgroup
  constexpr uint32_t kBatch = 4;
  static_assert(kChunks % 32 == 0 && kBlockM % (kRowStep * kBatch) == 0, "a warp's 32 chunks lie in one row");
  const uint32_t c = uint32_t(tid_wg) % kChunks;
#pragma unroll 1
  for (uint32_t row0 = uint32_t(tid_wg) / kChunks; row0 < kBlockM; row0 += kRowStep * kBatch) {
    uint4 v[kBatch];
    CUTE_UNROLL
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t row = row0 + k * kRowStep;
      v[k] = *reinterpret_cast<const uint4*>(stage + row * kRowBytes + ((c ^ (row % 8)) * 16));
    }
    CUTE_UNROLL
    for (int k = 0; k < kBatch; ++k) {
      char* dst = dst_of(row0 + k * kRowStep);
      if (dst == nullptr) continue;
      if constexpr (kAligned16) {
        *reinterpret_cast<uint4*>(dst + c * 16) = v[k];
      } else {
        reinterpret_cast<uint2*>(dst + c * 16)[0] = make_uint2(v[k].x, v[k].y);
        reinterpret_cast<uint2*>(dst + c * 16)[1] = make_uint2(v[k].z, v[k].w);
      }
    }
  }
}
template <class Out, int NUM_HEADS, class FragO>
__device__ __forceinline__ void store_rows_staged(const DecodeParams& p, char* stage, int b, int m_block, int wg,
                                                  int tid_wg, int row0, FragO const& o, const float (&inv_sum)[2],
                                                  const float (&lse)[2]) {
  const MlaDecodeArgs& a = p.a;
  const int lane = tid_wg % 32;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {  // lse: one thread per row, as in store_rows
    const int grow = m_block * kBlockM + row0 + 8 * r;
    const int qi = grow / NUM_HEADS, h = grow % NUM_HEADS;
    if (wg != 0 || lane % 4 != 0 || qi >= a.q_len || h >= a.num_heads) continue;
    a.lse[int64_t(b) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(qi) * a.lse_stride_token] = lse[r];
  }
  stage_o<Out>(stage, lane, row0, o, inv_sum);
  warpgroup_barrier(kBarOwnP + wg);
  auto dst_of = [&](uint32_t row) -> char* {
    const uint32_t grow = uint32_t(m_block) * kBlockM + row;
    const int qi = int(grow / NUM_HEADS), h = int(grow % NUM_HEADS);
    if (qi >= a.q_len || h >= a.num_heads) return nullptr;
    return reinterpret_cast<char*>(static_cast<Out*>(a.out) + int64_t(b) * a.out_stride_batch +
                                   int64_t(qi) * a.out_stride_token + int64_t(h) * a.out_stride_head +
                                   wg * (kHeadDimV / kNumWarpgroups));
  };
  const bool aligned16 = ((reinterpret_cast<uintptr_t>(a.out) | uintptr_t(a.out_stride_batch) * sizeof(Out) |
                           uintptr_t(a.out_stride_token) * sizeof(Out) | uintptr_t(a.out_stride_head) * sizeof(Out)) %
                          16) == 0;
  if (aligned16) {
    copy_staged_rows<Out, true>(stage, tid_wg, dst_of);
  } else {
    copy_staged_rows<Out, false>(stage, tid_wg, dst_of);
  }
}

// One query row's share of a thread on the transposed path (8 values from d0 on, lo and hi, times
// inv_sum): to the workspace row of (split, b, qi, h) with its lse (kToWs; P the partials' type),
// else to out and lse.
template <class Out, class P, bool kToWs>
__device__ __forceinline__ void store_st_row(const MlaDecodeArgs& a, int b, int split, int qi, int h, int d0, float4 lo,
                                             float4 hi, float inv_sum, float lse) {
  if constexpr (kToWs) {
    const SplitWorkspace<P> ws = split_workspace<P>(a);
    const int64_t ws_row = ((int64_t(split) * a.batch + b) * a.q_len + qi) * a.num_heads + h;
    store_partial8(ws.o + ws_row * kHeadDimV + d0,
                   make_float4(lo.x * inv_sum, lo.y * inv_sum, lo.z * inv_sum, lo.w * inv_sum),
                   make_float4(hi.x * inv_sum, hi.y * inv_sum, hi.z * inv_sum, hi.w * inv_sum));
    if (d0 == 0) ws.lse[ws_row] = lse;
  } else {
    Out* dst = static_cast<Out*>(a.out) + int64_t(b) * a.out_stride_batch + int64_t(qi) * a.out_stride_token +
               int64_t(h) * a.out_stride_head + d0;
    reinterpret_cast<uint2*>(dst)[0] =
        make_uint2(pack2<Out>(lo.x * inv_sum, lo.y * inv_sum), pack2<Out>(lo.z * inv_sum, lo.w * inv_sum));
    reinterpret_cast<uint2*>(dst)[1] =
        make_uint2(pack2<Out>(hi.x * inv_sum, hi.y * inv_sum), pack2<Out>(hi.z * inv_sum, hi.w * inv_sum));
    if (d0 == 0) {
      a.lse[int64_t(b) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(qi) * a.lse_stride_token] = lse;
    }
  }
}

// Epilogue of the transposed path: after merge_st, s.o_x holds each query row's O (unnormalised, on
// the merged max). All math threads store the real rows, 64 threads per row, 8 consecutive values each
// (coalesced; out rows are only 8-byte aligned, hence 8-byte stores), to out/lse or to the workspace
// row store_rows uses. Same conventions as store_rows: a row that saw no key gets out 0 and lse -inf,
// a request with a bad seq_len NaN. A rolled loop, one trip per kRowsPerPass rows, with the destination
// chosen once outside it: the epilogue's code runs once per CTA and comes from DRAM on a cold call,
// and the four unrolled passes that each carried both store paths measured 0.6-1.7 us slower per call
// (docs/perf-notes.md v3.14, v3.15). Each row's v_scale / l and lse come from s.row_out, where
// merge_st's idle warpgroup 0 put them (kRowOutInMerge), or on the fp8 register path where this
// function's first step put them (MLA_ST_ROW_OUT_ONCE; 0: from the row statistics in every pass).
template <class Out, int NUM_HEADS, bool kToWs, class Storage>
__device__ __forceinline__ void store_rows_st_to(const DecodeParams& p, Storage& s, int b, int split,
                                                 int m_block, int tid, float v_scale, bool bad_len) {
  constexpr int kRows = Storage::kRowsPerCta;
  // MLA_ST_ROW_OUT_ONCE: where merge_st left no row_out, one thread per row works it out here first.
  constexpr bool kRowOutHere = !kRowOutInMerge<Storage> && MLA_ST_ROW_OUT_ONCE != 0;
  if constexpr (kRowOutHere) {
    if (tid < kRows) st_row_out(s, tid, v_scale, bad_len, s.row_out[0][tid], s.row_out[1][tid]);
    math_barrier<128 * Storage::kMathWgs>(kBarStMerge);
  }
  constexpr int kValsPerThread = 8;
  constexpr int kThreadsPerOutRow = kHeadDimV / kValsPerThread;              // 64
  constexpr int kRowsPerPass = 128 * Storage::kMathWgs / kThreadsPerOutRow;  // 4 (6 with 3 warpgroups)
  const MlaDecodeArgs& a = p.a;
  const uint32_t d0 = (uint32_t(tid) % kThreadsPerOutRow) * kValsPerThread;
  const bool swap = kMergeV4<Storage> && ((d0 >> 4) & 1);  // merge_st swapped the float4 pairs of odd 16-value groups
#pragma unroll 1
  for (uint32_t n = uint32_t(tid) / kThreadsPerOutRow; n < uint32_t(kRows); n += kRowsPerPass) {
    const uint32_t grow = uint32_t(m_block) * kRows + n;
    const int qi = int(grow / NUM_HEADS), h = int(grow % NUM_HEADS);
    if (qi >= a.q_len || h >= a.num_heads) continue;
    float inv_sum, lse;
    if constexpr (kRowOutInMerge<Storage> || kRowOutHere) {
      inv_sum = s.row_out[0][n];
      lse = s.row_out[1][n];
    } else {
      st_row_out(s, int(n), v_scale, bad_len, inv_sum, lse);
    }
    const float4* src = reinterpret_cast<const float4*>(&s.o_x[n * kOxStride + d0]);
    float4 lo = src[swap ? 1 : 0], hi = src[swap ? 0 : 1];
    store_st_row<Out, Partial<Out, NUM_HEADS>, kToWs>(a, b, split, qi, h, int(d0), lo, hi, inv_sum, lse);
  }
}
template <class Out, int NUM_HEADS, bool SPLIT, class Storage>
__device__ __forceinline__ void store_rows_st(const DecodeParams& p, Storage& s, int b, int split, int m_block,
                                              int tid, float v_scale, bool bad_len) {
  if (SPLIT && p.a.num_kv_splits > 1) {  // a split variant run with one split writes out directly
    store_rows_st_to<Out, NUM_HEADS, SPLIT>(p, s, b, split, m_block, tid, v_scale, bad_len);
  } else {
    store_rows_st_to<Out, NUM_HEADS, false>(p, s, b, split, m_block, tid, v_scale, bad_len);
  }
}

// Split variants with MLA_PDL: allow the combine grid to be scheduled. The trigger counts per CTA (the
// first thread to execute it fires it for its CTA; the early-returning producer neither fires nor holds
// it), so the combine can be scheduled once every decode CTA has a math warp past its stores; results
// do not depend on it, since the combine waits for the whole decode grid before reading.
template <bool SPLIT>
__device__ __forceinline__ void allow_dependent_launch() {
#if MLA_PDL
  if constexpr (SPLIT) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The work of a CTA: request b, query-row block m_block, split `split` and its keys [kv_begin, kv_end)
// in num_tiles tiles. A seq_len that block_table cannot address (or a negative one) is never read past
// the table: the request's rows get NaN (bad_len), so the bad input cannot pass for an answer. The
// block indices are read with volatile moves, so each caller (producer, math warpgroups) computes its
// own copy instead of the compiler keeping one live across the roles' setmaxnreg.
struct CtaWork {
  int b, m_block, split, seq_len, kv_begin, kv_end, num_tiles;
  bool bad_len;
};
// Request b's seq_len, or 0 with bad_len set when block_table cannot address it (or it is negative).
template <int PAGE_SIZE>
__device__ __forceinline__ int checked_seq_len(const MlaDecodeArgs& a, int b, bool& bad_len) {
  const int raw_len = a.seq_lens[b];
  bad_len = raw_len < 0 || int64_t(raw_len) > int64_t(a.max_pages_per_seq) * PAGE_SIZE;
  return bad_len ? 0 : raw_len;
}
// The uniform launch's CTA coordinates (grid x = m_block + num_m_blocks * request, y = split).
__device__ __forceinline__ void cta_coords(const DecodeParams& p, int& b, int& m_block, int& split) {
  uint32_t cx, cy;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(cy));
  m_block = int(cx) % p.num_m_blocks;
  b = int(cx) / p.num_m_blocks;
  split = int(cy);
}
template <int PAGE_SIZE>
__device__ __forceinline__ CtaWork cta_work(const DecodeParams& p) {
  const MlaDecodeArgs& a = p.a;
  CtaWork w;
  cta_coords(p, w.b, w.m_block, w.split);
  w.seq_len = checked_seq_len<PAGE_SIZE>(a, w.b, w.bad_len);
  split_range(w.seq_len, a.num_kv_splits, w.split, w.kv_begin, w.kv_end);
  w.num_tiles = tiles_of(w.kv_end - w.kv_begin);
  return w;
}

// Variants that can run a balanced schedule (schedule.cuh): the 64-row path of 16-bit caches.
template <class Cache, int NUM_HEADS>
constexpr bool kSchedulable = !kUseSt<NUM_HEADS, CacheTypes<Cache>::kFp8> && !CacheTypes<Cache>::kFp8;

// ---------------------------------------------------------------------------------------------
// The 64-row path's math warpgroups for one piece of work w (a CTA of the uniform split, or one
// segment of a scheduled CTA): S, softmax and O over w's tiles (consumer.cuh), then the epilogue, to
// out/lse (piece_row -1) or to the workspace piece starting at row piece_row. phases: the ring stages'
// and Q's barrier parities (MathContext); buf: which row_sum buffer the epilogue uses (segments
// alternate, so a warpgroup that runs ahead into the next segment never overwrites sums the other is
// still reading). kTrace: stamp the CTA's phase trace (trace.cuh; uniform launches of an MLA_TRACE build).
// kShort: the short-split fp8 kernel's storage (32-token tiles, four stages) and its S-first order.
template <class Cache, int NUM_HEADS, bool kStaged, bool kTrace = false, bool kShort = false>
__device__ __forceinline__ void rows_64(const DecodeParams& p, SharedStorage<Cache, kShort>& s, const CtaWork& w,
                                        int64_t piece_row, float score_scale, float v_scale, int phases, int buf) {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  using L = KernelLayouts<Element>;
  static_assert(SharedStorage<Cache, kShort>::kRing == 2 || !kSchedulable<Cache, NUM_HEADS>,
                "MathContext::phases holds the parities of two stages (and Q's in bit 2)");
  const MlaDecodeArgs& a = p.a;
  const int tid = threadIdx.x - kProducerThreads;
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const int tid_wg = tid % 128;
  const int lane = tid % 32;
  const int row0 = (tid_wg / 32) * 16 + lane / 4;  // this thread's rows: row0 and row0 + 8
  // Causal, bottom-right aligned: query qi sees keys < seq_len - (q_len - 1 - qi).
  int key_limit[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int qi = (w.m_block * kBlockM + row0 + 8 * r) / NUM_HEADS;
    key_limit[r] = min(w.kv_end, w.seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
  }

  Tensor tOrO = partition_fragment_C(typename L::TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDimV / kNumWarpgroups>>{});
  clear(tOrO);
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  if (w.num_tiles > 0) {
    const int num_tiles = tiles_of_n<SharedStorage<Cache, kShort>::kTileN>(w.kv_end - w.kv_begin, w.num_tiles);
    const MathContext ctx{w.kv_begin, num_tiles, {key_limit[0], key_limit[1]}, score_scale, wg, tid_wg, lane, row0,
                          phases};
    consume_two_stage</*kSFirst=*/!Types::kFp8 || kShort || MLA_FP8_S_FIRST>(s, ctx, tOrO, m_run, l_run);
    if constexpr (kSchedulable<Cache, NUM_HEADS>) {
      if (lane == 0) arrive_barrier(&s.q_empty);  // this warp's S wgmmas are done with Q
    }
  }
  if constexpr (kTrace) {
    trace_at(p, kProducerThreads).stamp(kTraceLoopDone);
    trace_at(p, kProducerThreads + 128 * (kNumWarpgroups - 1)).stamp(kTraceLoopDoneLast);
  }

  // Both warpgroups end on the same row max; their row sums (over their own columns of P) add up.
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 2);
    if (lane % 4 == 0) s.row_sum[buf][wg][row0 + 8 * r] = l_run[r];
  }
  math_barrier(kBarEnd);
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceMerged);
  float inv_sum[2], lse[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const float l = s.row_sum[buf][0][row0 + 8 * r] + s.row_sum[buf][1][row0 + 8 * r];
    // A row that saw no key (empty request, empty split, or q_len > seq_len): out 0, lse -inf.
    inv_sum[r] = l > 0.f ? v_scale / l : 0.f;
    lse[r] = l > 0.f ? (m_run[r] + log2f(l)) * kLn2 : -INFINITY;
    if (w.bad_len) inv_sum[r] = lse[r] = __int_as_float(0x7fc00000);  // NaN
  }
  if constexpr (kStaged) {
    // A non-split kernel (piece_row is -1). Past kBarEnd no math warp reads the ring, and a uniform
    // launch's producer has no tile left.
    static_assert(sizeof(s.kv[0]) >= kBlockM * (kHeadDimV / kNumWarpgroups) * sizeof(typename Types::Out),
                  "a stage holds a warpgroup's block of O");
    store_rows_staged<typename Types::Out, NUM_HEADS>(p, reinterpret_cast<char*>(s.kv[wg]), w.b, w.m_block, wg, tid_wg,
                                                      row0, tOrO, inv_sum, lse);
  } else {
    // Split kernels store their pieces (or, run with one split, out) straight from the accumulators:
    // staging out measured 1-4 us slower on batch-1 and batch-8 split calls (v3.12), staging 16-bit
    // pieces 1-2% slower than the paired stores (v3.22), staging fp32 pieces 2-4% slower (v3.15).
    store_rows<typename Types::Out, NUM_HEADS>(p, w.b, piece_row, w.m_block, wg, row0, tOrO, inv_sum, lse);
  }
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceStored);
}

// ---------------------------------------------------------------------------------------------
// The balanced schedule (schedule.cuh): a scheduled CTA covers the (request, tile) range [B_c, B_c+1),
// one segment per request it touches. Only the 64-row path of 16-bit caches takes it (kSchedulable).

// The scheduled CTA's index c and query-row block (grid x = m_block + num_m_blocks * c).
__device__ __forceinline__ void sched_cta(const DecodeParams& p, int& c, int& m_block) {
  uint32_t cx;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
  m_block = int(cx) % p.num_m_blocks;
  c = int(cx) / p.num_m_blocks;
}

// The segment of request b from tile t in CTA c, whose range ends at (end_b, end_t). CtaWork.split is
// the segment's piece, or -1 when the CTA covers the whole request (it writes out directly). A request
// whose tile count differs from the one it was scheduled with (the schedule was made for other
// seq_lens) gets no tiles and NaN rows, like a seq_len the block table cannot address.
template <int PAGE_SIZE>
__device__ __forceinline__ CtaWork sched_segment(const DecodeParams& p, int c, int m_block, int b, int t, int end_b,
                                                 int end_t) {
  const MlaDecodeArgs& a = p.a;
  const ScheduleView sv{a.schedule, a.sched_ctas};
  const int32_t* r = sv.request(b);
  const int sched_tiles = r[kReqTiles];
  CtaWork w;
  w.b = b;
  w.m_block = m_block;
  w.seq_len = checked_seq_len<PAGE_SIZE>(a, b, w.bad_len);
  if (tiles_of(w.seq_len) != sched_tiles) w.bad_len = true;
  if (w.bad_len) w.seq_len = 0;
  const int t1 = b == end_b ? end_t : sched_tiles;
  w.kv_begin = w.bad_len ? 0 : t * kBlockN;
  w.kv_end = w.bad_len ? 0 : int(min(int64_t(w.seq_len), int64_t(t1) * kBlockN));  // t1 * 64 may reach 2^31
  w.num_tiles = w.bad_len ? 0 : t1 - t;
  w.split = r[kReqPieces] == 1 ? -1 : r[kReqFirstPiece] + (c - r[kReqFirstCta]);
  return w;
}

// Whether the cursor (b, t) is still before the CTA's end bound (lexicographic order).
__device__ __forceinline__ bool sched_before(int b, int t, int end_b, int end_t) {
  return b < end_b || (b == end_b && t < end_t);
}

// The scheduled producer: per segment with tiles, Q (once the math warps are done with the previous
// segment's Q: q_empty) and its tiles. The ring continues across segments: each stage counts its own
// uses, a segment's tile 0 always takes stage 0, and `state` carries the parities: bits 0-1 those of
// the stages' next uses, bit 2 Q's next fill, bit 3 set once Q was filled. The producer runs at 40
// registers, so the loop keeps only b and state live across produce: the CTA index is read again
// from %ctaid and the end bound from the schedule on every segment.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, class Storage>
__device__ __forceinline__ void produce_scheduled(const DecodeParams& p, Storage& s, const void* kv_map) {
  const ScheduleView sv{p.a.schedule, p.a.sched_ctas};
  int b, t;
  {
    int c, m_block;
    sched_cta(p, c, m_block);
    b = sv.bound_req(c);
    t = sv.bound_tile(c);
  }
  int state = 0;
  trace_at(p, 0).stamp(kTraceProducerStart);
  for (;; ++b, t = 0) {
    int c, m_block;
    sched_cta(p, c, m_block);
    const int end_b = sv.bound_req(c + 1), end_t = sv.bound_tile(c + 1);
    if (!sched_before(b, t, end_b, end_t)) break;
    const CtaWork w = sched_segment<PAGE_SIZE>(p, c, m_block, b, t, end_b, end_t);
    if (w.num_tiles == 0) continue;
    if (state & 8) wait_barrier(&s.q_empty, ((state >> 2) & 1) ^ 1);
    produce<Cache, NUM_HEADS, PAGE_SIZE>(s, p.a, w.b, m_block, w.kv_begin, w.kv_end, w.num_tiles, int(threadIdx.x),
                                         kv_map, state & 3);
    state ^= (((w.num_tiles + 1) / 2) & 1) | (((w.num_tiles / 2) & 1) << 1) | 4;
    state |= 8;
  }
  trace_at(p, 0).stamp(kTraceProducerDone);
}

// The scheduled math warpgroups: rows_64 for each segment in turn (a segment without tiles only
// writes its rows: out 0 and lse -inf, or NaN), with the stage and Q parities the producer uses.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
__device__ __forceinline__ void consume_scheduled(const DecodeParams& p, SharedStorage<Cache>& s) {
  static_assert(SPLIT, "a scheduled launch writes workspace pieces: split variants only");
  const MlaDecodeArgs& a = p.a;
  int c, m_block;
  sched_cta(p, c, m_block);
  const ScheduleView sv{a.schedule, a.sched_ctas};
  int b = sv.bound_req(c), t = sv.bound_tile(c);
  const int end_b = sv.bound_req(c + 1), end_t = sv.bound_tile(c + 1);
  int u0 = 0, u1 = 0, k = 0, seg = 0;
  for (; sched_before(b, t, end_b, end_t); ++b, t = 0, ++seg) {
    const CtaWork w = sched_segment<PAGE_SIZE>(p, c, m_block, b, t, end_b, end_t);
    const int64_t piece_row = w.split < 0 ? -1 : int64_t(w.split) * a.q_len * a.num_heads;
    rows_64<Cache, NUM_HEADS, /*kStaged=*/false>(p, s, w, piece_row, p.scale_log2, 1.f,
                                                 (u0 & 1) | ((u1 & 1) << 1) | ((k & 1) << 2), seg & 1);
    if (w.num_tiles > 0) {
      u0 += (w.num_tiles + 1) / 2;
      u1 += w.num_tiles / 2;
      ++k;
    }
  }
  if constexpr (MLA_TRACE != 0) {  // k: segments with tiles; u0 + u1: their tiles
    const TraceSink tr = trace_at(p, kProducerThreads);
    tr.stamp(kTraceStored);
    tr.info(u0 + u1);
    tr.put(kTraceSegments, uint64_t(k));
  }
  allow_dependent_launch<SPLIT>();
}

// The tensor map a producer loads full tiles with (kTmaPages kernels whose host encoded one; not the
// fp8 short-split kernel), or null: every tile by cp.async.
template <class Cache, int PAGE_SIZE, int ROWS, bool SHORT>
__device__ __forceinline__ const void* kv_map_of(const DecodeParams& p) {
#if MLA_TMA
  if constexpr (kTmaPages<Cache, PAGE_SIZE, ROWS> && !SHORT) {
    if (p.use_tma) return &p.kv_map;
  }
#endif
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: x = m_block + num_m_blocks * request, y = split (balanced schedule: x = m_block +
// num_m_blocks * c, y = 1).

// SCHED: the balanced-schedule instantiation (launched only with a.schedule set; kSchedulable split
// variants). A separate kernel rather than a branch: with both paths in one kernel every uniform call
// measured ~2.5 us slower (docs/perf-notes.md, balanced schedule).
// SHORT: the short-split instantiation of fp8 split variants on the 64-row path (32-token tiles in
// four stages; launch.cuh picks it from the keys per split, constants.cuh MLA_FP8_SHORT_SPLIT_KEYS).
// ROWS: query rows per CTA, which picks the path: kBlockM the 64-row one, 8 / 16 / 32 the transposed
// one. The variant's own kernel takes kRowBlock; 17..32-head 16-bit variants also have a 64-row
// kernel for launches with short splits (rows64.cuh, constants.cuh MLA_ST32_MIN_KEYS).
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT, bool SCHED = false, bool SHORT = false,
          int ROWS = kRowBlock<NUM_HEADS, CacheTypes<Cache>::kFp8>>
__global__ void __launch_bounds__(KernelStorage<Cache, ROWS>::kThreads, 1)
    mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  using L = KernelLayouts<Element>;
  using Storage = KernelStorage<Cache, ROWS, SHORT>;
  constexpr bool kSt = ROWS != kBlockM;
  static_assert(!SHORT || (Types::kFp8 && !kSt && SPLIT && !SCHED), "short tiles: fp8 split variants, 64-row path");
  static_assert(!kSt || ROWS == kRowBlock<NUM_HEADS, Types::kFp8>, "the transposed path: the variant's own row block");
  static_assert(Storage::kThreads == KernelStorage<Cache, kRowBlock<NUM_HEADS, Types::kFp8>>::kThreads,
                "one block size per variant");
  extern __shared__ char smem_raw[];
  // Aligned by pointer arithmetic on smem_raw (not through an integer), so the compiler still knows
  // every access below is to shared memory (LDS/STS rather than generic LD/ST).
  char* smem_aligned = smem_raw + ((1024 - (reinterpret_cast<uintptr_t>(smem_raw) & 1023)) & 1023);
  Storage& s = *reinterpret_cast<Storage*>(smem_aligned);

  const MlaDecodeArgs& a = p.a;
  // The scheduled instantiation walks the schedule's segments instead of one (request, split) per CTA.
  static_assert(!SCHED || (kSchedulable<Cache, NUM_HEADS> && SPLIT && !kSt), "the scheduled kernel: split variants of the 64-row 16-bit path");
  // MLA_Q_FIRST: the producer threads issue their Q copies first in the uniform 16-bit kernels. The fp8
  // producers (produce_fp8, produce_fp8_ring) issue Q themselves; a scheduled CTA learns its request
  // from the schedule.
  constexpr bool kQFirst = MLA_Q_FIRST != 0 && !SCHED && !Types::kFp8;
  if constexpr (kQFirst) {
    if (threadIdx.x < kProducerThreads) {
      int b, m_block, split;
      cta_coords(p, b, m_block, split);
      load_q_block<typename Storage::Element, NUM_HEADS, Storage::kRowsPerCta>(s.q, a, b, m_block, threadIdx.x);
    }
  }
  // MLA_TRACE (trace.cuh): producer thread 0 and the first math thread stamp the CTA's phases.
  trace_at(p, kProducerThreads).stamp(kTraceEntry);
  // The CTA's request, query-row block and keys (the producer's copy; the math warpgroups compute
  // their own after setmaxnreg, so that nothing computed here stays live into their region).
  CtaWork w0{};
  if constexpr (!SCHED) w0 = cta_work<PAGE_SIZE>(p);

  if (threadIdx.x == (kQFirst ? kProducerThreads : 0)) {
    cutlass::arch::ClusterBarrier::init(&s.q_full, kProducerThreads);
    if constexpr (kSchedulable<Cache, NUM_HEADS>) cutlass::arch::ClusterBarrier::init(&s.q_empty, 4 * kNumWarpgroups);
    CUTE_UNROLL
    for (int i = 0; i < Storage::kRing * kSubTiles; ++i) {
      // bf16/fp16 and the fp8 register path: every producer thread's copies (a TMA slot: thread 0's
      // arrive.expect_tx plus its arrival for the other 127); fp8 widened in shared memory: the
      // widening threads' stores.
      cutlass::arch::ClusterBarrier::init(&s.kv_full[i],
                                          Types::kFp8 && !Storage::kRegWiden ? kFp8WidenThreads : kProducerThreads);
      // One arrival per math warp that reads the slot (see consume_two_stage; consume_st: the owning
      // warpgroup's four warps).
      cutlass::arch::ClusterBarrier::init(&s.kv_empty[i],
                                          kSt ? kStEmptyCount : two_stage_empty_count(i / kSubTiles, i % kSubTiles));
      if constexpr (Types::kFp8 && !Storage::kRegWiden) cutlass::arch::ClusterBarrier::init(&s.raw_full[i], kFp8CopyThreads);
    }
    cutlass::arch::fence_barrier_init();
    fence_proxy_async_shared();  // the initialized barriers, as TMA's complete_tx (async proxy) sees them
  }
  __syncthreads();

  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Storage::kProducerRegsUsed>();
    if constexpr (SCHED) {
      produce_scheduled<Cache, NUM_HEADS, PAGE_SIZE>(p, s, kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      return;
    }
    const int b = w0.b, m_block = w0.m_block, kv_begin = w0.kv_begin, kv_end = w0.kv_end, num_tiles = w0.num_tiles;
    if (num_tiles > 0) {
      trace_at(p, 0).stamp(kTraceProducerStart);
      if constexpr (Storage::kRegWiden) {
        produce_fp8_ring<NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x);
      } else if constexpr (Types::kFp8) {
        produce_fp8<NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end,
                                          tiles_of_n<Storage::kTileN>(kv_end - kv_begin, num_tiles), threadIdx.x,
                                          kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      } else {
        produce<Cache, NUM_HEADS, PAGE_SIZE, kQFirst>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x,
                                                      kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      }
      trace_at(p, 0).stamp(kTraceProducerDone);  // past its cp.async.wait_all (TMA tiles: issued)
    } else if constexpr (kQFirst) {
      // No tiles (empty split or bad seq_len): Q goes unused.
      cp_async_wait_all();  // do not retire with copies in flight
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Storage::kMathRegsUsed>();
  if constexpr (SCHED) {
    consume_scheduled<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>(p, s);
    return;
  }
  const CtaWork w = cta_work<PAGE_SIZE>(p);  // hides behind the wait for Q
  const int b = w.b, m_block = w.m_block, split = w.split, seq_len = w.seq_len, kv_begin = w.kv_begin, kv_end = w.kv_end,
            num_tiles = w.num_tiles;
  const bool bad_len = w.bad_len;
  if constexpr (MLA_TRACE != 0) {
    const TraceSink tr = trace_at(p, kProducerThreads);
    tr.info(num_tiles);
    if (num_tiles > 0 && tr.p != nullptr) {  // Q's arrival, seen by the first math thread alone
      wait_barrier(&s.q_full, 0);
      tr.stamp(kTraceQLanded);
    }
  }

  const int tid = threadIdx.x - kProducerThreads;
  // Broadcast from lane 0 so the compiler sees a warp-uniform value: wgmma inside branches on wg
  // would otherwise be serialized (ptxas C7520).
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const int tid_wg = tid % 128;
  const int lane = tid % 32;

  // Score scale (log2 domain) and output scale. An fp8 cache holds real / k_scale and q was loaded
  // times kFp8QPrescale, so scores take k_scale / kFp8QPrescale and the output k_scale.
  float score_scale = p.scale_log2, v_scale = 1.f;
  if constexpr (Types::kFp8) {
    v_scale = a.k_scale_ptr != nullptr ? __ldg(a.k_scale_ptr) : a.k_scale;
    score_scale *= v_scale / kFp8QPrescale;
  }

  if constexpr (kSt) {
    // Transposed path: this thread's query rows are columns of S^T (consumer_st.cuh). Columns past
    // the real rows take qi = q_len - 1 (finite scores from zero Q rows, never stored).
    constexpr int kRows = ROWS;
    using LS = StLayouts<Element, kRows>;
    StContext<kRows> ctx;
    ctx.kv_begin = kv_begin;
    ctx.num_tiles = num_tiles;
    ctx.score_scale = score_scale;
    ctx.wg = wg;
    ctx.tid_wg = tid_wg;
    ctx.warp = tid_wg / 32;
    ctx.lane = lane;
    float m_run[kRows / 4], l_run[kRows / 4];
    CUTE_UNROLL
    for (int j = 0; j < kRows / 4; ++j) {
      const int qi = (m_block * kRows + st_col_of_index(j, lane)) / NUM_HEADS;
      const int limit = min(kv_end, seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
      if constexpr (kKeyLimitShared<Storage>) {
        // This warp's row of s.key_limit (st_softmax_to_pt): lanes 0-3 write all kRows columns.
        if (lane < 4) s.key_limit[tid / 32][st_col_of_index(j, lane)] = limit;
      } else {
        ctx.key_limit[j] = limit;
      }
      m_run[j] = -INFINITY;
      l_run[j] = 0.f;
    }
    __syncwarp();
    if constexpr (Storage::kRegWiden) {
      if (num_tiles > 0) convert_q_st_fp8(s, tid);  // the producer only copied Q's bf16 rows
    }
    // O^T: all 512 latent rows.
    Tensor tOrO = partition_fragment_C(typename LS::TiledMmaO{}, Shape<Int<kHeadDimV>, Int<kRows>>{});
    clear(tOrO);
    if (num_tiles > 0) {
      if constexpr (Storage::kRegWiden) {
        consume_st_regs(s, ctx, tOrO, m_run, l_run);
      } else {
        consume_st(s, ctx, tOrO, m_run, l_run);
      }
    }
    trace_at(p, kProducerThreads).stamp(kTraceLoopDone);
    trace_at(p, kProducerThreads + 128 * (Storage::kMathWgs - 1)).stamp(kTraceLoopDoneLast);
    merge_st(s, ctx, tOrO, m_run, l_run, v_scale, bad_len);
    trace_at(p, kProducerThreads).stamp(kTraceMerged);
    store_rows_st<typename Types::Out, NUM_HEADS, SPLIT>(p, s, b, split, m_block, tid, v_scale, bad_len);
    trace_at(p, kProducerThreads).stamp(kTraceStored);
    allow_dependent_launch<SPLIT>();
    return;
  } else {
    const int64_t piece_row =
        SPLIT && a.num_kv_splits > 1 ? (int64_t(split) * a.batch + b) * a.q_len * a.num_heads : -1;
    // MLA_EPI_STAGED (constants.cuh): non-split kernels stage out on the TMA pages (1) or every page (2).
    constexpr bool kStaged =
        !SPLIT && (MLA_EPI_STAGED == 2 || (MLA_EPI_STAGED == 1 && kTmaPages<Cache, PAGE_SIZE, ROWS>));
    rows_64<Cache, NUM_HEADS, kStaged, /*kTrace=*/MLA_TRACE != 0, /*kShort=*/SHORT>(p, s, w, piece_row, score_scale,
                                                                                  v_scale, /*phases=*/0, /*buf=*/0);
    allow_dependent_launch<SPLIT>();
  }  // !kSt
}

}  // namespace mla
