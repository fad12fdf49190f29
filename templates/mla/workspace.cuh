// The split-KV workspace (abi.h): where the decode kernel's partial results live and how they are
// stored and loaded. Written by the decode kernels' epilogues (epilogue.cuh), read by the combine
// kernels (combine.cuh).
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "abi.h"
#include "arch.cuh"
#include "config.cuh"

namespace mla {

// Where the split-KV partial results live inside the workspace: one [q_len, num_heads] block of rows
// per piece. Uniform split: piece split * batch + b; balanced schedule: the pieces schedule.cuh numbers,
// at most batch + sched_ctas - 1 (the workspace holds batch + sched_ctas).
// The partial outputs' element type of a variant with NUM_HEADS heads: the output's 16-bit type or
// fp32 (kPartial16, config.cuh). A partial is normalised (a convex combination of V rows, times k_scale
// for fp8, up to P's 16-bit rounding), so it stays in the output's range. The workspace keeps its fp32 size and layout either way (the
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

// The first workspace row of the piece a CTA writes (request b, split), or -1 where it writes out and lse
// directly. A uniform launch: piece split * batch + b when the call has more than one split (SPLIT
// variants). A scheduled one (SCHED): the piece schedule.cuh numbered for the segment (passed as split),
// -1 for a request that one CTA covers.
template <bool SPLIT, bool SCHED>
__host__ __device__ __forceinline__ int64_t piece_row_of(const MlaDecodeArgs& a, int b, int split) {
  if constexpr (SCHED) {
    return split < 0 ? -1 : int64_t(split) * a.q_len * a.num_heads;
  } else if constexpr (SPLIT) {
    return a.num_kv_splits > 1 ? (int64_t(split) * a.batch + b) * a.q_len * a.num_heads : -1;
  } else {
    return -1;
  }
}

template <class P>
__host__ __device__ __forceinline__ SplitWorkspace<P> split_workspace(const MlaDecodeArgs& a) {
  const int64_t rows = workspace_pieces(a) * a.q_len * a.num_heads;
  return SplitWorkspace<P>{reinterpret_cast<P*>(a.workspace), a.workspace + rows * kHeadDimV};
}

}  // namespace mla
