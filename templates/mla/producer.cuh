// The producer warpgroup of the decode kernel (see kernel.cuh for the whole CTA): it gathers Q and
// every KV tile of a split through block_table into the shared-memory ring and signals each 8 KiB
// slot's "full" mbarrier; bf16/fp16 caches with 16-byte cp.async straight into the ring, fp8 caches
// through raw staging tiles widened to fp16.
#pragma once
#include "abi.h"
#include "constants.cuh"
#include "layouts.cuh"
#include "primitives.cuh"

namespace mla {

// ---------------------------------------------------------------------------------------------
// The producer warpgroup: global -> shared copies, all 16-byte cp.async.

// Where row `row` of this CTA's Q block comes from: its q_nope and q_pe rows (16-bit values), or
// valid == false for a padding row (h >= num_heads or qi >= q_len), whose pointers stay at the
// tensors' bases so that a zero-filling copy still names a mapped address.
struct QRowSource {
  const char* nope;
  const char* pe;
  bool valid;
  // The c-th 16-byte chunk of the 576-value row (64 latent chunks, then 8 RoPE chunks).
  __device__ __forceinline__ const char* chunk(int c) const {
    return c < kKvLoraRank / kChunkElems ? nope + (valid ? c * 16 : 0) : pe + (valid ? (c - kKvLoraRank / kChunkElems) * 16 : 0);
  }
};

template <int NUM_HEADS>
__device__ __forceinline__ QRowSource q_row_source(const MlaDecodeArgs& a, int b, int m_block, int row) {
  const int grow = m_block * kBlockM + row;
  const int qi = grow / NUM_HEADS;
  const int h = grow % NUM_HEADS;
  QRowSource r{static_cast<const char*>(a.q_nope), static_cast<const char*>(a.q_pe), qi < a.q_len && h < a.num_heads};
  if (r.valid) {
    r.nope += (int64_t(b) * a.q_nope_stride_batch + int64_t(qi) * a.q_nope_stride_token +
               int64_t(h) * a.q_nope_stride_head) * 2;
    r.pe += (int64_t(b) * a.q_pe_stride_batch + int64_t(qi) * a.q_pe_stride_token + int64_t(h) * a.q_pe_stride_head) * 2;
  }
  return r;
}

// Q block: eight producer threads copy one 1152-byte row (9 chunks each), 16 rows per pass.
template <class Element, int NUM_HEADS>
__device__ __forceinline__ void load_q_block(Element* sq, const MlaDecodeArgs& a, int b, int m_block, int ptid) {
  const int sub = ptid % kThreadsPerRow;
  constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
  CUTE_UNROLL
  for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + ptid / kThreadsPerRow;
    const QRowSource q = q_row_source<NUM_HEADS>(a, b, m_block, row);
    CUTE_UNROLL
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      const int c = sub + k * kThreadsPerRow;
      const uint32_t dst = smem_u32(sq) + swizzled_offset(row, c * kChunkElems, kBlockM);
      cp_async_16_zfill(dst, q.chunk(c), q.valid);  // padding rows: zeros
    }
  }
}

