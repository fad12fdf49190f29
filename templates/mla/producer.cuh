// The producer warpgroup of the decode kernel (see kernel.cuh for the whole CTA): it gathers Q and
// every KV tile of a split through block_table into the shared-memory ring and signals each 8 KiB
// slot's "full" mbarrier; bf16/fp16 caches with 16-byte cp.async straight into the ring (or, for a
// page size that is a multiple of 64 on the 64-row path, full tiles with TMA); fp8 caches on the
// 64-row path with cp.async into the slot's upper half, widened to fp16 in place by two of its warps;
// fp8 caches on the transposed path (at most 32 heads) raw into a 4-stage (32 rows: 3) e4m3 ring that the math
// warpgroups convert in registers (produce_fp8_ring at the end of this file).
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

// grow: the row's index over the request's q_len x NUM_HEADS rows (m_block * rows per CTA + row).
template <int NUM_HEADS>
__device__ __forceinline__ QRowSource q_row_source(const MlaDecodeArgs& a, int b, int grow) {
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

// Whether a variant loads full KV tiles with TMA: bf16/fp16 caches whose pages hold whole 64-token
// tiles. split_range starts every split at a multiple of kBlockN, so tile t of a split starts at token
// kv_begin + 64 t, a multiple of 64: with PAGE_SIZE % 64 == 0 a tile is exactly the 64 tokens at
// offset (kv_begin + 64 t) % PAGE_SIZE of one page, which one box {64 columns, 64 tokens, 1 page}
// per sub-tile addresses. Only the 64-row path takes it (ROWS == kBlockM): the transposed path (kUseSt,
// at most 32 heads) measured 3.6% faster over the 26 16-head page-64/128 anchors with cp.async
// (MLA_TMA=0: 4.28 vs 4.07 TB/s at 16 x 128 x 16384; docs/perf-notes.md, v3.5).
// fp8 caches (MLA_FP8_TMA, constants.cuh) take the same tiling for their raw bytes (copy_fp8_tiles), in
// the 64-token kernel only (not the short-split one).
template <class Cache, int PAGE_SIZE, int ROWS>
constexpr bool kTmaPages = MLA_TMA != 0 && (!CacheTypes<Cache>::kFp8 || MLA_FP8_TMA != 0) && PAGE_SIZE % kBlockN == 0 &&
                           ROWS == kBlockM;
constexpr int kBarFp8Copy = 7;  // named barrier over the fp8 copy warps (MLA_FP8_TMA)

// The TMA loop of produce (bf16/fp16) and copy_fp8_tiles (fp8 raw bytes): tiles [t0, t1), all full,
// of kv_begin's request, stage t % kRing, called by one converged warp whose lane 0 issues. Per slot
// the warp waits for the slot's release (phases: the parity of each stage's first use, as in produce),
// then lane 0 announces kBytes on the slot's full barrier `full(slot)`, issues the box into
// dst(stage) + c * kSlotStride (coordinates: column block c, the tile's token offset in its page, the
// page) and arrives for the other kArrivals - 1 threads the barrier counts. The page is looked up one
// tile ahead. kUnrollSlots: the nine slots unrolled (bf16's) or a rolled loop (fp8's few registers).
template <int PAGE_SIZE, int kRing, uint32_t kBytes, uint32_t kSlotStride, int kArrivals, bool kUnrollSlots,
          class Storage, class Dst, class Full>
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
      const int slot = stage * kSubTiles + c;
      wait_barrier(&s.kv_empty[slot], empty_parity);
      if (lane == 0) {
        arrive_expect_tx(full(slot), kBytes);
        tma_load_3d(stage_base + uint32_t(c) * kSlotStride, kv_map, full(slot), c * kSubTileCols,
                    tile_start % PAGE_SIZE, pg);
        arrive_barrier_count(full(slot), kArrivals - 1);
      }
      __syncwarp();
    };
    if constexpr (kUnrollSlots) {
      CUTE_UNROLL
      for (int c = 0; c < kSubTiles; ++c) slot_step(c);
    } else {
#pragma unroll 1
      for (int c = 0; c < kSubTiles; ++c) slot_step(c);
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
constexpr int kBarProducer = 13;  // named barrier over the 128 producer threads

// kQIssued (MLA_Q_FIRST): the kernel already issued this thread's Q copies (before the q_full barrier
// existed); the arrive below still covers them, as cp.async.mbarrier.arrive tracks every earlier copy.
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

// The fp8 producer: Q (bf16) is copied into the fp16 Q tile and rounded there to fp16 x kFp8QPrescale
// by the producer (load_q_block_fp8; rounding by the math warps instead measured 0.93-0.95 at batch 1,
// docs/perf-notes.md v3.26); each KV slot's
// raw bytes (64 tokens x 64 values, 4 KiB) are copied by cp.async into the upper half of the slot's own
// 8 KiB fp16 sub-tile and widened there in place (e4m3 -> fp16 is exact), so fp8 needs no staging
// memory and keeps two fp16 stages. Warps 0-1 copy (they wait for empty slots), warps 2-3 widen (they
// wait for raw bytes): the copy warps never wait for the widen warps, so a slot that is being refilled
// never holds up the widening of a tile the math warpgroups need in order to release it. Rows past kv_end are zero bytes,
// which widen to +0.
// The caller issued this thread's Q copies and committed them as a group, followed by tile 0's
// copies as another: only Q's group is waited for.
template <int NUM_HEADS, int kRows>
__device__ __forceinline__ void load_q_block_fp8(cutlass::half_t* sq, const MlaDecodeArgs& a, int b, int m_block,
                                                 int ptid) {
  // Q's bf16 bytes go by cp.async straight into the fp16 tile (same 2-byte element, same swizzle:
  // all of a thread's copies in flight at once), then each thread rounds the chunks it copied to
  // fp16 (times the prescale) in place. The first version loaded Q through registers, 3 chunks at a
  // time: 12 dependent round trips for 64 rows (docs/perf-notes.md, fp8 v3).
  cp_async_wait_group<1>();  // Q's group; tile 0's raw bytes stay in flight
  const int sub = ptid % kThreadsPerRow;
  constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
  CUTE_UNROLL
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + ptid / kThreadsPerRow;
    if (kRows % kRowsPerPass != 0 && row >= kRows) break;
#pragma unroll 3
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      uint4* p = reinterpret_cast<uint4*>(reinterpret_cast<char*>(sq) +
                                          swizzled_offset(row, (sub + k * kThreadsPerRow) * kChunkElems, kRows));
      *p = bf16x8_to_f16x8_prescaled(*p);  // padding rows hold zeros, which stay zeros
    }
  }
}

