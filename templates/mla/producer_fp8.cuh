// The producer warpgroup for fp8 caches (see kernel.cuh for the whole CTA). On the 64-row path
// (produce_fp8) two warps copy raw e4m3 bytes into the upper half of each fp16 slot and two warps widen
// them to fp16 in place; on the transposed path (produce_fp8_ring, at most 32 heads) all four copy raw
// bytes into a 4-stage (32 rows: 3) e4m3 ring that the math warpgroups convert in registers.
#pragma once
#include "abi.h"
#include "arch.cuh"
#include "config.cuh"
#include "layouts.cuh"
#include "producer.cuh"  // copy_q_rows, load_q_block, tma_full_tiles

namespace mla {

// The fp8 producer of the 64-row path: Q (bf16) is copied into the fp16 Q tile and rounded there to
// fp16 x kFp8QPrescale by the producer (load_q_block_fp8); each KV slot's raw bytes (64 tokens x 64 values, 4 KiB) are copied by cp.async into the upper half of the slot's own
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
  // fp16 (times the prescale) in place.
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

// kBarWiden over the 64 widening threads: every raw byte of a slot is read before any fp16 lands on it.
__device__ __forceinline__ void widen_barrier() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kBarWiden), "n"(kFp8WidenThreads) : "memory");
}

// Copies the raw e4m3 bytes of tiles [first_tile, last_tile), slot after slot as the math warps release
// it, with kCopyThreads threads: thread ct copies 16-byte chunk ct % 4 of rows ct / 4 + (kCopyThreads /
// 4) j of every slot (a warp: 8 rows x 64 bytes per instruction) and arrives on the slot's "raw bytes
// landed" barrier (Storage::raw_landed). Raw row m of a slot sits at Storage::kRawSlotOffset + 64 m:
// the upper half of an fp16 slot on the 64-row path (64 copy threads, 2 fp16 stages; 4 of 32 tokens
// in the short-split kernel), a 4 KiB raw slot of the transposed path's ring (128 copy threads, 4 stages).
// Pages are looked up one tile ahead; rows past kv_end are zero bytes.
// kv_map (64-token tiles on TMA pages only; null otherwise): the full tiles go by TMA as in produce (tma_full_tiles):
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

// Widens kN consecutive slots of a stage together: all their raw halves are loaded up front (one
// shared-memory round trip instead of two per slot), rows r widened, one barrier of the widening
// threads for all kN slots, then rows r + 32. Per-slot serial latency (raw wait, load, convert,
// store, barrier) is what bounds the two widening warps.
template <int kN, class Storage>
__device__ __forceinline__ void widen_slots(Storage& s, char* stage_base, int stage,
                                            int c0, int parity, int r, int half) {
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

// 32-token tiles (the short-split kernel, config.cuh kFp8ShortSplitKeys): a slot is 4 KiB of fp16 (rows of 128 bytes in atoms of 8 rows) and
// raw row m sits at [2048 + 64 m, 2048 + 64 m + 64), so rows 0-15 widen without touching any raw byte
// and rows 16-31 overwrite all of them. Thread w widens quarter k = w % 4 (16 values) of row r = w / 4
// and of row r + 16, three slots per barrier.
template <int kN, class Storage>
__device__ __forceinline__ void widen_slots32(Storage& s, char* stage_base, int stage, int c0, int parity, int r, int k) {
  static_assert(Storage::kTileN == 32, "32-token slots");
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
// block_table loads nor the rounding for tile 0's bytes (load_q_block_fp8).
// kv_map: the tensor map of the raw cache (TMA pages, kernel.cuh kv_map_of), or null.
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
// e4m3 bytes into a 4-stage ring; the math warpgroups convert them in registers (consumer_st_fp8.cuh).

// Where Q's value `dim` (0..575) sits in the fp16 Q tile: the tile's column k holds dim st_q_dim(k).
// Within each 64-value block, column 16 j + 8 hi + 2 t + e holds value 16 t + 4 j + 2 hi + e: the
// values that a thread's wgmma fragment of K needs for k-step j (columns 2t, 2t+1, 2t+8, 2t+9) are then
// bytes 4j .. 4j+3 of the 16 contiguous raw bytes it loads per token row (consumer_st_fp8.cuh).
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
// while tiles stream in.
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
