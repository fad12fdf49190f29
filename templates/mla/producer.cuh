// The producer warpgroup of the decode kernel for 16-bit caches (see kernel.cuh for the whole CTA): it
// gathers Q and every KV tile of a split through block_table into the shared-memory ring and signals
// each 8 KiB slot's "full" mbarrier, with 16-byte cp.async straight into the ring, or, for a page size
// that is a multiple of 64 on the 64-row path, full tiles with TMA. fp8 caches: producer_fp8.cuh.
#pragma once
#include "abi.h"
#include "arch.cuh"
#include "config.cuh"
#include "layouts.cuh"
#include "params.cuh"

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

// grow: the row's index over the request's q_len x NUM_HEADS rows (m_block * rows per CTA + row).
template <int NUM_HEADS>
__device__ __forceinline__ QRowSource q_row_source(const MlaDecodeArgs& a, int b, int grow) {
  const int h = grow % NUM_HEADS;
  const QueryRow q = query_row(a, b, grow / NUM_HEADS, h);
  QRowSource r{static_cast<const char*>(a.q_nope), static_cast<const char*>(a.q_pe), q.valid};
  if (r.valid) {
    r.nope += (int64_t(q.ob) * a.q_nope_stride_batch + int64_t(q.t) * a.q_nope_stride_token +
               int64_t(h) * a.q_nope_stride_head) * 2;
    r.pe += (int64_t(q.ob) * a.q_pe_stride_batch + int64_t(q.t) * a.q_pe_stride_token + int64_t(h) * a.q_pe_stride_head) * 2;
  }
  return r;
}

// Copies the Q rows of a block of kRows rows (64, or 8 / 16 on the transposed path), 16-byte chunk c
// of row `row` to shared address dst(row, c): eight producer threads copy one 1152-byte row (9 chunks
// each), 16 rows per pass; with 8 rows the upper half of the warpgroup copies nothing. Padding rows
// (h >= num_heads or qi >= q_len) are zero-filled.
template <int NUM_HEADS, int kRows, class Dst>
__device__ __forceinline__ void copy_q_rows(const MlaDecodeArgs& a, int b, int m_block, int ptid, Dst&& dst) {
  const int sub = ptid % kThreadsPerRow;
  constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
  CUTE_UNROLL
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + ptid / kThreadsPerRow;
    if (kRows % kRowsPerPass != 0 && row >= kRows) continue;
    const QRowSource q = q_row_source<NUM_HEADS>(a, b, m_block * kRows + row);
    CUTE_UNROLL
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      const int c = sub + k * kThreadsPerRow;
      cp_async_16_zfill(dst(row, c), q.chunk(c), q.valid);
    }
  }
}

// Q block straight into its swizzled tile (the wgmma operand layout).
template <class Element, int NUM_HEADS, int kRows>
__device__ __forceinline__ void load_q_block(Element* sq, const MlaDecodeArgs& a, int b, int m_block, int ptid) {
  copy_q_rows<NUM_HEADS, kRows>(a, b, m_block, ptid,
                                [&](int row, int c) { return smem_u32(sq) + swizzled_offset(row, c * kChunkElems, kRows); });
}

// Full tiles by TMA (kTmaPages, config.cuh): split_range starts every split at a multiple of kBlockN,
// so tile t of a split starts at token kv_begin + 64 t, a multiple of 64: with PAGE_SIZE % 64 == 0 a
// tile is exactly the 64 tokens at offset (kv_begin + 64 t) % PAGE_SIZE of one page, which one box
// {64 columns, 64 tokens, 1 page} per sub-tile addresses. fp8 caches take the same tiling for their
// raw bytes (copy_fp8_tiles), in the 64-token kernel only (not the short-split one).