// The whole producer: Q, then every KV tile of [kv_begin, kv_end) sub-tile by sub-tile. Eight
// threads share a 128-byte row segment of a sub-tile (one 16-byte chunk each), so every warp
// instruction reads 4 full 128-byte lines; a thread owns the tile's rows ptid / 8 + 16 j (j < 4),
// whose pages are looked up one tile ahead. Rows past kv_end are zero-filled (zeros, so 0 * V never
// meets a NaN left in an unused cache slot).
template <class Element, int NUM_HEADS, int PAGE_SIZE>
__device__ __forceinline__ void produce(SharedStorage<Element>& s, const MlaDecodeArgs& a, int b, int m_block,
                                        int kv_begin, int kv_end, int num_tiles, int ptid) {
  load_q_block<Element, NUM_HEADS>(s.q, a, b, m_block, ptid);
  cp_async_arrive_noinc(&s.q_full);

  constexpr int kRowsPerPass = kProducerThreads / 8;  // 16
  constexpr int kPasses = kBlockN / kRowsPerPass;     // 4
  const int sub = ptid % 8;      // 16-byte chunk within the 128-byte segment
  const int n0 = ptid / 8;       // first token row; rows n0 + 16 j
  const int32_t* table = a.block_table + int64_t(b) * a.block_table_stride;
  const char* cache = static_cast<const char*>(a.kv_cache);
  // Shared-memory destination of this thread's chunk of row n0 + 16 j in sub-tile 0 (sub-tile c adds
  // c * 8 KiB); (n0 + 16 j) & 7 == n0 & 7, so the swizzled chunk is the same for every j.
  const uint32_t chunk_dst = uint32_t(n0 >> 3) * 1024u + uint32_t(n0 & 7) * 128u + uint32_t((sub ^ (n0 & 7)) * 16);

  int32_t page[kPasses], next_page[kPasses];
  auto lookup = [&](int t, int32_t (&pg)[kPasses]) {
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) {
      const int token = kv_begin + t * kBlockN + n0 + kRowsPerPass * j;
      pg[j] = token < kv_end ? table[token / PAGE_SIZE] : -1;
    }
  };
  lookup(0, page);
  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) lookup(t + 1, next_page);
    const char* src[kPasses];
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) {
      const int token = kv_begin + t * kBlockN + n0 + kRowsPerPass * j;
      src[j] = page[j] >= 0 ? cache + (int64_t(page[j]) * a.kv_stride_page + int64_t(token % PAGE_SIZE) * a.kv_stride_token) *
                                          int64_t(sizeof(Element)) + sub * 16
                            : cache;
    }
    const int stage = t % kStages;
    const int empty_parity = ((t / kStages) & 1) ^ 1;  // the first use of a slot does not wait
    const uint32_t stage_dst = smem_u32(s.kv[stage]) + chunk_dst;
    CUTE_UNROLL
    for (int c = 0; c < kSubTiles; ++c) {
      const int slot = stage * kSubTiles + c;
      wait_barrier(&s.kv_empty[slot], empty_parity);
      CUTE_UNROLL
      for (int j = 0; j < kPasses; ++j) {
        cp_async_16_zfill(stage_dst + uint32_t(c) * 8192u + uint32_t(j) * 2048u,
                          src[j] + (page[j] >= 0 ? c * 128 : 0), page[j] >= 0);
      }
      cp_async_arrive_noinc(&s.kv_full[slot]);
    }
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) page[j] = next_page[j];
  }
  cp_async_wait_all();  // do not retire while copies are in flight
}

// The fp8 producer. Q (bf16) is converted to fp16 x kFp8QPrescale through registers. KV tiles are
// copied raw (1 byte a value) by cp.async into two staging tiles, then widened sub-tile by sub-tile
// into the one fp16 KV tile as the math warps release its slots; rows past kv_end are zero bytes,
// which widen to +0.
template <int NUM_HEADS>
__device__ __forceinline__ void load_q_block_fp8(cutlass::half_t* sq, const MlaDecodeArgs& a, int b, int m_block,
                                                 int ptid) {
  const int sub = ptid % kThreadsPerRow;
  constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
#pragma unroll 1
  for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + ptid / kThreadsPerRow;
    const QRowSource q = q_row_source<NUM_HEADS>(a, b, m_block, row);
#pragma unroll 3  // a few loads in flight within the producer's 40 registers
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      const int c = sub + k * kThreadsPerRow;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (q.valid) {
        v = __ldg(reinterpret_cast<const uint4*>(q.chunk(c)));
        v = make_uint4(bf16x2_to_f16x2_prescaled(v.x), bf16x2_to_f16x2_prescaled(v.y),
                       bf16x2_to_f16x2_prescaled(v.z), bf16x2_to_f16x2_prescaled(v.w));
      }
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(sq) + swizzled_offset(row, c * kChunkElems, kBlockM)) = v;
    }
  }
}

