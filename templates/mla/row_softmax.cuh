// Online-softmax steps on a 64-row wgmma accumulator fragment (rows on the M side), shared by the
// 16-bit 64-row consumer (consumer_rows64.cuh, S = Q K^T) and the fp8 fast kernel (fp8_fast.cuh).
// Element i of a thread's fragment is row row0 + 8 ((i >> 1) & 1), column (i >> 2) 8 + 2 (lane % 4) +
// (i & 1); a fragment of kElems elements per thread spans 2 kElems columns.
#pragma once
#include <cuda_runtime.h>

#include "arch.cuh"  // exp2_ftz

namespace mla {

// Scale to the log2 domain (row r's factor scale(r)), mask keys >= key_limit[r] (column n is key
// tile_start + n), row max over the four threads that hold a row. A tile that ends at or below the
// warp's unmasked_end (every tile but a split's or a causal row's last, in practice) skips the mask:
// the test is the same for the whole warp. at(i) is element i of the fragment.
template <int kElems, class At, class Scale>
__device__ __forceinline__ void scale_mask_rowmax(At&& at, Scale&& scale, int tile_start, int unmasked_end,
                                                  const int (&key_limit)[2], int lane, float (&tile_max)[2]) {
  tile_max[0] = tile_max[1] = -INFINITY;
  if (tile_start <= unmasked_end - 2 * kElems) {  // (written so that nothing overflows near INT_MAX)
    CUTE_UNROLL
    for (int i = 0; i < kElems; ++i) {
      const int r = (i >> 1) & 1;
      at(i) *= scale(r);
      tile_max[r] = fmaxf(tile_max[r], at(i));
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < kElems; ++i) {
      const int r = (i >> 1) & 1;
      const int key = tile_start + (i >> 2) * 8 + 2 * (lane % 4) + (i & 1);
      const float v = key < key_limit[r] ? at(i) * scale(r) : -INFINITY;
      at(i) = v;
      tile_max[r] = fmaxf(tile_max[r], v);
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
  }
}

// The running max becomes m_new: alpha = the factor for what was accumulated so far, m_sub = what
// the tile's scores subtract.
__device__ __forceinline__ void advance_max(float (&m_run)[2], const float (&m_new)[2], float (&alpha)[2],
                                            float (&m_sub)[2]) {
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    m_sub[r] = m_new[r] == -INFINITY ? 0.f : m_new[r];
    alpha[r] = exp2_ftz(m_run[r] - m_sub[r]);
    m_run[r] = m_new[r];
  }
}

}  // namespace mla