// The TMA loop of produce (bf16/fp16), copy_fp8_tiles (fp8 raw bytes) and the fp8 fast kernel's
// produce: tiles [t0, t1), all full, of kv_begin's request, stage t % kRing, called by one converged
// warp whose lane 0 issues. A stage has kSlots slots, each with its empty barrier s.kv_empty[stage *
// kSlots + c] and full barrier full(slot), and kBoxes boxes of kBoxCols columns per slot (the 64-row
// kernels: nine slots of one 64-column box; the fast kernel: one slot of five 128-byte boxes). Per slot
// the warp waits for the slot's release (phases: the parity of each stage's first use, as in produce),
// then lane 0 announces kBytes on the slot's full barrier, issues the slot's boxes into dst(stage) +
// box * kSlotStride (coordinates: the box's first column, the tile's token offset in its page, the page)
// and arrives for the other kArrivals - 1 threads the barrier counts. The page is looked up one tile
// ahead. kUnrollSlots: the slots unrolled (bf16's) or a rolled loop (fp8's few registers).
template <int PAGE_SIZE, int kRing, uint32_t kBytes, uint32_t kSlotStride, int kArrivals, bool kUnrollSlots,
          int kSlots = kSubTiles, int kBoxes = 1, int kBoxCols = kSubTileCols, class Storage, class Dst, class Full>
__device__ __forceinline__ void tma_full_tiles(Storage& s, const int32_t* table, int kv_begin, int t0, int t1,
                                               int lane, const void* kv_map, int phases, Dst&& dst, Full&& full) {
  int32_t pg = t0 < t1 ? table[(kv_begin + t0 * kBlockN) / PAGE_SIZE] : 0;
  for (int t = t0; t < t1; ++t) {
    const int tile_start = kv_begin + t * kBlockN;
    const int32_t next_pg = t + 1 < t1 ? table[(tile_start + kBlockN) / PAGE_SIZE] : 0;
    const int stage = t % kRing;
    const int empty_parity = (((t / kRing) ^ (phases >> stage)) & 1) ^ 1;  // the first use does not wait
    const uint32_t stage_base = dst(stage);
    auto slot_step = [&](int c) {
      const int slot = stage * kSlots + c;
      wait_barrier(&s.kv_empty[slot], empty_parity);
      if (lane == 0) {
        arrive_expect_tx(full(slot), kBytes);
        CUTE_UNROLL
        for (int j = 0; j < kBoxes; ++j) {
          const int box = c * kBoxes + j;
          tma_load_3d(stage_base + uint32_t(box) * kSlotStride, kv_map, full(slot), box * kBoxCols,
                      tile_start % PAGE_SIZE, pg);
        }
        arrive_barrier_count(full(slot), kArrivals - 1);
      }
      __syncwarp();
    };
    if constexpr (kUnrollSlots) {
      CUTE_UNROLL
      for (int c = 0; c < kSlots; ++c) slot_step(c);
    } else {
#pragma unroll 1
      for (int c = 0; c < kSlots; ++c) slot_step(c);
    }
    pg = next_pg;
  }
}

