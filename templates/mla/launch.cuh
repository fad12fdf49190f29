// Host side of one variant: checks the arguments the kernel relies on, sizes the grid, launches the
// decode kernel and, for split-KV variants, the combine kernel. Included by each generated
// translation unit, which instantiates launch<Cache, NUM_HEADS, PAGE_SIZE, SPLIT> (Cache: the kv_cache element type).
#pragma once
#include <cuda_runtime.h>

#include "abi.h"
#include "combine.cuh"
#include "kernel.cuh"

namespace mla {

template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
int launch(const MlaDecodeArgs* args) {
  static_assert(NUM_HEADS >= 1 && PAGE_SIZE >= 1, "variant fields must be positive");
  if (args == nullptr || args->abi_version != MLA_ABI_VERSION) return int(cudaErrorInvalidValue);
  const MlaDecodeArgs& a = *args;
  if (a.batch < 0 || a.q_len < 1 || a.num_heads < 1 || a.num_heads > NUM_HEADS || a.num_kv_splits < 1 ||
      a.num_kv_splits > 65535 || (!SPLIT && a.num_kv_splits != 1) || a.max_pages_per_seq < 1) {
    return int(cudaErrorInvalidValue);
  }
  if (CacheTypes<Cache>::kFp8 && a.k_scale_ptr == nullptr && !(a.k_scale > 0.f && a.k_scale < INFINITY)) {
    return int(cudaErrorInvalidValue);
  }
  if (a.batch == 0) return int(cudaSuccess);
  if (SPLIT && a.num_kv_splits > 1) {
    const int64_t need = int64_t(a.num_kv_splits) * a.batch * a.q_len * a.num_heads * (kHeadDimV + 1) * 4;
    if (a.workspace == nullptr || a.workspace_bytes < need) return int(cudaErrorInvalidValue);
  }
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);

  DecodeParams p;
  p.a = a;
  p.num_m_blocks = (NUM_HEADS * a.q_len + kBlockM - 1) / kBlockM;
  p.scale_log2 = a.softmax_scale * kLog2e;
  const int64_t grid_x = int64_t(p.num_m_blocks) * a.batch;
  if (grid_x > 0x7fffffff) return int(cudaErrorInvalidConfiguration);

  auto kernel = mla_decode_kernel<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>;
  const int smem_bytes = int(sizeof(SharedStorage<Cache>)) + 1024;  // + room to align to 1024
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return int(err);
  kernel<<<dim3(unsigned(grid_x), unsigned(a.num_kv_splits), 1), kNumThreads, smem_bytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);

  if (SPLIT && a.num_kv_splits > 1) {
    const int64_t rows = int64_t(a.batch) * a.q_len * a.num_heads;
    if (rows > 0x7fffffff) return int(cudaErrorInvalidConfiguration);
    // A plain launch. Launched as a programmatic dependent (PDL) the combine gained 1-2 us on short
    // calls but lost up to 18 us when the decode grid left few SMs idle: the early combine CTAs
    // crowded onto those SMs (docs/perf-notes.md, v3).
    mla_combine_kernel<typename CacheTypes<Cache>::Out><<<unsigned(rows), kCombineThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  }
  return int(err);
}

}  // namespace mla
