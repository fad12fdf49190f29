// Split-KV combine: merges the per-split normalised partial outputs by their log-sum-exp.
//
// For row i with split results (o_s, lse_s): lse = log(sum_s exp(lse_s)) and
// o = sum_s exp(lse_s - lse) o_s (the standard flash-decoding reduction). Splits that saw no key
// carry lse_s = -inf and weigh exactly 0; a row with no key at all gets out 0 and lse -inf.
#pragma once
#include <cuda_runtime.h>

#include "abi.h"
#include "arch.cuh"
#include "config.cuh"
#include "params.cuh"
#include "schedule.cuh"
#include "workspace.cuh"

namespace mla {

constexpr int kCombineThreads = kHeadDimV / 4;  // each thread owns 4 output columns of its row
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineUnroll = 8;  // partial-output loads each thread keeps in flight
constexpr int kCombineCtasPerSm = 8;  // the scheduled combine's grid (kCombineWarpRows warps a CTA), per SM of the decode launch
constexpr int kCombinePieceRound = 4;  // the scheduled combine's partial loads per lane in flight: pieces x 4 float4
constexpr int kCombineWarpMaxSplits = 8;  // uniform splits up to this many: one warp per row
constexpr int kCombineWarpRows = 4;       // rows (warps) per CTA of that combine
constexpr int kCombineColsMaxSplits = 16; // uniform splits above kCombineWarpMaxSplits up to this many: a warp per 128 columns
constexpr int kCombineWideMinSplits = 32; // uniform splits from this many: 4 CTAs per row (below)
constexpr int kCombineWideCols = 128;     // that combine's columns per CTA (4 per lane: a float4, or a uint2 of 16-bit)
constexpr int kCombineWideGroups = kHeadDimV / kCombineWideCols;  // 4 CTAs per row
constexpr int kCombineWideWarps = 8;      // warps per CTA, each summing every 8th split
static_assert(kCombineWideCols == 32 * 4, "the wide combine: 4 columns per lane");
static_assert(kCombineColsMaxSplits < kCombineWideMinSplits, "the column-group combine sits below the wide one");
static_assert(kCombineWideMinSplits >= kCombineWideWarps, "the wide combine reads split `warp` for padding");

// Block-wide max or sum of one float per thread (all threads get the result).
template <bool kMax>
__device__ __forceinline__ float combine_reduce(float v, float* scratch) {
  CUTE_UNROLL
  for (int d = 16; d > 0; d /= 2) {
    const float o = __shfl_xor_sync(0xffffffff, v, d);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  CUTE_UNROLL
  for (int w = 1; w < kCombineWarps; ++w) v = kMax ? fmaxf(v, scratch[w]) : v + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return v;
}

// A warp's largest lse and NaN flag: every lane gets the max of the lanes' max_lse and whether any
// lane's bad is set.
__device__ __forceinline__ void warp_max_lse(float& max_lse, bool& bad) {
  CUTE_UNROLL
  for (int d = 16; d > 0; d /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, d));
  bad = __any_sync(0xffffffff, bad);
}

// The weights w_s = exp(lse_s - max) of N split results (all 0 when every lse is -inf: no key), their
// sum, the largest lse, and whether any lse is NaN (a split marked its request invalid; fmaxf ignores a
// NaN operand, so the flag is kept apart).
template <int N>
__device__ __forceinline__ void split_weights(const float (&l)[N], float (&w)[N], float& sum, float& max_lse,
                                              bool& bad) {
  CUTE_UNROLL
  for (int s = 0; s < N; ++s) {
    bad |= isnan(l[s]);
    max_lse = fmaxf(max_lse, l[s]);
  }
  CUTE_UNROLL
  for (int s = 0; s < N; ++s) {
    w[s] = max_lse != -INFINITY ? __expf(l[s] - max_lse) : 0.f;
    sum += w[s];
  }
}
// acc += w o. A split of weight 0 (no key) is skipped, never multiplied: its partial output is not
// relied on (its CTA writes zeros today).
__device__ __forceinline__ void accumulate(float4& acc, float w, const float4& o) {
  if (w != 0.f) {
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
  }
}
// A row's result: out = acc / sum (0 when no key), lse = max + log(sum) (-inf when no key); NaN for both
// when a split marked the request invalid. `lane0` stores the lse.
template <class Out>
__device__ __forceinline__ void store_combined(const MlaDecodeArgs& a, int b, int qi, int h, int col, float4 acc,
                                               float sum, float max_lse, bool bad, bool lane0) {
  const QueryRow q = query_row(a, b, qi, h);
  if (!q.valid) return;  // a varlen padding row (its partials were never written)
  float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (bad) inv = sum = __int_as_float(0x7fc00000);
  Out* dst = static_cast<Out*>(a.out) + int64_t(q.ob) * a.out_stride_batch + int64_t(q.t) * a.out_stride_token +
             int64_t(h) * a.out_stride_head + col;
  uint2 packed;
  packed.x = pack2<Out>(acc.x * inv, acc.y * inv);
  packed.y = pack2<Out>(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(dst) = packed;
  if (lane0) {
    a.lse[int64_t(q.ob) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(q.t) * a.lse_stride_token] =
        bad ? sum : (sum > 0.f ? max_lse + logf(sum) : -INFINITY);
  }
}

// One (request b, query token qi, head h) row, by the whole CTA (every thread calls it with the same
// row), over num_splits > kCombineColsMaxSplits splits. `row` is the row's workspace index in its first
// split, rows_per_split the distance between its splits. The splits' lse values are read in parallel
// (split s by thread s % kCombineThreads), their weights exp(lse_s - max) staged in shared memory
// kCombineThreads splits at a time, and each thread accumulates its 4 columns over the staged splits
// with kCombineUnroll independent 16-byte loads in flight.
template <class Out, class P>
__device__ __forceinline__ void combine_row(const MlaDecodeArgs& a, const SplitWorkspace<P>& ws, int b, int qi, int h,
                                            int64_t row, int64_t rows_per_split, int num_splits, float* weight,
                                            float* scratch) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  float max_lse = -INFINITY;
  bool bad = false;  // a split marked its request invalid (NaN lse): the row stays NaN
  // Pass 1: the largest lse, and whether any split marked its request invalid (NaN lse: the row
  // stays NaN). fmaxf ignores a NaN operand, so the flag is kept apart.
  for (int s = threadIdx.x; s < num_splits; s += kCombineThreads) {
    const float l = ws.lse[s * rows_per_split + row];
    bad |= isnan(l);
    max_lse = fmaxf(max_lse, l);
  }
  bad = __syncthreads_or(bad);
  max_lse = combine_reduce<true>(max_lse, scratch);

  // Pass 2: o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max). A split that saw no key has
  // lse -inf, weighs exactly 0, and its partial output is not read.
  if (max_lse != -INFINITY) {  // uniform over the CTA
    const P* o_row = ws.o + row * kHeadDimV + threadIdx.x * 4;
    const int64_t split_stride = rows_per_split * kHeadDimV;
    for (int first = 0; first < num_splits; first += kCombineThreads) {
      const int n = min(kCombineThreads, num_splits - first);
      if (int(threadIdx.x) < n) {
        const float w = __expf(ws.lse[(first + threadIdx.x) * rows_per_split + row] - max_lse);
        weight[threadIdx.x] = w;
        sum += w;
      }
      __syncthreads();
      const P* o_first = o_row + first * split_stride;
      for (int i = 0; i < n; i += kCombineUnroll) {
        PartialWords4<P> o[kCombineUnroll];
        CUTE_UNROLL
        for (int u = 0; u < kCombineUnroll; ++u) {
          const bool live = i + u < n && weight[min(i + u, n - 1)] != 0.f;
          o[u] = live ? load_partial4(o_first + (i + u) * split_stride) : zero_partial4<P>();
        }
        CUTE_UNROLL
        for (int u = 0; u < kCombineUnroll; ++u) {
          const float w = i + u < n ? weight[min(i + u, n - 1)] : 0.f;
          const auto& v = widen_partial4<P>(o[u]);
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
      }
      __syncthreads();  // the next chunk overwrites `weight`
    }
  }
  sum = combine_reduce<false>(sum, scratch);  // each thread summed the weights it staged
  store_combined<Out>(a, b, qi, h, int(threadIdx.x) * 4, acc, sum, max_lse, bad, threadIdx.x == 0);
}

// A combine kernel is launched as a programmatic dependent of the decode grid (launch.cuh): wait until
// that grid has completed and its workspace writes are visible, before reading them.
__device__ __forceinline__ void wait_for_decode_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Output row out_row = (b q_len + qi) num_heads + h of a uniform split's combine: its request b, query
// qi and head h, and the workspace distance between a row's consecutive pieces (piece s of request b
// is s * batch + b).
struct OutRow {
  int b, qi, h;
  int64_t rows_per_split;
  __device__ __forceinline__ OutRow(const MlaDecodeArgs& a, int64_t out_row) {
    const int64_t rows_per_req = int64_t(a.q_len) * a.num_heads;
    rows_per_split = int64_t(a.batch) * rows_per_req;
    h = int(out_row % a.num_heads);
    qi = int((out_row / a.num_heads) % a.q_len);
    b = int(out_row / rows_per_req);
  }
};

// Uniform split into S = 2..kCombineWarpMaxSplits: one warp per row, kCombineWarpRows rows per CTA.
// The one-CTA-per-row combine keeps about 5 rows in flight per SM (86 registers x 128 threads); a warp
// per row with S compile-time keeps S x 16 float4 loads in flight per
// lane and several times the rows per SM. Lane j owns columns j * 4 + 128 k (k < 4): every load and
// store instruction of the warp covers 512 (or 256) contiguous bytes.
template <class Out, class P, int S>
__global__ void __launch_bounds__(32 * kCombineWarpRows)
    mla_combine_warp_kernel(const __grid_constant__ MlaDecodeArgs a) {
  const int64_t out_row = int64_t(blockIdx.x) * kCombineWarpRows + threadIdx.x / 32;  // (b q_len + qi) heads + h
  const int lane = int(threadIdx.x % 32);
  const OutRow orow(a, out_row);
  const int64_t rows_per_split = orow.rows_per_split;
  if (out_row >= rows_per_split) return;
  const int h = orow.h, qi = orow.qi, b = orow.b;
  const SplitWorkspace<P> ws = split_workspace<P>(a);
  wait_for_decode_grid();
  constexpr int kChunks = kHeadDimV / 128;  // 4-column groups per lane
  float l[S];
  PartialWords4<P> o[S][kChunks];
  CUTE_UNROLL
  for (int s = 0; s < S; ++s) {
    const int64_t row = s * rows_per_split + out_row;
    l[s] = ws.lse[row];
    const P* o_row = ws.o + row * kHeadDimV + lane * 4;
    CUTE_UNROLL
    for (int k = 0; k < kChunks; ++k) o[s][k] = load_partial4(o_row + k * 128);
  }
  float w[S];
  float sum = 0.f, max_lse = -INFINITY;
  bool bad = false;
  split_weights(l, w, sum, max_lse, bad);
  CUTE_UNROLL
  for (int k = 0; k < kChunks; ++k) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    CUTE_UNROLL
    for (int s = 0; s < S; ++s) accumulate(acc, w[s], widen_partial4<P>(o[s][k]));
    store_combined<Out>(a, b, qi, h, k * 128 + lane * 4, acc, sum, max_lse, bad, lane == 0 && k == 0);
  }
}

// Uniform split into kCombineWarpMaxSplits + 1 .. kCombineColsMaxSplits splits (batch 1 at 577-1024
// keys: 16 one-tile splits; batch 2-8 at up to 4096 keys). One warp per (row, 128-column group), the
// row's 4 groups in one CTA. Each lane loads every split's lse (one broadcast word per warp) and its 4
// columns of every split's partial (512 or 256 contiguous bytes per warp load) before it weighs any:
// one round trip, where the CTA-per-row combine takes three (lse, then two rounds of 8 partial loads,
// with two block-wide reductions between). Splits past num_splits re-read split 0 and weigh 0.
template <class Out, class P>
__global__ void __launch_bounds__(32 * kCombineWideGroups)
    mla_combine_cols_kernel(const __grid_constant__ MlaDecodeArgs a) {
  constexpr int S = kCombineColsMaxSplits;
  const int64_t out_row = blockIdx.x;  // (b q_len + qi) heads + h
  const int group = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const OutRow orow(a, out_row);
  const int64_t rows_per_split = orow.rows_per_split;
  const int h = orow.h, qi = orow.qi, b = orow.b;
  const int num_splits = a.num_kv_splits;
  const int col = group * kCombineWideCols + lane * 4;
  const SplitWorkspace<P> ws = split_workspace<P>(a);
  wait_for_decode_grid();
  float l[S];
  PartialWords4<P> o[S];
  CUTE_UNROLL
  for (int s = 0; s < S; ++s) {
    const int64_t row = int64_t(s < num_splits ? s : 0) * rows_per_split + out_row;
    l[s] = ws.lse[row];
    o[s] = load_partial4(ws.o + row * kHeadDimV + col);
  }
  CUTE_UNROLL
  for (int s = 0; s < S; ++s) l[s] = s < num_splits ? l[s] : -INFINITY;
  float w[S];
  float sum = 0.f, max_lse = -INFINITY;
  bool bad = false;
  split_weights(l, w, sum, max_lse, bad);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  CUTE_UNROLL
  for (int s = 0; s < S; ++s) accumulate(acc, w[s], widen_partial4<P>(o[s]));
  store_combined<Out>(a, b, qi, h, col, acc, sum, max_lse, bad, lane == 0 && group == 0);
}

// Uniform split into kCombineWideMinSplits splits or more (batch 1 with long sequences: 32-64 splits
// over 16-128 rows). The one-CTA-per-row combine reads 8 splits per round trip, so a 16-row call with
// 64 splits ran 16 CTAs through 8 dependent rounds. Here a row is cut into kCombineWideGroups column
// groups of 128, one CTA each, and the CTA's 8 warps take every 8th split, lane j owning 4 columns
// (each warp load: 512 contiguous bytes), with kCombineUnroll splits' loads in flight per lane: 64
// splits in one round trip, on 4x the CTAs. The largest lse comes first (a block-wide max over all
// splits' lse); the warps' weighted sums then meet in shared memory, and warp 0 stores. Grid: rows x
// kCombineWideGroups CTAs of 256 threads (from kCombineWideMinSplits splits: with fewer, two splits per
// warp, it was slower than the CTA-per-row combine; docs/design.md).
template <class Out, class P>
__global__ void __launch_bounds__(32 * kCombineWideWarps, 2)
    mla_combine_wide_kernel(const __grid_constant__ MlaDecodeArgs a) {
  __shared__ float4 part[kCombineWideWarps][32];
  __shared__ float warp_max[kCombineWideWarps];
  __shared__ float warp_sum[kCombineWideWarps];
  __shared__ int warp_bad[kCombineWideWarps];
  const int64_t out_row = int64_t(blockIdx.x) / kCombineWideGroups;  // (b q_len + qi) heads + h
  const int group = int(blockIdx.x % kCombineWideGroups);
  const OutRow orow(a, out_row);
  const int64_t rows_per_split = orow.rows_per_split;
  const int h = orow.h, qi = orow.qi, b = orow.b;
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const int num_splits = a.num_kv_splits;
  const int col = group * kCombineWideCols + lane * 4;
  const SplitWorkspace<P> ws = split_workspace<P>(a);
  wait_for_decode_grid();
  // The largest lse of the row, and whether any split marked the request invalid (NaN lse).
  float max_lse = -INFINITY;
  bool bad = false;
  for (int s = int(threadIdx.x); s < num_splits; s += 32 * kCombineWideWarps) {
    const float l = ws.lse[s * rows_per_split + out_row];
    bad |= isnan(l);
    max_lse = fmaxf(max_lse, l);
  }
  warp_max_lse(max_lse, bad);
  if (lane == 0) {
    warp_max[warp] = max_lse;
    warp_bad[warp] = bad;
  }
  __syncthreads();
  CUTE_UNROLL
  for (int w = 0; w < kCombineWideWarps; ++w) {
    max_lse = fmaxf(max_lse, warp_max[w]);
    bad |= warp_bad[w] != 0;
  }
  // This warp's splits warp + 8 i: sum_s w_s o_s over its 4 columns and sum_s w_s, w_s = exp(lse_s - max).
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  for (int first = warp; first < num_splits; first += kCombineWideWarps * kCombineUnroll) {
    float l[kCombineUnroll];
    PartialWords4<P> o[kCombineUnroll];
    CUTE_UNROLL
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = first + u * kCombineWideWarps;
      // Past the last split: split `warp`'s row is read again and weighs 0. The loads are
      // unconditional, and the launch bounds allow 128 registers (with 256 threads alone ptxas kept 32
      // and sank every load next to its use), so all of them are in flight before the first weight.
      const int64_t row = int64_t(s < num_splits ? s : warp) * rows_per_split + out_row;
      l[u] = ws.lse[row];
      o[u] = load_partial4(ws.o + row * kHeadDimV + col);
      if (s >= num_splits) l[u] = -INFINITY;
    }
    CUTE_UNROLL
    for (int u = 0; u < kCombineUnroll; ++u) {
      const float w = max_lse != -INFINITY ? __expf(l[u] - max_lse) : 0.f;
      sum += w;
      // A split of weight 0 (no key, or past the last) adds exactly 0 whatever its partial holds.
      const auto& v = widen_partial4<P>(o[u]);
      acc.x += w != 0.f ? w * v.x : 0.f;
      acc.y += w != 0.f ? w * v.y : 0.f;
      acc.z += w != 0.f ? w * v.z : 0.f;
      acc.w += w != 0.f ? w * v.w : 0.f;
    }
  }
  part[warp][lane] = acc;
  if (lane == 0) warp_sum[warp] = sum;  // every lane of a warp summed the same weights
  __syncthreads();
  if (warp == 0) {
    acc = part[0][lane];
    sum = warp_sum[0];
    CUTE_UNROLL
    for (int w = 1; w < kCombineWideWarps; ++w) {
      const float4 v = part[w][lane];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
      sum += warp_sum[w];
    }
    store_combined<Out>(a, b, qi, h, col, acc, sum, max_lse, bad, lane == 0 && group == 0);
  }
}