constexpr int kFp8CopyThreads = 64;   // warps 0-1 of the producer
constexpr int kFp8WidenThreads = 64;  // warps 2-3: two half rows of a slot each
static_assert(kFp8CopyThreads + kFp8WidenThreads == kProducerThreads && kFp8WidenThreads == 64,
              "fp8 producer split: two widening threads per row of a 64-token slot, four per row of a 32-token one");

// Barrier 8 over the 64 widening threads: every raw byte of a slot is read before any fp16 lands on it.
__device__ __forceinline__ void widen_barrier() {
  asm volatile("bar.sync 8, %0;\n" ::"n"(kFp8WidenThreads) : "memory");
}

// Copies the raw e4m3 bytes of tiles [first_tile, last_tile), slot after slot as the math warps release
// it, with kCopyThreads threads: thread ct copies 16-byte chunk ct % 4 of rows ct / 4 + (kCopyThreads /
// 4) j of every slot (a warp: 8 rows x 64 bytes per instruction) and arrives on the slot's "raw bytes
// landed" barrier (Storage::raw_landed). Raw row m of a slot sits at Storage::kRawSlotOffset + 64 m:
// the upper half of an fp16 slot on the 64-row path (64 copy threads, 2 fp16 stages; 4 of 32 tokens
// in the short-split kernel), a 4 KiB raw slot of the transposed path's ring (128 copy threads, 4 stages).
// Pages are looked up one tile ahead; rows past kv_end are zero bytes.
// kv_map (MLA_FP8_TMA, 64-token tiles only; null otherwise): the full tiles go by TMA as in produce (tma_full_tiles):
// warp 0 waits for each slot's release together, its lane 0 announces the 4 KiB on the slot's
// raw_full barrier, issues the box and arrives for the other copy threads; warp 1 waits at a named
// barrier of the copy warps meanwhile, so no copy thread waits more than one phase ahead (produce's
// argument); then both copy the tile that holds kv_end, if it is partial, by cp.async.
template <int PAGE_SIZE, int kCopyThreads, class Storage>
__device__ __forceinline__ void copy_fp8_tiles(Storage& s, const MlaDecodeArgs& a,
                                               const int32_t* table, int kv_begin, int kv_end, int first_tile,
                                               int last_tile, int ct, const void* kv_map = nullptr) {
  constexpr int kRowStep = kCopyThreads / 4;
  constexpr int kTileN = Storage::kTileN;
  constexpr int kRows = kTileN / kRowStep;  // rows per thread per tile
  constexpr int kSlotBytes = int(sizeof(s.kv[0])) / kSubTiles;
  static_assert(!Storage::kRegWiden || kRowStep % 8 == 0, "rows n0 + kRowStep j share one swizzled chunk (raw_offset)");
  const char* cache = static_cast<const char*>(a.kv_cache);
  const int n0 = ct / 4, q = ct % 4;
  if constexpr (kTileN == kBlockN && !Storage::kRegWiden && PAGE_SIZE % kBlockN == 0) {
    if (kv_map != nullptr) {
      const int full_tiles = min(last_tile, (kv_end - kv_begin) / kTileN);
      if (ct < 32) {  // warp 0 waits (converged); its lane 0 issues
        tma_full_tiles<PAGE_SIZE, Storage::kRing, uint32_t(kTileN * kSubTileCols), uint32_t(kSlotBytes), kCopyThreads,
                       /*kUnrollSlots=*/false>(
            s, table, kv_begin, first_tile, full_tiles, ct, kv_map, /*phases=*/0,
            [&](int stage) { return smem_u32(&s.kv[stage]) + Storage::kRawSlotOffset; },
            [&](int slot) { return s.raw_landed(slot); });
      }
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBarFp8Copy), "n"(kCopyThreads) : "memory");
      first_tile = max(first_tile, full_tiles);
    }
  }
  int32_t page[kRows], next_page[kRows];
  auto lookup = [&](int t, int32_t (&pg)[kRows]) {
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) {
      const int token = kv_begin + t * kTileN + n0 + kRowStep * j;
      pg[j] = t < last_tile && token < kv_end ? table[token / PAGE_SIZE] : -1;
    }
  };
  lookup(first_tile, page);
  for (int t = first_tile; t < last_tile; ++t) {
    lookup(t + 1, next_page);
    const char* src[kRows];
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) {
      const int token = kv_begin + t * kTileN + n0 + kRowStep * j;
      src[j] = page[j] >= 0 ? cache + int64_t(page[j]) * a.kv_stride_page + int64_t(token % PAGE_SIZE) * a.kv_stride_token + q * 16
                            : cache;
    }
    const int stage = t % Storage::kRing;
    const int empty_parity = ((t / Storage::kRing) & 1) ^ 1;  // the first use of a slot does not wait
    // Rows n0 + kRowStep j share one chunk position (the ring's swizzle repeats every 8 rows).
    const uint32_t stage_dst = smem_u32(&s.kv[stage]) + Storage::kRawSlotOffset + uint32_t(Storage::raw_chunk_offset(n0, q));
