// What a decode CTA knows about its launch: the kernel parameters (the ABI struct plus values the host
// derives once), the CTA's request, query-row block and key range of the uniform split, and the
// trace and dependent-launch hooks every path calls.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the library does not link libcuda)
#include <cuda_runtime.h>

#include "abi.h"
#include "config.cuh"
#include "trace.cuh"

namespace mla {

// ---------------------------------------------------------------------------------------------
// Kernel parameters: the ABI struct plus values derived once on the host.

struct DecodeParams {
  MlaDecodeArgs a;
  int num_m_blocks;     // ceil(NUM_HEADS * q_len / ROWS) of the launched kernel (launch.cuh)
  float scale_log2;     // softmax_scale * log2(e)
  // kTmaPages kernels: use_tma = 1 when the host encoded kv_map (launch.cuh, tma_map.cuh), else every
  // tile takes the cp.async path. kv_map: the cache as {576 values, PAGE_SIZE tokens, pages}, box
  // {64, 64, 1}, 128-byte swizzle (fp8: bytes, no swizzle; the fp8 fast kernel's: bytes, box {128, 64,
  // 1}, 128-byte swizzle). CUtensorMap is 64-byte aligned (128 with CUDA 13's headers), so is
  // DecodeParams; the kernel takes it as a __grid_constant__ parameter, which TMA reads through its
  // generic address.
  int use_tma;
  CUtensorMap kv_map;
#if MLA_TRACE
  uint64_t* trace;      // the library's trace buffer (trace.cuh), or null
#endif
};

// Where query row (request b, query token qi of the launch's q_len, head h) lives in q, out and lse:
// element offsets ob * stride_batch + t * stride_token + h * stride_head. Uniform batch: (ob, t) = (b,
// qi). Varlen (query_start_loc set, abi.h): request b's q_len_b tokens take the last q_len_b rows, row qi
// is packed token t = query_start_loc[b] + qi - (q_len - q_len_b) and ob = 0. valid is false for
// padding: h >= num_heads, qi >= q_len, a varlen row before the request's first token, and every row of
// a request whose tokens do not lie within 0..total_q_tokens with 0 <= q_len_b <= q_len (the varlen
// fill kernel, combine.cuh, gives those tokens NaN).
struct QueryRow {
  bool valid;
  int ob, t;
};
__device__ __forceinline__ QueryRow query_row(const MlaDecodeArgs& a, int b, int qi, int h) {
  if (qi >= a.q_len || h >= a.num_heads) return {false, 0, 0};
  if (a.query_start_loc == nullptr) return {true, b, qi};
  const int start = __ldg(a.query_start_loc + b), end = __ldg(a.query_start_loc + b + 1);
  if (start < 0 || end < start || end > a.total_q_tokens) return {false, 0, 0};
  const int shift = a.q_len - (end - start);  // rows of the launch before the request's first token
  if (shift < 0 || qi < shift) return {false, 0, 0};
  return {true, 0, start + qi - shift};
}

// Whether the query-row block m_block of ROWS rows (row = qi * NUM_HEADS + h) lies wholly before request
// b's first token in a varlen launch (its q_len_b = query_start_loc[b + 1] - query_start_loc[b] is below
// the launch's q_len): such a CTA reads no keys and, query_row placing none of its rows, stores
// nothing (out, lse and workspace pieces are all stored through query_row).
// Both roles of a CTA evaluate it alike. It is query_row of the block's last query position: every
// block of a request that query_row never places (its tokens not within 0..total_q_tokens, or more
// than q_len of them) counts as empty too, and query_row's checks come before any subtraction.
template <int NUM_HEADS, int ROWS>
__device__ __forceinline__ bool row_block_empty(const MlaDecodeArgs& a, int b, int m_block) {
  if (a.query_start_loc == nullptr) return false;
  const int last_qi = min(a.q_len - 1, (m_block * ROWS + ROWS - 1) / NUM_HEADS);
  return !query_row(a, b, last_qi, 0).valid;  // head 0 < num_heads: only the request's tokens decide
}

// The calling CTA's phase-trace sink for thread `thread` (trace.cuh); a no-op unless MLA_TRACE.
__device__ __forceinline__ TraceSink trace_at(const DecodeParams& p, int thread) {
#if MLA_TRACE
  return trace_sink(p.trace, thread);
#else
  return TraceSink{nullptr};
#endif
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
// The uniform launch's work of this CTA; none (num_tiles 0) for a row block without a placed row
// (row_block_empty).
template <int NUM_HEADS, int PAGE_SIZE, int ROWS>
__device__ __forceinline__ CtaWork cta_work(const DecodeParams& p) {
  const MlaDecodeArgs& a = p.a;
  CtaWork w;
  cta_coords(p, w.b, w.m_block, w.split);
  w.seq_len = checked_seq_len<PAGE_SIZE>(a, w.b, w.bad_len);
  split_range(w.seq_len, a.num_kv_splits, w.split, w.kv_begin, w.kv_end);
  if (row_block_empty<NUM_HEADS, ROWS>(a, w.b, w.m_block)) w.kv_end = w.kv_begin;
  w.num_tiles = tiles_of(w.kv_end - w.kv_begin);
  return w;
}

// Split variants: allow the combine grid, a programmatic dependent launch (launch.cuh), to be scheduled. The trigger counts per CTA (the
// first thread to execute it fires it for its CTA; the early-returning producer neither fires nor holds
// it), so the combine can be scheduled once every decode CTA has a math warp past its stores; results
// do not depend on it, since the combine waits for the whole decode grid before reading.
template <bool SPLIT>
__device__ __forceinline__ void allow_dependent_launch() {
  if constexpr (SPLIT) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

}  // namespace mla