// The whole producer: Q, then every KV tile of [kv_begin, kv_end) sub-tile by sub-tile. Eight
// threads share a 128-byte row segment of a sub-tile (one 16-byte chunk each), so every warp
// instruction reads 4 full 128-byte lines; a thread owns the tile's rows ptid / 8 + 16 j (j < 4),
// whose pages are looked up one tile ahead. Rows past kv_end are zero-filled (zeros, so 0 * V never
// meets a NaN left in an unused cache slot).
//
// With kTmaPages and a tensor map (kv_map != nullptr: the host encoded one), the full tiles (all 64
// tokens < kv_end: every tile but possibly the last) are loaded by TMA instead, by producer thread 0
// alone (warp 0 waits for each slot's empty barrier together, so that it reaches the named barrier
// below converged): per slot thread 0 announces 8 KiB on the slot's full barrier (arrive.expect_tx),
// issues the sub-tile's box and arrives for the other 127 producer threads too (arrive with a count),
// so the full barrier keeps its 128 arrivals on both paths. Warps 1-3 wait at a named barrier of the
// producer warpgroup (kBarProducer) meanwhile, instead of polling nine empty barriers per tile, and
// then all four warps copy the last tile if it is partial. No thread waits more than one phase ahead
// of a barrier: a thread's wait for the release of a slot's previous use u - 1 comes after the fill of
// u - 1 was allowed, i.e. after its own wait for the release of u - 2 (a cp.async tile) or after
// warp 0's (a TMA tile: the named barrier orders warp 0's last wait before the others' next one, and
// every call, each segment of a scheduled CTA included, passes it once). The tile that holds kv_end
// keeps the cp.async path,
// whose zero fill keeps whatever lies past seq_len (possibly NaN) out of shared memory. TMA writes
// the same bytes as the cp.async path: the map's 128-byte swizzle puts 16-byte chunk j of token row r
// at chunk j ^ (r % 8) of the row's 128 bytes in each 1024-byte group of 8 rows (the slot is 1024-byte
// aligned), which is swizzled_offset(r, 64 c + 8 j, 64) - 8192 c.
//
// Storage: SharedStorage<Element> (64 query rows) or SharedStorageSt<Element, kRows> (transposed
// path): only Q's row count differs, the KV ring and its barriers are the same.
//
// kQIssued: the uniform 16-bit kernels issue this thread's Q copies at CTA entry (kernel.cuh), before the
// q_full barrier existed; the arrive below still covers them, as cp.async.mbarrier.arrive tracks every
// earlier copy.
template <class Element, int NUM_HEADS, int PAGE_SIZE, bool kQIssued = false, class Storage>
__device__ __forceinline__ void produce(Storage& s, const MlaDecodeArgs& a, int b, int m_block,
                                        int kv_begin, int kv_end, int num_tiles, int ptid, const void* kv_map,
                                        int phases = 0) {
  constexpr bool kTma = kTmaPages<Element, PAGE_SIZE, Storage::kRowsPerCta>;
  if constexpr (kTma) {
    if (kv_map != nullptr && ptid == 0) prefetch_tensor_map(kv_map);
  }
  if constexpr (!kQIssued) load_q_block<typename Storage::Element, NUM_HEADS, Storage::kRowsPerCta>(s.q, a, b, m_block, ptid);
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
  // The first use of a slot does not wait; phases (a scheduled CTA's later segment): the parity of
  // each stage's first use in this segment.
  auto empty_parity_of = [&](int t) { return (((t / kStages) ^ (phases >> (t % kStages))) & 1) ^ 1; };
  int first_copied = 0;  // tiles before it went by TMA
  if constexpr (kTma) {
    if (kv_map != nullptr) {
      const int full_tiles = (kv_end - kv_begin) / kBlockN;  // every tile but a partial last one
      if (ptid < 32) {  // warp 0 waits (converged); its lane 0 issues
        tma_full_tiles<PAGE_SIZE, kStages, uint32_t(kBlockN * kSubTileCols * sizeof(Element)), 8192u, kProducerThreads,
                       /*kUnrollSlots=*/true>(
            s, table, kv_begin, 0, full_tiles, ptid, kv_map, phases, [&](int stage) { return smem_u32(s.kv[stage]); },
            [&](int slot) { return &s.kv_full[slot]; });
      }
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBarProducer), "n"(kProducerThreads) : "memory");
      first_copied = full_tiles;
    }
  }
  if (first_copied < num_tiles) lookup(first_copied, page);
  for (int t = first_copied; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) lookup(t + 1, next_page);
    const int stage = t % kStages;
    const int empty_parity = empty_parity_of(t);
    const char* src[kPasses];
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) {
      const int token = kv_begin + t * kBlockN + n0 + kRowsPerPass * j;
      src[j] = page[j] >= 0 ? cache + (int64_t(page[j]) * a.kv_stride_page + int64_t(token % PAGE_SIZE) * a.kv_stride_token) *
                                          int64_t(sizeof(Element)) + sub * 16
                            : cache;
    }
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

}  // namespace mla