#pragma unroll 1  // kept rolled: the producer has few registers
    for (int c = 0; c < kSubTiles; ++c) {
      const int slot = stage * kSubTiles + c;
      wait_barrier(&s.kv_empty[slot], empty_parity);
      CUTE_UNROLL
      for (int j = 0; j < kRows; ++j) {
        cp_async_16_zfill(stage_dst + uint32_t(c * kSlotBytes + kRowStep * j * kSubTileCols),
                          src[j] + (page[j] >= 0 ? c * kSubTileCols : 0), page[j] >= 0);
      }
      cp_async_arrive_noinc(s.raw_landed(slot));
    }
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) page[j] = next_page[j];
  }
}

// Widening warps. In a slot, fp16 row n fills bytes [128 n, 128 n + 128) (the swizzle only permutes
// 16-byte chunks within a row) and raw row m sits at [4096 + 64 m, 4096 + 64 m + 64). So rows 0-31
// widen without touching any raw byte, and rows 32-63 overwrite the raw bytes of every row. Thread w
// widens half h = w % 2 (32 values) of row r = w / 2 and of row r + 32: first row r straight through,
// then it reads row r + 32's raw half, and after a barrier of the 64 widening threads (every raw
// byte has been read) writes it. 8 raw and 16 widened registers at a time.
// 16 e4m3 values -> fp16 columns col .. col + 15 of a slot of kRows token rows.
template <int kRows>
__device__ __forceinline__ void widen16(char* slot_base, int row, int col, uint4 v) {
  const uint2 w0 = e4m3x4_to_f16x4(v.x), w1 = e4m3x4_to_f16x4(v.y);
  const uint2 w2 = e4m3x4_to_f16x4(v.z), w3 = e4m3x4_to_f16x4(v.w);
  *reinterpret_cast<uint4*>(slot_base + swizzled_offset(row, col, kRows)) = make_uint4(w0.x, w0.y, w1.x, w1.y);
  *reinterpret_cast<uint4*>(slot_base + swizzled_offset(row, col + 8, kRows)) = make_uint4(w2.x, w2.y, w3.x, w3.y);
}
__device__ __forceinline__ void widen_half_row(char* slot_base, int row, int half, uint4 lo, uint4 hi) {
  const uint4 v[2] = {lo, hi};
  CUTE_UNROLL
  for (int k = 0; k < 2; ++k) widen16<kBlockN>(slot_base, row, 32 * half + 16 * k, v[k]);
}

