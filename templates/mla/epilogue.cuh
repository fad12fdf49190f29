// The epilogues: each path's normalised O and lse, stored to `out` / `lse`, or to the split workspace
// (workspace.cuh) for the combine. The 64-row path stores from the accumulators (store_rows) or, in
// non-split kernels on TMA pages, through shared memory (store_rows_staged); the transposed path from the
// merged rows in shared memory (store_rows_st).
#pragma once
#include <cuda_runtime.h>

#include "arch.cuh"
#include "config.cuh"
#include "consumer_st.cuh"  // st_row_out, kRowOutInMerge, kMergeV4
#include "layouts.cuh"
#include "params.cuh"
#include "workspace.cuh"

namespace mla {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// The 64-row path: normalised O and lse for the thread's two rows, to `out`/`lse` or to the workspace.

// Row row0 + 8 r of a warpgroup's 64 x 256 block in a 16-bit type T, straight from the accumulators:
// in the accumulator layout lane q = lane % 4 holds 4 bytes (columns 2q, 2q + 1) of
// every 8-column group j, so one store per group writes 16 bytes of a row per quad, half a 32-byte
// sector. Here groups j and j + 1 (32 contiguous bytes) go together: lanes q and q ^ 1 swap one value,
// then lane q stores 8 bytes, bytes 8 (q >> 1) .. + 7 of group j + (q & 1), so a warp instruction
// writes 8 rows x 32 bytes: full sectors and half the store instructions. Every lane of the warp runs
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
    const QueryRow q = query_row(a, b, qi, h);
    const bool valid = q.valid;  // the same for the four lanes of a row
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
      Out* row = static_cast<Out*>(a.out) + int64_t(q.ob) * a.out_stride_batch + int64_t(q.t) * a.out_stride_token +
                 int64_t(h) * a.out_stride_head + wg * (kHeadDimV / kNumWarpgroups);
      store_16_pairs<Out>(row, valid, o, r, inv_sum[r], lane);
      if (valid && wg == 0 && lane % 4 == 0) {
        a.lse[int64_t(q.ob) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(q.t) * a.lse_stride_token] = lse[r];
      }
    }
  }
}