// Uniform split into kCombineColsMaxSplits + 1 .. kCombineWideMinSplits - 1 splits. Grid: one CTA
// per (request, query token, head) row; piece s of request b is s * batch + b.
template <class Out, class P>
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const __grid_constant__ MlaDecodeArgs a) {
  __shared__ float weight[kCombineThreads];
  __shared__ float scratch[kCombineWarps];
  const int64_t out_row = blockIdx.x;  // ((b * q_len) + qi) * num_heads + h
  const OutRow orow(a, out_row);
  const SplitWorkspace<P> ws = split_workspace<P>(a);
  wait_for_decode_grid();
  combine_row<Out, P>(a, ws, orow.b, orow.qi, orow.h, out_row, orow.rows_per_split, a.num_kv_splits, weight, scratch);
}

// Balanced schedule. Only the requests with several pieces need a combine (the others were written to
// out by their CTA), and the schedule lists them (schedule.cuh, `shared`). One warp per row of those
// requests (row i: list entry i / rows_per_req), kCombineWarpRows per CTA, striding over the rows by
// the grid (launch.cuh: at most kCombineCtasPerSm CTAs per SM of the decode launch), so a batch with
// no shared request costs one wave of CTAs that read the count and leave. Lane j owns columns
// j * 4 + 128 k (k < 4), as in the uniform warp combine. A request's pieces are consecutive from its
// first: lane s reads the lse of pieces s, s + 32, ... (the largest and the NaN flag by shuffles),
// and the partials come kCombinePieceRound pieces a round trip, the first round's loads issued with
// the lse loads.
template <class Out, class P>
__global__ void __launch_bounds__(32 * kCombineWarpRows)
    mla_combine_scheduled_kernel(const __grid_constant__ MlaDecodeArgs a) {
  constexpr int kChunks = kHeadDimV / 128;  // 4-column groups per lane
  constexpr int U = kCombinePieceRound;
  const int32_t* shared_list = a.schedule + schedule_shared_offset(a.batch, a.sched_ctas);
  const int64_t rows_per_req = int64_t(a.q_len) * a.num_heads;
  const int64_t rows = int64_t(shared_list[0]) * rows_per_req;  // written before the decode launch
  const int64_t stride = int64_t(gridDim.x) * kCombineWarpRows;
  const int lane = int(threadIdx.x % 32);
  int64_t i = int64_t(blockIdx.x) * kCombineWarpRows + threadIdx.x / 32;
  if (i >= rows) {
    // Every warp may leave here (no request shared); one waits, so that this grid's completion implies
    // the decode grid's, whose CTAs wrote out directly (stream order for the caller's next kernel).
    if (blockIdx.x == 0) wait_for_decode_grid();
    return;
  }
  const SplitWorkspace<P> ws = split_workspace<P>(a);
  const ScheduleView sv{a.schedule, a.sched_ctas};
  // The row's request and its pieces; the first row's are read before the wait (the schedule kernel
  // finished before the decode grid started), so only the partial results wait for the decode grid.
  auto locate = [&](int64_t row_index, int& b, int64_t& in_req, int64_t& first_row, int& pieces) {
    const int j = int(row_index / rows_per_req);
    in_req = row_index - int64_t(j) * rows_per_req;  // qi * num_heads + h
    b = shared_list[1 + j];
    const int32_t* r = sv.request(b);
    first_row = int64_t(r[kReqFirstPiece]) * rows_per_req + in_req;
    pieces = r[kReqPieces];
  };
  int b, pieces;
  int64_t in_req, first_row;
  locate(i, b, in_req, first_row, pieces);
  wait_for_decode_grid();
  for (;;) {
    const int64_t piece_stride = rows_per_req * kHeadDimV;  // workspace words between a row's pieces
    const P* o_row = ws.o + first_row * kHeadDimV + lane * 4;
    PartialWords4<P> o[U][kChunks];
    auto load_round = [&](int first) {
      CUTE_UNROLL
      for (int u = 0; u < U; ++u) {
        CUTE_UNROLL
        for (int k = 0; k < kChunks; ++k) {
          o[u][k] = first + u < pieces ? load_partial4(o_row + (first + u) * piece_stride + k * 128)
                                       : zero_partial4<P>();
        }
      }
    };
    load_round(0);
    float lane_lse = lane < pieces ? ws.lse[lane * rows_per_req + first_row] : -INFINITY;
    float max_lse = lane_lse;
    bool bad = isnan(lane_lse);
    for (int s = lane + 32; s < pieces; s += 32) {
      const float l = ws.lse[s * rows_per_req + first_row];
      bad |= isnan(l);
      max_lse = fmaxf(max_lse, l);
    }
    warp_max_lse(max_lse, bad);
    float sum = 0.f;
    float4 acc[kChunks];
    CUTE_UNROLL
    for (int k = 0; k < kChunks; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int first = 0; first < pieces; first += U) {
      if (first > 0) load_round(first);
      CUTE_UNROLL
      for (int u = 0; u < U; ++u) {
        const int s = first + u;  // the same for every lane
        const float l = s < 32 ? __shfl_sync(0xffffffff, lane_lse, s % 32)
                               : (s < pieces ? ws.lse[s * rows_per_req + first_row] : -INFINITY);
        // A piece that saw no key (lse -inf), or past the last, weighs exactly 0 and is skipped.
        const float w = s < pieces && max_lse != -INFINITY ? __expf(l - max_lse) : 0.f;
        sum += w;
        CUTE_UNROLL
        for (int k = 0; k < kChunks; ++k) accumulate(acc[k], w, widen_partial4<P>(o[u][k]));
      }
    }
    const int qi = int(in_req / a.num_heads), h = int(in_req % a.num_heads);
    CUTE_UNROLL
    for (int k = 0; k < kChunks; ++k) {
      store_combined<Out>(a, b, qi, h, k * 128 + lane * 4, acc[k], sum, max_lse, bad, lane == 0 && k == 0);
    }
    i += stride;
    if (i >= rows) break;
    locate(i, b, in_req, first_row, pieces);
  }
}