// MLA_FP8_PROBE_NO_WIDEN (a timing probe, wrong results): kN slots handed to the math unconverted.
template <int kN, class Storage>
__device__ __forceinline__ void hand_on_raw_slots(Storage& s, int stage, int c0, int parity) {
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) wait_barrier(&s.raw_full[stage * kSubTiles + c0 + i], parity);
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) arrive_barrier(&s.kv_full[stage * kSubTiles + c0 + i]);
}

// Widens kN consecutive slots of a stage together: all their raw halves are loaded up front (one
// shared-memory round trip instead of two per slot), rows r widened, one barrier of the widening
// threads for all kN slots, then rows r + 32. Per-slot serial latency (raw wait, load, convert,
// store, barrier) is what bounds the two widening warps (docs/perf-notes.md, fp8 v3).
template <int kN, class Storage>
__device__ __forceinline__ void widen_slots(Storage& s, char* stage_base, int stage,
                                            int c0, int parity, int r, int half) {
  if constexpr (kFp8ProbeNoWiden) {  // timing probe (constants.cuh)
    hand_on_raw_slots<kN>(s, stage, c0, parity);
    return;
  }
  uint4 raw[kN][4];
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) {
    wait_barrier(&s.raw_full[stage * kSubTiles + c0 + i], parity);
    const char* src = stage_base + (c0 + i) * 8192 + Storage::kRawSlotOffset + 32 * half;
    raw[i][0] = *reinterpret_cast<const uint4*>(src + r * kSubTileCols);
    raw[i][1] = *reinterpret_cast<const uint4*>(src + r * kSubTileCols + 16);
    raw[i][2] = *reinterpret_cast<const uint4*>(src + (r + 32) * kSubTileCols);
    raw[i][3] = *reinterpret_cast<const uint4*>(src + (r + 32) * kSubTileCols + 16);
  }
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) widen_half_row(stage_base + (c0 + i) * 8192, r, half, raw[i][0], raw[i][1]);
  widen_barrier();  // every raw byte of these slots has been read: rows 32-63 may overwrite them
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) {
    widen_half_row(stage_base + (c0 + i) * 8192, r + 32, half, raw[i][2], raw[i][3]);
    fence_proxy_async_shared();  // widened stores -> the math warpgroups' wgmma reads (writer side)
    arrive_barrier(&s.kv_full[stage * kSubTiles + c0 + i]);
  }
}

// 32-token tiles (the short-split kernel, constants.cuh MLA_FP8_SHORT_SPLIT_KEYS): a slot is 4 KiB of fp16 (rows of 128 bytes in atoms of 8 rows) and
// raw row m sits at [2048 + 64 m, 2048 + 64 m + 64), so rows 0-15 widen without touching any raw byte
// and rows 16-31 overwrite all of them. Thread w widens quarter k = w % 4 (16 values) of row r = w / 4
// and of row r + 16, three slots per barrier.
template <int kN, class Storage>
__device__ __forceinline__ void widen_slots32(Storage& s, char* stage_base, int stage, int c0, int parity, int r, int k) {
  static_assert(Storage::kTileN == 32, "32-token slots");
  if constexpr (kFp8ProbeNoWiden) {  // timing probe (constants.cuh)
    hand_on_raw_slots<kN>(s, stage, c0, parity);
    return;
  }
  constexpr int kSlotBytes = 32 * kSubTileCols * 2;
  uint4 raw[kN][2];
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) {
    wait_barrier(&s.raw_full[stage * kSubTiles + c0 + i], parity);
    const char* src = stage_base + (c0 + i) * kSlotBytes + Storage::kRawSlotOffset + 16 * k;
    raw[i][0] = *reinterpret_cast<const uint4*>(src + r * kSubTileCols);
    raw[i][1] = *reinterpret_cast<const uint4*>(src + (r + 16) * kSubTileCols);
  }
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) widen16<32>(stage_base + (c0 + i) * kSlotBytes, r, 16 * k, raw[i][0]);
  widen_barrier();  // every raw byte of these slots has been read: rows 16-31 may overwrite them
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) {
    widen16<32>(stage_base + (c0 + i) * kSlotBytes, r + 16, 16 * k, raw[i][1]);
    fence_proxy_async_shared();  // widened stores -> the math warpgroups' wgmma reads (writer side)
    arrive_barrier(&s.kv_full[stage * kSubTiles + c0 + i]);
  }
}

