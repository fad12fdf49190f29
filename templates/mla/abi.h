// The C ABI between the Python binding (mla_variants/_binding.py) and every generated launcher.
//
// One struct carries a decode call: raw device pointers, int64 strides in elements, sizes, and the
// CUDA stream. Python fills it through ctypes; a launcher reads it and returns a cudaError_t code
// (0 = success). Bump MLA_ABI_VERSION whenever the struct or an exported function's signature changes
// (the launchers, mla_variants_schedule, ...); the binding refuses a library built with another version.
#pragma once
#include <stdint.h>

#define MLA_ABI_VERSION 7

#ifdef __cplusplus
extern "C" {
#endif

// MlaDecodeArgs.tma_mode.
enum MlaTmaMode { MlaTmaAuto = 0, MlaTmaOff = 1, MlaTmaRequire = 2 };

typedef struct MlaDecodeArgs {
  int32_t abi_version;
  int32_t batch;             // number of requests
  int32_t q_len;             // query tokens per request (1..8), causal bottom-right when > 1
  int32_t num_heads;         // heads in this launch (<= the variant's compiled num_heads)
  int32_t max_pages_per_seq; // block_table.shape[1]
  int32_t num_kv_splits;     // >= 1; must be 1 for a variant without split-KV
  int32_t max_seq_len;       // the caller's upper bound of seq_lens, or 0 (unknown: the block table's
                             // capacity). Picks a kernel only (a variant's second kernel for short
                             // splits, launch.cuh); any seq_lens within the block table stay exact.

  // q as two views: q_nope [batch, q_len, num_heads, 512] and q_pe [batch, q_len, num_heads, 64],
  // last dimension contiguous. A packed q [.., 576] passes q_pe = q_nope + 512.
  const void* q_nope;
  int64_t q_nope_stride_batch, q_nope_stride_token, q_nope_stride_head;
  const void* q_pe;
  int64_t q_pe_stride_batch, q_pe_stride_token, q_pe_stride_head;

  // kv_cache [num_pages, page_size, 576], last dimension contiguous; bf16/fp16 like q, or fp8 e4m3
  // (then q and out are bf16 and a cache value times k_scale is the real value).
  const void* kv_cache;
  int64_t kv_stride_page, kv_stride_token;
  float k_scale;               // fp8 only: the dequantization scale, used when k_scale_ptr is null
  const float* k_scale_ptr;    // fp8 only: device pointer to the scale (read by the kernel), or null

  const int32_t* block_table;  // [batch, max_pages_per_seq], row stride below, last dim contiguous
  int64_t block_table_stride;
  const int32_t* seq_lens;     // [batch], contiguous

  float softmax_scale;

  void* out;                   // [batch, q_len, num_heads, 512] in q's dtype, last dim contiguous; the
                               // base and the strides (elements) 8-byte aligned: the kernels store
                               // 8 or 16 bytes at a time (16 where base and strides allow it)
  int64_t out_stride_batch, out_stride_token, out_stride_head;
  float* lse;                  // [batch, num_heads, q_len] fp32, natural log
  int64_t lse_stride_batch, lse_stride_head, lse_stride_token;

  // Split-KV workspace: pieces * q_len * num_heads * (512 + 1) fp32 values, pieces = num_kv_splits *
  // batch (uniform split) or batch + sched_ctas (balanced schedule).
  float* workspace;
  int64_t workspace_bytes;

  // Balanced schedule (schedule.cuh; 64-row path of bf16/fp16 caches, split variants): null for the
  // uniform split. When set, num_kv_splits is ignored, the grid has num_m_blocks x sched_ctas CTAs
  // and CTA c covers the (request, tile) range the schedule gives it, crossing request boundaries.
  const int32_t* schedule;
  int32_t sched_ctas;
  // Varlen (mla_decode_varlen): total_q_tokens rows of a packed q / out ([total_q_tokens, num_heads,
  // ...]: the strides' token dimension; stride_batch 0) and columns of lse ([num_heads,
  // total_q_tokens]). query_start_loc: [batch + 1] int32 on the device; request b's q_len_b =
  // query_start_loc[b + 1] - query_start_loc[b] (0..q_len) tokens start at row query_start_loc[b] and
  // take the last q_len_b of the launch's q_len query rows, so the causal bound stays bottom-right.
  // Tokens of no request, and every token when query_start_loc is malformed, get NaN out and lse.
  // Null for a uniform batch.
  int32_t total_q_tokens;
  const int32_t* query_start_loc;

  // How full KV tiles on TMA pages are loaded (MlaTmaMode): MlaTmaAuto by TMA where the cache's tensor
  // map can be encoded, else by cp.async; MlaTmaOff always by cp.async; MlaTmaRequire fails
  // the launch with cudaErrorNotSupported where a TMA-capable kernel cannot encode the map (tests use
  // it to prove which path ran). Kernels without TMA pages ignore it.
  int32_t tma_mode;

  void* stream;                // cudaStream_t
} MlaDecodeArgs;

#ifdef __cplusplus
}
#endif