// Varlen launches (abi.h): out and lse of the packed tokens no request owns get NaN: tokens past
// query_start_loc[batch], those of a request longer than q_len, and every token when query_start_loc
// is malformed (not 0 first, decreasing, or past total_q_tokens), whose overlapping requests may have
// written anything. A CTA per kVarlenFillTokens tokens, run after the decode and combine kernels,
// which write only the tokens of well-placed requests (params.cuh query_row).
constexpr int kVarlenFillThreads = 128;
constexpr int kVarlenFillTokens = 16;
template <class Out>
__global__ void __launch_bounds__(kVarlenFillThreads) mla_varlen_fill_kernel(const __grid_constant__ MlaDecodeArgs a) {
  __shared__ int unowned[kVarlenFillTokens];
  const int32_t* loc = a.query_start_loc;
  bool malformed = false;
  for (int b = int(threadIdx.x); b < a.batch; b += kVarlenFillThreads) malformed |= __ldg(loc + b + 1) < __ldg(loc + b);
  if (threadIdx.x == 0) malformed |= __ldg(loc) != 0 || __ldg(loc + a.batch) > a.total_q_tokens;
  malformed = __syncthreads_or(malformed);
  const int t0 = int(blockIdx.x) * kVarlenFillTokens;
  if (threadIdx.x < kVarlenFillTokens) {
    const int t = t0 + int(threadIdx.x);
    bool u = false;
    if (t < a.total_q_tokens) {
      if (malformed || t >= __ldg(loc + a.batch)) {
        u = true;  // malformed, or past the last request: no owner
      } else {
        // the request that owns t: the last b with loc[b] <= t (loc non-decreasing, loc[0] = 0 <= t)
        int lo = 0, hi = a.batch - 1;
        while (lo < hi) {
          const int mid = lo + (hi - lo + 1) / 2;
          if (__ldg(loc + mid) <= t) lo = mid; else hi = mid - 1;
        }
        u = __ldg(loc + lo + 1) - __ldg(loc + lo) > a.q_len;  // longer than q_len: the decode skipped it
      }
    }
    unowned[threadIdx.x] = u;
  }
  __syncthreads();
  const uint32_t nan2 = pack2<Out>(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
  for (int k = 0; k < kVarlenFillTokens; ++k) {
    if (!unowned[k]) continue;  // the same for the whole CTA
    const int64_t t = t0 + k;
    Out* row = static_cast<Out*>(a.out) + t * a.out_stride_token;
    for (int i = int(threadIdx.x); i < a.num_heads * (kHeadDimV / 4); i += kVarlenFillThreads) {
      const int h = i / (kHeadDimV / 4), col = (i % (kHeadDimV / 4)) * 4;
      *reinterpret_cast<uint2*>(row + int64_t(h) * a.out_stride_head + col) = make_uint2(nan2, nan2);
    }
    for (int h = int(threadIdx.x); h < a.num_heads; h += kVarlenFillThreads) {
      a.lse[int64_t(h) * a.lse_stride_head + t * a.lse_stride_token] = __int_as_float(0x7fc00000);
    }
  }
}

}  // namespace mla