template <class Storage>
__device__ __forceinline__ void widen_fp8_tiles(Storage& s, int num_tiles, int w) {
  constexpr bool k64 = Storage::kTileN == 64;
  static_assert(k64 || kSubTiles % 3 == 0, "32-token slots: three per step");
  const int r = k64 ? w / 2 : w / 4, part = k64 ? w % 2 : w % 4;  // a half row of 64 tokens, a quarter of 32
  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % Storage::kRing;
    const int parity = (t / Storage::kRing) & 1;
    char* stage_base = reinterpret_cast<char*>(s.kv[stage]);
    if constexpr (k64) {
#pragma unroll 1
      for (int c = 0; c + 1 < kSubTiles; c += 2) widen_slots<2>(s, stage_base, stage, c, parity, r, part);
      if constexpr (kSubTiles % 2 != 0) widen_slots<1>(s, stage_base, stage, kSubTiles - 1, parity, r, part);
    } else {
#pragma unroll 1
      for (int c = 0; c < kSubTiles; c += 3) widen_slots32<3>(s, stage_base, stage, c, parity, r, part);
    }
  }
}

// Storage: SharedStorage<float_e4m3_t> (the 64-row path; the transposed path takes produce_fp8_ring).
// Q's copies go first, as their own cp.async group, so that neither their issue waits for the
// block_table loads nor the rounding for tile 0's bytes (load_q_block_fp8): measured 0.951 over 58 fp8
// anchors against issuing Q after tile 0 and waiting for both (docs/perf-notes.md, v3.16).
// kv_map: MLA_FP8_TMA's tensor map of the raw cache (kernel.cuh), or null.
template <int NUM_HEADS, int PAGE_SIZE, class Storage>
__device__ __forceinline__ void produce_fp8(Storage& s, const MlaDecodeArgs& a, int b,
                                            int m_block, int kv_begin, int kv_end, int num_tiles, int ptid,
                                            const void* kv_map = nullptr) {
  const int32_t* table = a.block_table + int64_t(b) * a.block_table_stride;
  if (kv_map != nullptr && ptid == 0) prefetch_tensor_map(kv_map);
  load_q_block<cutlass::half_t, NUM_HEADS, Storage::kRowsPerCta>(s.q, a, b, m_block, ptid);
  cp_async_commit();
  // Tile 0's raw bytes are requested before Q is waited for, so their latency overlaps Q's.
  if (ptid < kFp8CopyThreads) copy_fp8_tiles<PAGE_SIZE, kFp8CopyThreads>(s, a, table, kv_begin, kv_end, 0, 1, ptid, kv_map);
  cp_async_commit();  // tile 0's group (the widening threads': empty)
  load_q_block_fp8<NUM_HEADS, Storage::kRowsPerCta>(s.q, a, b, m_block, ptid);
  fence_proxy_async_shared();  // converted Q stores -> wgmma reads (writer side)
  arrive_barrier(&s.q_full);
  if (ptid < kFp8CopyThreads) {
    copy_fp8_tiles<PAGE_SIZE, kFp8CopyThreads>(s, a, table, kv_begin, kv_end, 1, num_tiles, ptid, kv_map);
    cp_async_wait_all();  // do not retire while copies are in flight
  } else {
    widen_fp8_tiles(s, num_tiles, ptid - kFp8CopyThreads);
  }
}

// ---------------------------------------------------------------------------------------------
// fp8 on the transposed path (SharedStorageStFp8): the producer only copies raw
// e4m3 bytes into a 4-stage ring; the math warpgroups convert them in registers (consumer_st_regs.cuh).