// Raw copy of tile t into staging buffer `buf`: four threads per 576-byte row (9 chunks each, so a
// warp reads 8 rows x 64 contiguous bytes per instruction), 2 rows per thread.
template <int PAGE_SIZE>
__device__ __forceinline__ void stage_fp8_tile(Fp8Staging& st, int buf, const MlaDecodeArgs& a, const int32_t* table,
                                               int tile_start, int kv_end, int ptid) {
  const char* cache = static_cast<const char*>(a.kv_cache);
  const int sub = ptid % 4;
#pragma unroll 1  // kept rolled: unrolled, the page-1 lookup spills in the producer's 40 registers
  for (int pass = 0; pass < 2; ++pass) {
    const int n = pass * 32 + ptid / 4;
    const int token = tile_start + n;
    const int32_t page = token < kv_end ? table[token / PAGE_SIZE] : -1;
    const bool valid = page >= 0;  // as the bf16 path: a negative page id reads nothing (zeros)
    const char* src = valid ? cache + int64_t(page) * a.kv_stride_page + int64_t(token % PAGE_SIZE) * a.kv_stride_token
                            : cache;
    const uint32_t dst = smem_u32(st.tile[buf]) + uint32_t(n * kHeadDimK);
    CUTE_UNROLL
    for (int k = 0; k < kHeadDimK / 16 / 4; ++k) {
      const int c = sub + 4 * k;
      cp_async_16_zfill(dst + c * 16, src + (valid ? c * 16 : 0), valid);
    }
  }
  cp_async_arrive_noinc(&st.full[buf]);
}

template <int NUM_HEADS, int PAGE_SIZE>
__device__ __forceinline__ void produce_fp8(SharedStorage<cutlass::float_e4m3_t>& s, const MlaDecodeArgs& a, int b,
                                            int m_block, int kv_begin, int kv_end, int num_tiles, int ptid) {
  Fp8Staging& st = s.staging;
  const int32_t* table = a.block_table + int64_t(b) * a.block_table_stride;
  stage_fp8_tile<PAGE_SIZE>(st, 0, a, table, kv_begin, kv_end, ptid);
  if (num_tiles > 1) stage_fp8_tile<PAGE_SIZE>(st, 1, a, table, kv_begin + kBlockN, kv_end, ptid);
  load_q_block_fp8<NUM_HEADS>(s.q, a, b, m_block, ptid);
  arrive_barrier(&s.q_full);

  // Widening: thread -> row n = ptid / 2, 32 columns (half = ptid % 2) of each 64-column sub-tile.
  const int n = ptid / 2;
  const int half = ptid % 2;
  for (int t = 0; t < num_tiles; ++t) {
    const int buf = t % 2;
    wait_barrier(&st.full[buf], (t / 2) & 1);
    const uint8_t* row = st.tile[buf] + n * kHeadDimK + half * 32;
    char* dst = reinterpret_cast<char*>(s.kv[0]);
#pragma unroll 1  // kept rolled: the producer has few registers
    for (int c = 0; c < kSubTiles; ++c) {
      wait_barrier(&s.kv_empty[c], (t & 1) ^ 1);  // one fp16 stage: use t of every slot
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {  // 16 fp8 values -> two 16-byte fp16 chunks
        const uint4 v = *reinterpret_cast<const uint4*>(row + c * kSubTileCols + h * 16);
        const uint2 w0 = e4m3x4_to_f16x4(v.x), w1 = e4m3x4_to_f16x4(v.y);
        const uint2 w2 = e4m3x4_to_f16x4(v.z), w3 = e4m3x4_to_f16x4(v.w);
        const int col = c * kSubTileCols + half * 32 + h * 16;
        *reinterpret_cast<uint4*>(dst + swizzled_offset(n, col, kBlockN)) = make_uint4(w0.x, w0.y, w1.x, w1.y);
        *reinterpret_cast<uint4*>(dst + swizzled_offset(n, col + 8, kBlockN)) = make_uint4(w2.x, w2.y, w3.x, w3.y);
      }
      arrive_barrier(&s.kv_full[c]);
    }
    producer_barrier();  // every producer thread is done reading staging buffer `buf`
    if (t + 2 < num_tiles) stage_fp8_tile<PAGE_SIZE>(st, buf, a, table, kv_begin + (t + 2) * kBlockN, kv_end, ptid);
  }
  cp_async_wait_all();
}

}  // namespace mla