// The same epilogue through shared memory, for the non-split kernels' rows of `out` (in a uniform
// launch the KV ring is idle once both math warpgroups are past kBarEnd). Warpgroup wg stages its
// 64 x 256 block of normalised O in ring stage wg: row-major, 16-byte chunk c of row r at chunk
// c ^ (r % 8), so the accumulator-layout stores (8 rows x 16 bytes per warp) hit 32 distinct banks.
// Then each warp stores one row's 512 contiguous bytes per instruction with 16-byte stores (two
// 8-byte stores where `out` is only 8-byte aligned). Used by the non-split kernels on TMA pages.
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
// from DRAM on a cold call (the L2 flushed or thrashed between layers) and is kept small.
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
    if (wg != 0 || lane % 4 != 0) continue;
    const int h = grow % NUM_HEADS;
    const QueryRow q = query_row(a, b, grow / NUM_HEADS, h);
    if (!q.valid) continue;
    a.lse[int64_t(q.ob) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(q.t) * a.lse_stride_token] = lse[r];
  }
  stage_o<Out>(stage, lane, row0, o, inv_sum);
  warpgroup_barrier(kBarOwnP + wg);
  auto dst_of = [&](uint32_t row) -> char* {
    const uint32_t grow = uint32_t(m_block) * kBlockM + row;
    const int h = int(grow % NUM_HEADS);
    const QueryRow q = query_row(a, b, int(grow / NUM_HEADS), h);
    if (!q.valid) return nullptr;
    return reinterpret_cast<char*>(static_cast<Out*>(a.out) + int64_t(q.ob) * a.out_stride_batch +
                                   int64_t(q.t) * a.out_stride_token + int64_t(h) * a.out_stride_head +
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
// inv_sum): to the workspace row of (qi, h) in the piece whose (query 0, head 0) row is piece_row, with
// its lse (kToWs; P the partials' type), else to out and lse.
template <class Out, class P, bool kToWs>
__device__ __forceinline__ void store_st_row(const MlaDecodeArgs& a, int64_t piece_row, int qi, int h, QueryRow q,
                                             int d0, float4 lo, float4 hi, float inv_sum, float lse) {
  if constexpr (kToWs) {
    const SplitWorkspace<P> ws = split_workspace<P>(a);
    const int64_t ws_row = piece_row + int64_t(qi) * a.num_heads + h;
    store_partial8(ws.o + ws_row * kHeadDimV + d0,
                   make_float4(lo.x * inv_sum, lo.y * inv_sum, lo.z * inv_sum, lo.w * inv_sum),
                   make_float4(hi.x * inv_sum, hi.y * inv_sum, hi.z * inv_sum, hi.w * inv_sum));
    if (d0 == 0) ws.lse[ws_row] = lse;
  } else {
    Out* dst = static_cast<Out*>(a.out) + int64_t(q.ob) * a.out_stride_batch + int64_t(q.t) * a.out_stride_token +
               int64_t(h) * a.out_stride_head + d0;
    reinterpret_cast<uint2*>(dst)[0] =
        make_uint2(pack2<Out>(lo.x * inv_sum, lo.y * inv_sum), pack2<Out>(lo.z * inv_sum, lo.w * inv_sum));
    reinterpret_cast<uint2*>(dst)[1] =
        make_uint2(pack2<Out>(hi.x * inv_sum, hi.y * inv_sum), pack2<Out>(hi.z * inv_sum, hi.w * inv_sum));
    if (d0 == 0) {
      a.lse[int64_t(q.ob) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(q.t) * a.lse_stride_token] = lse;
    }
  }
}

// Epilogue of the transposed path: after merge_st, s.o_x holds each query row's O (unnormalised, on
// the merged max). All math threads store the real rows, 64 threads per row, 8 consecutive values each
// (coalesced; out rows are only 8-byte aligned, hence 8-byte stores), to out/lse or to the workspace
// row store_rows uses. Same conventions as store_rows: a row that saw no key gets out 0 and lse -inf,
// a request with a bad seq_len NaN. A rolled loop, one trip per kRowsPerPass rows, with the destination
// chosen once outside it (the epilogue's code runs once per CTA and comes from DRAM on a cold call).
// Each row's v_scale / l and lse come from s.row_out, where merge_st's idle warpgroup 0 put them
// (kRowOutInMerge), or on the fp8 register path, where this function's first step puts them.
template <class Out, int NUM_HEADS, bool kToWs, class Storage>
__device__ __forceinline__ void store_rows_st_to(const DecodeParams& p, Storage& s, int b, int64_t piece_row,
                                                 int m_block, int tid, float v_scale, bool bad_len) {
  constexpr int kRows = Storage::kRowsPerCta;
  // Where merge_st left no row_out, one thread per row works it out here first.
  constexpr bool kRowOutHere = !kRowOutInMerge<Storage>;
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
    const QueryRow q = query_row(a, b, qi, h);
    if (!q.valid) continue;
    const float inv_sum = s.row_out[0][n], lse = s.row_out[1][n];
    const float4* src = reinterpret_cast<const float4*>(&s.o_x[n * kOxStride + d0]);
    float4 lo = src[swap ? 1 : 0], hi = src[swap ? 0 : 1];
    store_st_row<Out, Partial<Out, NUM_HEADS>, kToWs>(a, piece_row, qi, h, q, int(d0), lo, hi, inv_sum, lse);
  }
}
template <class Out, int NUM_HEADS, bool SPLIT, class Storage>
__device__ __forceinline__ void store_rows_st(const DecodeParams& p, Storage& s, int b, int64_t piece_row, int m_block,
                                              int tid, float v_scale, bool bad_len) {
  if (SPLIT && piece_row >= 0) {  // piece_row -1: out directly
    store_rows_st_to<Out, NUM_HEADS, SPLIT>(p, s, b, piece_row, m_block, tid, v_scale, bad_len);
  } else {
    store_rows_st_to<Out, NUM_HEADS, false>(p, s, b, piece_row, m_block, tid, v_scale, bad_len);
  }
}

}  // namespace mla