// Where Q's value `dim` (0..575) sits in the fp16 Q tile: the tile's column k holds dim st_q_dim(k).
// Within each 64-value block, column 16 j + 8 hi + 2 t + e holds value 16 t + 4 j + 2 hi + e: the
// values that a thread's wgmma fragment of K needs for k-step j (columns 2t, 2t+1, 2t+8, 2t+9) are then
// bytes 4j .. 4j+3 of the 16 contiguous raw bytes it loads per token row (consumer_st_regs.cuh).
__host__ __device__ __forceinline__ constexpr int st_q_dim(int k) {
  const int blk = k & ~63, j = (k >> 4) & 3, hi = (k >> 3) & 1, t = (k >> 1) & 3, e = k & 1;
  return blk + 16 * t + 4 * j + 2 * hi + e;
}


// Q for the register path: its bf16 rows are copied (cp.async, zeros for padding rows) into o_x, free
// until the final merge (which waits for them, layouts.cuh SharedStorageStFp8), then every 16-byte
// chunk of the fp16 Q tile is assembled from four bf16 pairs (st_q_dim) and rounded to fp16 times
// kFp8QPrescale.
// The copies alone (produce_fp8_ring issues them first; convert_q_st_fp8 rounds them).
template <int NUM_HEADS, class Storage>
__device__ __forceinline__ void issue_q_permuted(Storage& s, const MlaDecodeArgs& a, int b, int m_block, int ptid) {
  constexpr int kRowBytes = kHeadDimK * 2;
  char* staging = reinterpret_cast<char*>(s.o_x);
  copy_q_rows<NUM_HEADS, Storage::kRowsPerCta>(
      a, b, m_block, ptid, [&](int row, int c) { return smem_u32(staging + row * kRowBytes + c * 16); });
}
// Chunk oc (row oc / 72, 8 columns) of the fp16 Q tile, from the bf16 rows staged in o_x: four bf16
// pairs gathered by st_q_dim (which keeps pairs), loaded (load_q_pairs), then rounded to fp16 times
// kFp8QPrescale and stored (store_q_chunk). The caller has seen all of Q land; convert_q_st_fp8 (the
// math warpgroups) runs them over every chunk.
template <class Storage>
__device__ __forceinline__ uint4 load_q_pairs(const Storage& s, int oc) {
  constexpr int kRowBytes = kHeadDimK * 2;
  const char* staging = reinterpret_cast<const char*>(s.o_x) + (oc / kChunksPerRow) * kRowBytes;
  const int col = (oc % kChunksPerRow) * kChunkElems;
  auto pair = [&](int i) {  // columns col + 2i, col + 2i + 1: one bf16 pair
    return *reinterpret_cast<const uint32_t*>(staging + 2 * st_q_dim(col + 2 * i));
  };
  return make_uint4(pair(0), pair(1), pair(2), pair(3));
}
template <class Storage>
__device__ __forceinline__ void store_q_chunk(Storage& s, int oc, uint4 w) {
  const int row = oc / kChunksPerRow, col = (oc % kChunksPerRow) * kChunkElems;
  *reinterpret_cast<uint4*>(reinterpret_cast<char*>(s.q) + swizzled_offset(row, col, Storage::kRowsPerCta)) =
      bf16x8_to_f16x8_prescaled(w);
}

// Q first, as produce_fp8 does. q_full completes when every producer thread's Q copies (its only
// earlier cp.async copies) have landed; the math warpgroups then round Q themselves (convert_q_st_fp8)
// while tiles stream in. (The producer rounding Q after issuing tile 0, the form before v3.25,
// measured 1.009x slower over 50 fp8 anchors: docs/perf-notes.md v3.25.)
template <int NUM_HEADS, int PAGE_SIZE, class Storage>
__device__ __forceinline__ void produce_fp8_ring(Storage& s, const MlaDecodeArgs& a, int b, int m_block,
                                                 int kv_begin, int kv_end, int num_tiles, int ptid) {
  const int32_t* table = a.block_table + int64_t(b) * a.block_table_stride;
  issue_q_permuted<NUM_HEADS>(s, a, b, m_block, ptid);
  cp_async_arrive_noinc(&s.q_full);
  copy_fp8_tiles<PAGE_SIZE, kProducerThreads>(s, a, table, kv_begin, kv_end, 0, num_tiles, ptid);
  cp_async_wait_all();  // do not retire while copies are in flight
}

}  // namespace mla
