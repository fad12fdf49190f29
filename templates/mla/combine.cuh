// Split-KV combine: merges the per-split normalised partial outputs by their log-sum-exp.
//
// For row i with split results (o_s, lse_s): lse = log(sum_s exp(lse_s)) and
// o = sum_s exp(lse_s - lse) o_s (the standard flash-decoding reduction). Splits that saw no key
// carry lse_s = -inf and weigh exactly 0; a row with no key at all gets out 0 and lse -inf.
#pragma once
#include <cuda_runtime.h>

#include "abi.h"
#include "constants.cuh"
#include "kernel.cuh"

namespace mla {

constexpr int kCombineThreads = kHeadDimV / 4;  // each thread owns 4 output columns

// Grid: one CTA per (request, query token, head) row.
template <class Out>
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const __grid_constant__ MlaDecodeArgs a) {
  const int64_t row = blockIdx.x;  // ((b * q_len) + qi) * num_heads + h
  const int h = int(row % a.num_heads);
  const int qi = int((row / a.num_heads) % a.q_len);
  const int b = int(row / (int64_t(a.num_heads) * a.q_len));
  const int64_t rows_per_split = int64_t(a.batch) * a.q_len * a.num_heads;
  const SplitWorkspace ws = split_workspace(a);

  float max_lse = -INFINITY;
  bool bad = false;  // a split marked its request invalid (NaN lse): the row stays NaN
  for (int split = 0; split < a.num_kv_splits; ++split) {
    const float l = ws.lse[split * rows_per_split + row];
    bad |= isnan(l);
    max_lse = fmaxf(max_lse, l);
  }

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int split = 0; split < a.num_kv_splits; ++split) {
      const float w = __expf(ws.lse[split * rows_per_split + row] - max_lse);
      if (w == 0.f) continue;  // empty split: its partial output is never read
      const float4 o = *reinterpret_cast<const float4*>(ws.o + (split * rows_per_split + row) * kHeadDimV + threadIdx.x * 4);
      sum += w;
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
    }
  }
  float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (bad) inv = sum = __int_as_float(0x7fc00000);
  Out* dst = static_cast<Out*>(a.out) + int64_t(b) * a.out_stride_batch + int64_t(qi) * a.out_stride_token +
                 int64_t(h) * a.out_stride_head + threadIdx.x * 4;
  uint2 packed;
  packed.x = pack2<Out>(acc.x * inv, acc.y * inv);
  packed.y = pack2<Out>(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(dst) = packed;
  if (threadIdx.x == 0) {
    a.lse[int64_t(b) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(qi) * a.lse_stride_token] =
        bad ? sum : (sum > 0.f ? max_lse + logf(sum) : -INFINITY);
  }
}

}  // namespace mla
