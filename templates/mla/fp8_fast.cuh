// The fp8 fast mode on the 64-row path (docs/design.md 3.3): fp8 tensor-core math on the cache's raw
// e4m3 bytes. One CTA per (request, 64-row block): a producer warpgroup, a softmax warpgroup and two
// P V warpgroups, each role running ahead of the next as far as the four-stage ring allows:
//   - the producer only copies: a tile is 64 tokens x 576 raw bytes in the 128-byte-swizzled K-major
//     layout that fp8 wgmma reads (five 8 KiB slots of 128 bytes per token, the fifth half used);
//   - Q is rounded to e4m3 at entry, with one power-of-2 scale per row;
//   - the softmax warpgroup (softmax_role) computes every tile's S = Q8 K8^T over all 576 columns (fp8
//     wgmma, 18 k-steps of 32; each row scaled by k_scale / its Q scale), keeps the rows' running max and
//     sums, and hands each tile's P to the P V warpgroups: stored as e4m3 (times 2^8) transposed, P^T
//     [64 rows x 64 tokens], with the rows' factors alpha, in the tile's stage (p_full);
//   - each P V warpgroup (pv_role) keeps O^T [its 256 dims x 64 rows] in fp32 registers: O^T += V^T P^T,
//     each tile's product in a cleared wgmma accumulator first (pv_promoted), with V^T built in registers
//     from the same tile (one ldmatrix.trans.x4 and four byte permutes per warp, m-block and k-step), so
//     no V^T copy exists. The fragment's rows are dims in pi order and its columns tokens in sigma order
//     (below), so P^T is stored with its tokens in sigma order;
//   - lse's row sums come from P before rounding, out's from the e4m3 values P V reads.
// So the softmax warpgroup's S of tile t + 1 runs on the tensor cores while the P V warpgroups multiply
// tile t, and no warpgroup waits for another's row max.
// A split variant also has a balanced-schedule instantiation (SCHED, scheduled.cuh's walk): each math
// warpgroup runs its part (softmax_rows / pv_rows) once per segment of the CTA's schedule run, the ring
// carrying on across segments.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/float8.h>

#include "arch.cuh"
#include "config.cuh"
#include "epilogue.cuh"  // copy_staged_rows
#include "params.cuh"
#include "producer.cuh"  // tma_full_tiles
#include "row_softmax.cuh"
#include "scheduled.cuh"  // for_each_segment
#include "workspace.cuh"

namespace mla {
namespace fast {

using namespace cute;
using E4 = cutlass::float_e4m3_t;

constexpr int kTileBytes = 640;                  // a token's or Q row's slots: 5 x 128 bytes, 576 used
constexpr int kSlots = 5;                        // 128-byte column slots of a tile (the fifth: RoPE, 64 bytes)
constexpr int kKSteps = kHeadDimK / 32;          // 18 k-steps of S
constexpr float kPScaleLog2 = 8.f;               // P is stored as e4m3(p * 2^8): p >= 2^-14 stays normal;
                                                 // the factor rides in exp2's argument (exp_store_pt)
constexpr float kExactMaxLimit = 1048576.f;      // 2^20: rows with a larger |max| take shift_huge_rows
constexpr float kQMax = 448.f;                   // e4m3's largest finite value
constexpr int kStages = 4;                       // tile t in stage t % 4
constexpr int kPvWgs = 2;                        // P V warpgroups, 256 of V's dims each
constexpr int kMathThreads = 128 * (1 + kPvWgs);  // the softmax warpgroup (math thread 0-127) and the P V ones
using Piece = cutlass::bfloat16_t;               // out's type, and that of a split launch's workspace pieces
                                                 // at every head count (launch.cuh hands the combine this type)

using LayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4>{}, Shape<_64, Int<kTileBytes>>{}));
using LayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<E4>{}, Shape<_64, _64>{}));

struct Storage {
  static constexpr int kThreads = kProducerThreads + kMathThreads;
  alignas(1024) E4 kv[kStages][kBlockN * kTileBytes];  // 4 x 40 KiB: raw tiles
  // q, pt and tail lie back to back, 64 KiB: the epilogue stages each warpgroup's O there (every read
  // of Q and P^T is done by then), never in the ring, which a scheduled CTA's producer is already
  // filling with the next segment's tiles.
  alignas(1024) E4 q[kBlockM * kTileBytes];        // 40 KiB: Q8, rows x 640 bytes
  alignas(1024) E4 pt[kStages][kBlockM * kBlockN];  // 4 x 4 KiB: P^T of the stage's tile
  alignas(1024) char tail[8192];
  float q_inv_scale[kBlockM];                      // 1 / (Q row's power-of-2 scale)
  float row_alpha[kStages][kBlockM];               // the stage's tile: each row's factor for what came before
  float row_factor[kBlockM];                       // at the end: k_scale / the row's sum of the rounded P
  uint64_t kv_full[kStages], kv_empty[kStages];
  uint64_t p_full[kStages];                        // the stage's P^T and row_alpha are written
};

// A P V warpgroup's staged O: 64 rows of its 256 dims.
constexpr int kStagedBytes = kBlockM * (kHeadDimV / kPvWgs) * int(sizeof(Piece));
static_assert(kPvWgs == kNumWarpgroups, "copy_staged_rows (epilogue.cuh) sizes a staged row for kNumWarpgroups");
static_assert(offsetof(Storage, tail) + sizeof(Storage::tail) - offsetof(Storage, q) == kPvWgs * kStagedBytes,
              "q, pt and tail hold both P V warpgroups' staged O");
constexpr int kThreads = Storage::kThreads;

// Byte offset of (row, byte column) in a 128-byte-swizzled K-major tile of `rows` rows (LayoutTile):
// 1024-byte atoms of 8 rows x 128 bytes, column-block-major; 16-byte chunk c of row r at c ^ (r % 8).
__host__ __device__ __forceinline__ uint32_t tile_offset(int row, int col, int rows) {
  const uint32_t atom = uint32_t(row >> 3) + uint32_t(col >> 7) * uint32_t(rows >> 3);
  const uint32_t chunk = uint32_t((col & 127) >> 4) ^ uint32_t(row & 7);
  return atom * 1024u + uint32_t(row & 7) * 128u + chunk * 16u + uint32_t(col & 15);
}
// P^T (LayoutPt): 64-byte rows, 16-byte chunk c of row r at c ^ ((r >> 1) & 3); column k of a 32-token
// k-step holds token sigma(k) (a_vt), so token t < 32 goes to column
// (t & 16) | ((t >> 1) & 3) << 2 | ((t >> 3) & 1) << 1 | (t & 1) (exp_store_pt).

// Two floats -> two e4m3 (round to nearest, saturating), low byte first.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Q: the 256 threads of the P V warpgroups round the CTA's 64 rows to e4m3 with one power-of-2 scale per row (the largest
// that keeps the row's largest magnitude <= 448), 4 threads per row.

// The scheduled producer's L2 prefetch of a segment's q rows (cp.async.bulk.prefetch.L2, no
// completion to wait for), issued when it starts the segment's tiles, a few tiles before the P V
// warpgroups' make_q reads them: 128 producer threads, thread ptid the latent (even) or RoPE (odd)
// part of row ptid / 2.
template <int NUM_HEADS>
__device__ __forceinline__ void prefetch_q_rows(const MlaDecodeArgs& a, int b, int m_block, int ptid) {
  static_assert(kProducerThreads == 2 * kBlockM, "two producer threads per row");
  const QRowSource q = q_row_source<NUM_HEADS>(a, b, m_block * kBlockM + ptid / 2);
  if (!q.valid) return;
  const bool rope = ptid & 1;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(rope ? q.pe : q.nope),
               "r"(rope ? 2u * kRopeDim : 2u * kHeadDimV)
               : "memory");
}

template <int NUM_HEADS>
__device__ __forceinline__ void make_q(Storage& s, const MlaDecodeArgs& a, int b, int m_block, int tid) {
  const int row = tid / 4, part = tid % 4;  // part: 16-byte chunks part, part + 4, ... of the 72
  const QRowSource src = q_row_source<NUM_HEADS>(a, b, m_block * kBlockM + row);
  auto chunk = [&](int c) -> uint4 {
    if (!src.valid) return make_uint4(0, 0, 0, 0);
    return __ldg(reinterpret_cast<const uint4*>(c < 64 ? src.nope + c * 16 : src.pe + (c - 64) * 16));
  };
  // The thread's 18 chunks stay in registers (72) between the row max and the conversion: one pass
  // over global memory, all loads in flight at once.
  uint4 v[18];
  CUTE_UNROLL
  for (int k = 0; k < 18; ++k) v[k] = chunk(part + 4 * k);
  float amax = 0.f;
  CUTE_UNROLL
  for (int k = 0; k < 18; ++k) {
    const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float2 f = unpack2<cutlass::bfloat16_t>(w[i]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 2));
  // scale = 2^floor(log2(448 / amax)), at most 2^126 (amax below 448 x 2^-126, about 5e-36, would
  // overflow the ratio to inf and turn the row into NaN; 1 / scale stays a normal float); 1 for an
  // all-zero row.
  const float scale = amax > 0.f ? exp2f(floorf(log2f(kQMax / fmaxf(amax, kQMax * 0x1p-126f)))) : 1.f;
  if (part == 0) s.q_inv_scale[row] = 1.f / scale;
  char* q = reinterpret_cast<char*>(s.q);
  CUTE_UNROLL
  for (int k = 0; k < 18; ++k) {
    const int c = part + 4 * k;
    const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    uint32_t packed[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const float2 f0 = unpack2<cutlass::bfloat16_t>(w[2 * i]);
      const float2 f1 = unpack2<cutlass::bfloat16_t>(w[2 * i + 1]);
      packed[i] = uint32_t(e4m3x2(f0.x * scale, f0.y * scale)) | (uint32_t(e4m3x2(f1.x * scale, f1.y * scale)) << 16);
    }
    // 8 values = 8 bytes at byte column 8 c (16-byte chunks move whole under the swizzle).
    *reinterpret_cast<uint2*>(q + tile_offset(row, 8 * c, kBlockM)) = make_uint2(packed[0], packed[1]);
  }
}

// ---------------------------------------------------------------------------------------------
// The producer: every tile of [kv_begin, kv_end) into stage t % 4. One full barrier per stage (128
// arrivals) and one empty barrier (12: each math warp once, after its last read of the tile).
// - With a tensor map (kv_map, pages that are multiples of 64 tokens: a tile is 64 tokens of one page),
//   every full tile goes by TMA (producer.cuh's tma_full_tiles, whose comment has why no thread then
//   waits more than one phase ahead): warp 0 waits for the stage, its lane 0 announces the tile's 40 KiB
//   on kv_full, issues the five slots' boxes (128 bytes x 64 tokens, the map's 128-byte swizzle is
//   tile_offset's; the fifth box's bytes past 576 are zeros; in tma_full_tiles' terms one slot of five
//   boxes per stage) and arrives for the other 127 producer threads, while warps 1-3 wait at kBarProducer.
// - Every other tile (all of them without a map; else the partial last one) by 16-byte cp.async, eight
//   threads per 128-byte slot row (rows ptid / 8 + 16 j), zero-filled past kv_end, so whatever lies past
//   seq_len (possibly NaN) never reaches shared memory.
// ph: bit j is the parity of stage j's uses before this segment (0 in a uniform launch; the scheduled
// walk carries it, stage_flips). The caller waits for its copies (cp_async_wait_all) before it retires.

// The stages' use parities a segment of n tiles flips (tile t in stage t % kStages).
__device__ __forceinline__ uint32_t stage_flips(int n) {
  uint32_t f = 0;
  CUTE_UNROLL
  for (int j = 0; j < kStages; ++j) f |= uint32_t(((n + kStages - 1 - j) / kStages) & 1) << j;
  return f;
}

template <int PAGE_SIZE>
__device__ __forceinline__ void produce(Storage& s, const MlaDecodeArgs& a, int b, int kv_begin, int kv_end,
                                        int num_tiles, int ptid, uint32_t ph, const void* kv_map) {
  const int sub = ptid % 8, n0 = ptid / 8;
  const int32_t* table = a.block_table + int64_t(b) * a.block_table_stride;
  const char* cache = static_cast<const char*>(a.kv_cache);
  int first_copied = 0;  // tiles before it went by TMA
  if constexpr (PAGE_SIZE % kBlockN == 0) {
    if (kv_map != nullptr) {
      const int full_tiles = (kv_end - kv_begin) / kBlockN;
      if (ptid < 32) {  // one barrier pair per stage: one TMA slot of kSlots 128-byte boxes
        tma_full_tiles<PAGE_SIZE, kStages, uint32_t(kSlots * kBlockN * 128), uint32_t(kBlockN * 128), kProducerThreads,
                       /*kUnrollSlots=*/true, /*kSlots=*/1, /*kBoxes=*/kSlots, /*kBoxCols=*/128>(
            s, table, kv_begin, 0, full_tiles, ptid, kv_map, int(ph), [&](int stage) { return smem_u32(s.kv[stage]); },
            [&](int slot) { return &s.kv_full[slot]; });
      }
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBarProducer), "n"(kProducerThreads) : "memory");
      first_copied = full_tiles;
    }
  }
  // This thread's rows n0 + 16 j of tile t: their pages, looked up one tile ahead (-1 past kv_end).
  int32_t page[4], next_page[4];
  auto lookup = [&](int t, int32_t (&pg)[4]) {
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int token = kv_begin + t * kBlockN + n0 + 16 * j;
      pg[j] = token < kv_end ? table[token / PAGE_SIZE] : -1;
    }
  };
  if (first_copied < num_tiles) lookup(first_copied, page);
  for (int t = first_copied; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) lookup(t + 1, next_page);
    const int stage = t % kStages;
    wait_barrier(&s.kv_empty[stage], (((t / kStages) ^ int(ph >> stage)) & 1) ^ 1);  // a first use does not wait
    const uint32_t base = smem_u32(s.kv[stage]);
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + 16 * j;
      const int token = kv_begin + t * kBlockN + n;
      const bool valid = page[j] >= 0;
      const char* src = valid ? cache + int64_t(page[j]) * a.kv_stride_page + int64_t(token % PAGE_SIZE) * a.kv_stride_token
                              : cache;
      CUTE_UNROLL
      for (int c = 0; c < kSlots; ++c) {
        if (c == kSlots - 1 && sub >= 4) continue;  // the RoPE slot: 64 bytes
        cp_async_16_zfill(base + tile_offset(n, c * 128 + sub * 16, kBlockN), src + (valid ? c * 128 + sub * 16 : 0),
                          valid);
      }
    }
    cp_async_arrive_noinc(&s.kv_full[stage]);
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) page[j] = next_page[j];
  }
}

// ---------------------------------------------------------------------------------------------
// The math warpgroups' wgmma pieces.

// The wgmma descriptor of k-step ks (32 bytes) of a 64-row LayoutTile: k-step 0's plus the step's byte
// offset / 16 in the start-address field (bits 0-13, which shared addresses below 256 KiB never
// overflow), so the loop adds constants instead of building 18 descriptors.
__device__ __forceinline__ uint64_t tile_desc(uint64_t desc0, int ks) {
  return desc0 + uint64_t(tile_offset(0, 32 * ks, kBlockN) >> 4);
}

static_assert(kBlockM == kBlockN, "Q and K tiles share tile_desc's k-step offsets");

// S [64 x 64] = Q8 [64 x 576] K8^T over the 18 k-steps (shared-memory operands).
__device__ __forceinline__ void issue_s(const Storage& s, int stage, float (&d)[32]) {
  Tensor sq = make_tensor(make_smem_ptr(s.q), LayoutTile{});
  Tensor sk = make_tensor(make_smem_ptr(s.kv[stage]), LayoutTile{});
  const uint64_t da0 = uint64_t(GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(sq, Shape<_64, _32>{}, make_coord(0, 0))));
  const uint64_t db0 = uint64_t(GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(sk, Shape<_64, _32>{}, make_coord(0, 0))));
  CUTE_UNROLL
  for (int i = 0; i < 32; ++i) warpgroup_fence_operand(d[i]);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    const uint64_t da = tile_desc(da0, ks), db = tile_desc(db0, ks);
    SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>::fma(
        da, db, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15],
        d[16], d[17], d[18], d[19], d[20], d[21], d[22], d[23], d[24], d[25], d[26], d[27], d[28], d[29], d[30], d[31],
        ks == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
  }
  warpgroup_commit_batch();
}

// The A registers of V^T for one (m-block, k-step) of this thread: ldmatrix.trans.x4 over the bytes
// as 16-bit pairs (matrix j = lane / 8: tokens 8 j .. 8 j + 7 of the k-step, the warp's 16 dims), then
// byte permutes. Fragment row m = 16 w + r (r < 8) holds dim 16 w + 2 r, row 16 w + 8 + r dim
// 16 w + 2 r + 1 (pi); column k holds token sigma(k) = 16 (k >> 4) + 8 ((k & 3) >> 1) + 2 ((k >> 2) & 3)
// + (k & 1) (lab/fp8_vt_regs_probe.cu checks both against a byte-by-byte fill). addr: the thread's
// row of 16 bytes (VtAddr).
__device__ __forceinline__ void a_vt(uint32_t addr, uint32_t (&a)[4]) {
  uint32_t r0, r1, r2, r3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
  a[0] = __byte_perm(r0, r1, 0x6420);
  a[1] = __byte_perm(r0, r1, 0x7531);
  a[2] = __byte_perm(r2, r3, 0x6420);
  a[3] = __byte_perm(r2, r3, 0x7531);
}

// The ldmatrix addresses of a thread, as two bases and constants: the row is token 32 ks + 8 j + i
// (j = lane / 8, i = lane % 8) and the 16 bytes are dims 64 (4 wg + mb) + 16 warp of the tile, so
// tile_offset gives atom (4 ks + j) + 8 (2 wg + mb / 2) and chunk (4 (mb % 2) + warp) ^ i: the m-block's
// parity picks one of two per-thread bases, the rest is an immediate.
struct VtAddr {
  uint32_t base[2];
  __device__ __forceinline__ VtAddr(const Storage& s, int wg, int warp, int lane) {
    const int j = lane / 8, i = lane % 8;
    const uint32_t b = smem_u32(s.kv[0]) + uint32_t(j) * 1024u + uint32_t(i) * 128u + uint32_t(wg) * 16384u;
    base[0] = b + (uint32_t(warp ^ i) << 4);
    base[1] = b + (uint32_t((4 + warp) ^ i) << 4);
  }
  __device__ __forceinline__ uint32_t at(int stage, int mb, int ks) const {
    return base[mb & 1] + uint32_t(stage) * uint32_t(sizeof(Storage::kv[0])) + uint32_t(ks) * 4096u +
           uint32_t(mb >> 1) * 8192u;
  }
};

template <int N>
__device__ __forceinline__ void fence_acc(float (&x)[N]) {
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) warpgroup_fence_operand(x[i]);
}

// One m-block of V^T P^T [64 of this warpgroup's dims x 64 rows] into t, which it clears: two k-steps of
// register-sourced fp8 wgmma (m64 n64 k32), B = P^T of the stage. One commit group. Both k-steps' A
// registers are written before wgmma.fence, which PTX asks for between a register write and the wgmma
// that reads it.
__device__ __forceinline__ void issue_pv_block(const Storage& s, int stage, const VtAddr& vt, int mb, float (&t)[32]) {
  Tensor spt = make_tensor(make_smem_ptr(s.pt[stage]), LayoutPt{});
  uint32_t av[2][4];
  CUTE_UNROLL
  for (int ks = 0; ks < 2; ++ks) a_vt(vt.at(stage, mb, ks), av[ks]);
  fence_acc(t);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int ks = 0; ks < 2; ++ks) {
    const uint32_t (&a)[4] = av[ks];
    const uint64_t db = uint64_t(GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(spt, Shape<_64, _32>{}, make_coord(0, ks))));
    SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_RS_TN<>::fma(
        a[0], a[1], a[2], a[3], db, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12],
        t[13], t[14], t[15], t[16], t[17], t[18], t[19], t[20], t[21], t[22], t[23], t[24], t[25], t[26], t[27], t[28],
        t[29], t[30], t[31], ks == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
  }
  warpgroup_commit_batch();
}

// O^T [this warpgroup's 256 dims x 64 rows] += V^T P^T, promoted per tile: the fp8 wgmma keeps its
// accumulator to 13 mantissa bits, truncated (design.md 1, "Accumulation"), so each m-block's tile
// product goes into a cleared accumulator t and is then added to O^T in fp32 registers.
__device__ __forceinline__ void pv_promoted(const Storage& s, int stage, const VtAddr& vt, float (&o)[4][32]) {
  float t[32];
  CUTE_UNROLL
  for (int mb = 0; mb < 4; ++mb) {
    issue_pv_block(s, stage, vt, mb, t);
    warpgroup_wait<0>();
    fence_acc(t);
    CUTE_UNROLL
    for (int i = 0; i < 32; ++i) o[mb][i] += t[i];
  }
}

// ---------------------------------------------------------------------------------------------
// The softmax on S (element i of a thread's S fragment: row row0 + 8 ((i >> 1) & 1), column (i >> 2) * 8
// + 2 (lane % 4) + (i & 1)) and the per-column state of O^T (a thread's O^T columns, i.e. query rows:
// c(jj) = 8 (jj >> 1) + 2 (lane % 4) + (jj & 1), jj < 16, element o[mb][4 (jj >> 1) + (jj & 1) + 2 e]
// for dims e = 0, 1).

struct Math {
  int warp, lane, row0;
  int kv_begin;
  int key_limit[2];
  int unmasked_end;      // the least key_limit of the warp's rows: a tile below it needs no mask
  float score_scale[2];  // per S row: softmax_scale log2(e) k_scale / Q scale
  bool fold_scale;       // both rows' score_scale positive (tile_rowmax)
  int pt_base;           // exp_store_pt: row0 * 64 + 4 (lane % 4)
};

__device__ __forceinline__ int o_col(int jj, int lane) { return 8 * (jj >> 1) + 2 * (lane % 4) + (jj & 1); }

// Tile `tile`'s row maxima in the log2 domain (keys kv_begin + 64 tile ..) and each row's multiplier of S
// for exp_store_pt. A tile without masked keys, when both rows' scales are positive (fold_scale: a device
// k_scale might not be), keeps S as the wgmma left it: its scaled max is the raw max times the scale
// (exactly: rounding is monotonic), and exp_store_pt applies the scale in its FFMA (rows with a huge max
// are scaled by shift_huge_rows first).
// Any other tile is scaled and masked in place (row_softmax.cuh scale_mask_rowmax) and multiplied by 1.
__device__ __forceinline__ void tile_rowmax(float (&S)[32], const Math& c, int tile, float (&tile_max)[2],
                                            float (&mul)[2]) {
  const int tile_start = c.kv_begin + tile * kBlockN;
  if (c.fold_scale && tile_start <= c.unmasked_end - kBlockN) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) tile_max[r] = -INFINITY;
    CUTE_UNROLL
    for (int i = 0; i < 32; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], S[i]);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
      tile_max[r] *= c.score_scale[r];
      mul[r] = c.score_scale[r];
    }
  } else {
    mla::scale_mask_rowmax<32>([&](int i) -> float& { return S[i]; }, [&](int r) { return c.score_scale[r]; },
                               tile_start, c.unmasked_end, c.key_limit, c.lane, tile_max);
    mul[0] = mul[1] = 1.f;
  }
}

// Rows whose max is huge (|m_sub| >= 2^20 in the log2 domain: absurd scores, e.g. softmax_scale 1e28).
// Below that bound exp_store_pt's FFMA, S x mul - (m_sub - 8), is exact enough: the product's rounding
// error at the max, at most ulp(m_sub) / 2 <= 2^-5, leaves p below 2^8.03, and m_sub - 8 is exact. Past
// it neither holds (at 1e28 the error is 2^76: p inf or 0; from 2^27 on m_sub - 8 rounds by 16), so the
// tile is scaled and shifted first, in two roundings: at the max round(S x mul) is m_sub exactly (it is
// how tile_rowmax computed the max) and the difference 0; the exponent then adds only the 8.
__device__ __forceinline__ void shift_huge_rows(float (&S)[32], float (&mul)[2], const float (&m_sub)[2],
                                                float (&m_sub8)[2]) {
  CUTE_UNROLL
  for (int i = 0; i < 32; ++i) S[i] = __fsub_rn(__fmul_rn(S[i], mul[(i >> 1) & 1]), m_sub[(i >> 1) & 1]);
  mul[0] = mul[1] = 1.f;
  m_sub8[0] = m_sub8[1] = -kPScaleLog2;
}

// O^T's columns (query rows) times the factors the softmax warpgroup wrote for the tile in `row_alpha`,
// skipped when no column of the warp moved. Column of element i: o_col(2 (i >> 2) + (i & 1)).
__device__ __forceinline__ void rescale_cols(float (&o)[4][32], const float* row_alpha, int lane) {
  float alpha[16];
  bool moved = false;
  CUTE_UNROLL
  for (int jj = 0; jj < 16; jj += 2) {
    const float2 f = *reinterpret_cast<const float2*>(row_alpha + o_col(jj, lane));
    alpha[jj] = f.x;
    alpha[jj + 1] = f.y;
    moved |= f.x != 1.f || f.y != 1.f;
  }
  if (__any_sync(0xffffffff, moved)) {
    CUTE_UNROLL
    for (int mb = 0; mb < 4; ++mb) {
      CUTE_UNROLL
      for (int i = 0; i < 32; ++i) o[mb][i] *= alpha[2 * (i >> 2) + (i & 1)];
    }
  }
}

// P 2^8 = exp2(S mul - m_sub8) (one FFMA; mul: tile_rowmax's), m_sub8 = m_sub - kPScaleLog2 (the factor in the
// exponent, no multiply), into P^T of
// the stage (e4m3, tokens in sigma order per k-step); row sums of the unrounded P into l (lse's) and of the e4m3
// values that P V reads into l_p8 (out's divisor), both scaled by 2^8: out is then a weighted mean of V with the
// weights P V used, so a cache whose values share a sign keeps its mean (design.md 3.3, "Row sums"). The tile's
// terms sum in f16x2 (each half 8 of a row's e4m3 values, at most 2^8 each, so at most 2048: all but the
// smallest terms add exactly), then once into fp32. S element i holds tokens tok, tok + 1 with tok = 8 (i >> 2) + 2
// q (q = lane % 4), which sigma_inv puts at the adjacent columns k, k + 1 with k >> 4 = i >> 3 and k & 15 = 4 q + 2
// ((i >> 2) & 1); row0 and row0 + 8 share the swizzle (row >> 1) & 3. pt_base: this thread's byte offset row0 * 64
// + 4 q. Elements i and i + 4 (i % 8 < 4) fill the four bytes at k & 15 = 4 q .. 4 q + 3 of one chunk: one 4-byte
// store.
__device__ __forceinline__ void exp_store_pt(const float (&S)[32], const Math& c, const float (&mul)[2],
                                             const float (&m_sub8)[2], float (&l)[2], float (&l_p8)[2], E4* pt) {
  const float neg[2] = {-m_sub8[0], -m_sub8[1]};
  char* base = reinterpret_cast<char*>(pt) + c.pt_base;
  const int swz = (c.row0 >> 1) & 3;
  __half2 sum_p8[2] = {__float2half2_rn(0.f), __float2half2_rn(0.f)};
  CUTE_UNROLL
  for (int g = 0; g < 32; g += 8) {
    CUTE_UNROLL
    for (int i = g; i < g + 4; i += 2) {
      const int r = (i >> 1) & 1;
      const float p0 = exp2_ftz(fmaf(S[i], mul[r], neg[r]));
      const float p1 = exp2_ftz(fmaf(S[i + 1], mul[r], neg[r]));
      const float p2 = exp2_ftz(fmaf(S[i + 4], mul[r], neg[r]));
      const float p3 = exp2_ftz(fmaf(S[i + 5], mul[r], neg[r]));
      l[r] += p0 + p1;  // the order of the sums: element by element, as the columns run
      l[r] += p2 + p3;
      const int off = r * 512 + (((i >> 3) ^ swz) << 4);
      const uint32_t p4 =
          uint32_t(e4m3x2(p0, p1)) | (uint32_t(e4m3x2(p2, p3)) << 16);
      *reinterpret_cast<uint32_t*>(base + off) = p4;
      const uint2 h = e4m3x4_to_f16x4(p4);  // the four stored values, exactly
      sum_p8[r] = __hadd2(sum_p8[r], __hadd2(*reinterpret_cast<const __half2*>(&h.x), *reinterpret_cast<const __half2*>(&h.y)));
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const float2 f = __half22float2(sum_p8[r]);
    l_p8[r] += f.x + f.y;
  }
}

// ---------------------------------------------------------------------------------------------
// The roles of the math warpgroups over the CTA's tiles; ph as in produce. Per tile t in stage
// st = t % 4: the producer fills the stage (kv_full); the softmax warpgroup reads K for S, releases its
// share of the stage, then writes P^T and row_alpha of the stage and arrives on p_full; each P V
// warpgroup waits for p_full, reads row_alpha, V (ldmatrix) and P^T (wgmma), and releases its share
// (kv_empty: 12 warp arrivals). The softmax warpgroup writes stage st's P^T and row_alpha again for tile
// t + 4 only after kv_full of tile t + 4, which the producer signals only after every P V warp released
// tile t: so the ring bounds how far the softmax warpgroup runs ahead, and no buffer is overwritten
// while it is read.

// The softmax warpgroup: S, the online softmax and P^T of every tile. m_run, l_run and l_p8: the
// thread's two rows' running max, sum of P and sum of the rounded P (quarter sums: the row's other
// quarters are in lanes lane ^ 1, lane ^ 2).
__device__ __forceinline__ void softmax_role(Storage& s, const Math& c, int num_tiles, uint32_t ph, float (&m_run)[2],
                                             float (&l_run)[2], float (&l_p8)[2]) {
  float S[32];
  for (int t = 0; t < num_tiles; ++t) {
    const int st = t % kStages, parity = ((t / kStages) ^ int(ph >> st)) & 1;
    wait_barrier(&s.kv_full[st], parity);
    issue_s(s, st, S);
    warpgroup_wait<0>();
    fence_acc(S);
    if (c.lane == 0) arrive_barrier(&s.kv_empty[st]);  // K read; the P V warpgroups still read V
    float tile_max[2], mul[2], m_new[2], m_sub[2], alpha[2];
    tile_rowmax(S, c, t, tile_max, mul);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) m_new[r] = fmaxf(m_run[r], tile_max[r]);
    advance_max(m_run, m_new, alpha, m_sub);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      l_run[r] *= alpha[r];
      l_p8[r] *= alpha[r];
      if (c.lane % 4 == 0) s.row_alpha[st][c.row0 + 8 * r] = alpha[r];
    }
    float m_sub8[2] = {m_sub[0] - kPScaleLog2, m_sub[1] - kPScaleLog2};
    if (__builtin_expect(fabsf(m_sub[0]) >= kExactMaxLimit || fabsf(m_sub[1]) >= kExactMaxLimit, 0))
      shift_huge_rows(S, mul, m_sub, m_sub8);
    exp_store_pt(S, c, mul, m_sub8, l_run, l_p8, s.pt[st]);
    fence_proxy_async_shared();  // P^T stores -> the P V warpgroups' wgmma reads
    arrive_barrier(&s.p_full[st]);
  }
}

// A P V warpgroup (pw: which 256 of V's dims): O^T += V^T P^T over every tile.
__device__ __forceinline__ void pv_role(Storage& s, int pw, int warp, int lane, int num_tiles, uint32_t ph,
                                        float (&o)[4][32]) {
  const VtAddr vt(s, pw, warp, lane);
  for (int t = 0; t < num_tiles; ++t) {
    const int st = t % kStages, parity = ((t / kStages) ^ int(ph >> st)) & 1;
    wait_barrier(&s.kv_full[st], parity);  // V landed (this wait also makes the copies visible here)
    wait_barrier(&s.p_full[st], parity);
    rescale_cols(o, s.row_alpha[st], lane);
    pv_promoted(s, st, vt, o);
    __syncwarp();  // every lane's reads of V and row_alpha before lane 0 releases the stage for the warp
    if (lane == 0) arrive_barrier(&s.kv_empty[st]);
  }
}

// ---------------------------------------------------------------------------------------------
// One (request, row block, key range) of the math warpgroups: Q, the roles and the epilogue, which
// writes out and lse (piece_row < 0) or the workspace piece whose first row is piece_row. ph as in
// produce. tid: the thread's index among the math threads (0-127 the softmax warpgroup). Each role has
// its own function, called right after its warpgroup's register reconfiguration, so ptxas allocates
// each under its own budget (code both roles shared would get the smaller one).

// The softmax warpgroup's part: softmax_role once the P V warpgroups have rounded Q, then lse and the
// rows' factors for the P V warpgroups. kTrace: stamp the CTA's phase trace (trace.cuh; uniform launches
// of an MLA_TRACE build): Q rounded and stored, and this warpgroup's loop done.
template <int NUM_HEADS, bool kTrace>
__device__ __forceinline__ void softmax_rows(const DecodeParams& p, Storage& s, const CtaWork& w, int64_t piece_row,
                                             int tid, uint32_t ph) {
  const MlaDecodeArgs& a = p.a;
  const int warp = tid / 32, lane = tid % 32;
  role_barrier<kMathThreads>(kBarQ);  // Q is in shared memory
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceQLanded);
  const float nan = __int_as_float(0x7fc00000);
  const float k_scale = a.k_scale_ptr != nullptr ? __ldg(a.k_scale_ptr) : a.k_scale;
  Math c;
  c.warp = warp;
  c.lane = lane;
  c.row0 = warp * 16 + lane / 4;
  c.kv_begin = w.kv_begin;
  c.pt_base = c.row0 * 64 + 4 * (lane % 4);
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int qi = (w.m_block * kBlockM + c.row0 + 8 * r) / NUM_HEADS;
    c.key_limit[r] = min(w.kv_end, w.seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
    c.score_scale[r] = p.scale_log2 * k_scale * s.q_inv_scale[c.row0 + 8 * r];
  }
  c.unmasked_end = __reduce_min_sync(0xffffffff, min(c.key_limit[0], c.key_limit[1]));
  c.fold_scale = __all_sync(0xffffffff, c.score_scale[0] > 0.f && c.score_scale[1] > 0.f);
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, l_p8[2] = {0.f, 0.f};
  if (w.num_tiles > 0) softmax_role(s, c, w.num_tiles, ph, m_run, l_run, l_p8);
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceLoopDone);
  // Per row (lane % 4 == 0 holds it after the quad sums): lse (l_run scaled by 2^8), and O's factor
  // k_scale / l_p8 (l_p8 scaled by 2^8) for the P V warpgroups.
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 2);
    l_p8[r] += __shfl_xor_sync(0xffffffff, l_p8[r], 1);
    l_p8[r] += __shfl_xor_sync(0xffffffff, l_p8[r], 2);
    const int n = c.row0 + 8 * r, grow = w.m_block * kBlockM + n;
    const int qi = grow / NUM_HEADS, h = grow % NUM_HEADS;
    if (lane % 4 == 0) {
      s.row_factor[n] = w.bad_len ? nan : (l_p8[r] > 0.f ? k_scale / l_p8[r] : 0.f);
      const float lse =
          w.bad_len ? nan : (l_run[r] > 0.f ? (m_run[r] + log2f(l_run[r]) - kPScaleLog2) * kLn2 : -INFINITY);
      const QueryRow q = query_row(a, w.b, qi, h);
      if (q.valid && piece_row >= 0) {
        split_workspace<Piece>(a).lse[piece_row + int64_t(qi) * a.num_heads + h] = lse;
      } else if (q.valid) {
        a.lse[int64_t(q.ob) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(q.t) * a.lse_stride_token] =
            lse;
      }
    }
  }
  role_barrier<kMathThreads>(kBarEnd);  // row_factor written; every read of Q and P^T done
}

// A P V warpgroup's part (math threads 128-383): Q (make_q wants 72 registers, which the P V
// warpgroups have to spare before their O^T is live), then pv_role, then its half of out. kTrace as in
// softmax_rows: the second P V warpgroup's loop done, then the first one's row factors read and stores done.
template <int NUM_HEADS, bool kTrace>
__device__ __forceinline__ void pv_rows(const DecodeParams& p, Storage& s, const CtaWork& w, int64_t piece_row, int tid,
                                        uint32_t ph) {
  const MlaDecodeArgs& a = p.a;
  const int pw = __shfl_sync(0xffffffff, tid / 128, 0) - 1, warp = (tid % 128) / 32, lane = tid % 32;
  make_q<NUM_HEADS>(s, a, w.b, w.m_block, tid - 128);
  fence_proxy_async_shared();  // Q stores -> wgmma reads
  role_barrier<kMathThreads>(kBarQ);
  float o[4][32];
  CUTE_UNROLL
  for (int mb = 0; mb < 4; ++mb) {
    CUTE_UNROLL
    for (int i = 0; i < 32; ++i) o[mb][i] = 0.f;
  }
  if (w.num_tiles > 0) pv_role(s, pw, warp, lane, w.num_tiles, ph, o);
  if constexpr (kTrace) trace_at(p, kProducerThreads + 256).stamp(kTraceLoopDoneLast);
  role_barrier<kMathThreads>(kBarEnd);  // row_factor written; every read of Q and P^T done
  if constexpr (kTrace) trace_at(p, kProducerThreads + 128).stamp(kTraceMerged);

  // Normalised O: each P V warpgroup stages its 256 dims x 64 rows of O^T as 64 rows of 512 bytes in the
  // memory of Q and P^T (Storage; every read of both is done: kBarEnd above), the row-major layout
  // copy_staged_rows reads (16-byte chunk c of row r at c ^ (r % 8); a warp's 32 stores per (jj, mb) hit
  // 32 distinct banks), then copies whole rows out in a rolled loop: the epilogue runs once per CTA
  // (per segment, scheduled), so its code is kept small (a cold call fetches it from DRAM).
  char* stage = reinterpret_cast<char*>(s.q) + pw * kStagedBytes;
  {
    // O^T column o_col(jj) = row 8 (jj >> 1) + n_lo, n_lo = 2 (lane % 4) + (jj & 1); dims d, d + 1 with
    // d = 64 mb + 16 warp + 2 (lane / 4): chunk 8 mb + 2 warp + lane / 16, byte 4 ((lane / 4) % 4).
    const uint32_t chunk = uint32_t(2 * warp + lane / 16), byte = 4u * ((uint32_t(lane) / 4u) % 4u);
    char* base[2];
    CUTE_UNROLL
    for (int odd = 0; odd < 2; ++odd) {
      const uint32_t n_lo = 2u * (uint32_t(lane) % 4u) + uint32_t(odd);
      base[odd] = stage + n_lo * 512u + ((chunk ^ n_lo) * 16u) + byte;
    }
    CUTE_UNROLL
    for (int jj = 0; jj < 16; ++jj) {
      const float inv = s.row_factor[o_col(jj, lane)];
      const int i = 4 * (jj >> 1) + (jj & 1);
      CUTE_UNROLL
      for (int mb = 0; mb < 4; ++mb) {
        *reinterpret_cast<uint32_t*>(base[jj & 1] + (jj >> 1) * 8 * 512 + mb * 128) =
            pack2<Piece>(o[mb][i] * inv, o[mb][i + 2] * inv);
      }
    }
  }
  warpgroup_barrier(kBarOwnP + pw);
  auto dst_of = [&](uint32_t row) -> char* {
    const int grow = w.m_block * kBlockM + int(row);
    const int qi = grow / NUM_HEADS, h = grow % NUM_HEADS;
    const QueryRow q = query_row(a, w.b, qi, h);
    if (!q.valid) return nullptr;
    Piece* dst = piece_row >= 0
                     ? split_workspace<Piece>(a).o + (piece_row + int64_t(qi) * a.num_heads + h) * kHeadDimV
                     : static_cast<Piece*>(a.out) + int64_t(q.ob) * a.out_stride_batch +
                           int64_t(q.t) * a.out_stride_token + int64_t(h) * a.out_stride_head;
    return reinterpret_cast<char*>(dst + pw * (kHeadDimV / kPvWgs));
  };
  // Workspace rows are 16-byte aligned (launch.cuh checks the workspace); out rows may be 8-byte only.
  const bool aligned16 =
      piece_row >= 0 || ((reinterpret_cast<uintptr_t>(a.out) | uintptr_t(a.out_stride_batch) * sizeof(Piece) |
                          uintptr_t(a.out_stride_token) * sizeof(Piece) | uintptr_t(a.out_stride_head) * sizeof(Piece)) %
                         16) == 0;
  if (aligned16) {
    copy_staged_rows<Piece, true>(stage, tid % 128, dst_of);
  } else {
    copy_staged_rows<Piece, false>(stage, tid % 128, dst_of);
  }
  if constexpr (kTrace) {
    const TraceSink tr = trace_at(p, kProducerThreads + 128);
    tr.stamp(kTraceStored);
    tr.info(w.num_tiles);
  }
}

// ---------------------------------------------------------------------------------------------
// The balanced schedule (schedule.cuh): the CTA's run of (request, tile) pairs, one segment per request
// it touches, walked as scheduled.cuh walks it for the 16-bit path. Each segment's tile 0 takes stage
// 0, and ph carries each stage's use parity from segment to segment. The producer needs no hand-over
// with the epilogue (it stages O outside the ring), so it fills the next segment's first tiles while the
// math warpgroups finish the last one.

template <int NUM_HEADS, int PAGE_SIZE>
__device__ __forceinline__ void produce_scheduled(const DecodeParams& p, Storage& s, int ptid, const void* kv_map) {
  uint32_t ph = 0;
  for_each_segment<NUM_HEADS, PAGE_SIZE>(p, [&](const CtaWork& w) {
    prefetch_q_rows<NUM_HEADS>(p.a, w.b, w.m_block, ptid);
    if (w.num_tiles == 0) return;
    produce<PAGE_SIZE>(s, p.a, w.b, w.kv_begin, w.kv_end, w.num_tiles, ptid, ph, kv_map);
    ph ^= stage_flips(w.num_tiles);
  });
}

// A segment without tiles only writes its placed rows (out 0 and lse -inf, or NaN). Between segments
// the three math warpgroups meet (kBarEnd): the next segment's Q and P^T overwrite the memory where the
// last one's O was staged. for_each_segment keeps only its cursor live, and this walk only ph: pv_rows
// needs every register. SOFTMAX: the softmax warpgroup's walk, else a P V warpgroup's.
template <int NUM_HEADS, int PAGE_SIZE, bool SOFTMAX>
__device__ __forceinline__ void consume_scheduled(const DecodeParams& p, Storage& s, int tid) {
  uint32_t ph = 0;
  for_each_segment<NUM_HEADS, PAGE_SIZE>(p, [&](const CtaWork& w) {
    const int64_t piece_row = piece_row_of<true, /*SCHED=*/true>(p.a, w.b, w.split);
    if constexpr (SOFTMAX) {
      softmax_rows<NUM_HEADS, false>(p, s, w, piece_row, tid, ph);
    } else {
      pv_rows<NUM_HEADS, false>(p, s, w, piece_row, tid, ph);
    }
    ph ^= stage_flips(w.num_tiles);
    role_barrier<kMathThreads>(kBarEnd);
  });
  if constexpr (MLA_TRACE != 0 && !SOFTMAX) {
    // The trace (trace.cuh): past the last segment's stores, then the CTA's tiles and its segments with
    // tiles, counted by walking the schedule again (no counter stays live across pv_rows).
    const TraceSink tr = trace_at(p, kProducerThreads + 128);
    tr.stamp(kTraceStored);
    int tiles = 0, segments = 0;
    for_each_segment<NUM_HEADS, PAGE_SIZE>(p, [&](const CtaWork& w) {
      tiles += w.num_tiles;
      segments += w.num_tiles > 0;
    });
    tr.info(tiles);
    tr.put(kTraceSegments, uint64_t(segments));
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel of a variant of dtype fp8_e4m3_fast (launch.cuh): grid x = m_block + num_m_blocks * request,
// y = split (SCHED: x = m_block + num_m_blocks * c, the balanced schedule's CTA c). With num_kv_splits > 1
// (or a request the schedule shares among CTAs) each CTA writes its normalised 16-bit piece and lse to the
// workspace and combine.cuh merges them (SPLIT: a split variant, which allows the combine's early launch).
template <int NUM_HEADS, int PAGE_SIZE, bool SPLIT, bool SCHED = false>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_fp8_fast_kernel(const __grid_constant__ DecodeParams p) {
  static_assert(!SCHED || SPLIT, "a scheduled launch writes workspace pieces: split variants only");
  extern __shared__ char smem_raw[];
  char* smem_aligned = smem_raw + ((1024 - (reinterpret_cast<uintptr_t>(smem_raw) & 1023)) & 1023);
  Storage& s = *reinterpret_cast<Storage*>(smem_aligned);
  const MlaDecodeArgs& a = p.a;
  // In an MLA_TRACE build (trace.cuh) producer thread 0 and the first thread of the softmax and of each
  // P V warpgroup stamp the CTA's phases.
  trace_at(p, kProducerThreads).stamp(kTraceEntry);
  if (threadIdx.x == 0) {
    CUTE_UNROLL
    for (int st = 0; st < kStages; ++st) {
      cutlass::arch::ClusterBarrier::init(&s.kv_full[st], kProducerThreads);
      cutlass::arch::ClusterBarrier::init(&s.kv_empty[st], kMathThreads / 32);  // each math warp once
      cutlass::arch::ClusterBarrier::init(&s.p_full[st], 128);                   // each softmax thread
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    const void* kv_map = PAGE_SIZE % kBlockN == 0 && p.use_tma ? &p.kv_map : nullptr;  // launch.cuh: TMA pages
    if (kv_map != nullptr && threadIdx.x == 0) prefetch_tensor_map(kv_map);
    trace_at(p, 0).stamp(kTraceProducerStart);
    if constexpr (SCHED) {
      produce_scheduled<NUM_HEADS, PAGE_SIZE>(p, s, threadIdx.x, kv_map);
    } else {
      const CtaWork w = cta_work<NUM_HEADS, PAGE_SIZE, kBlockM>(p);
      if (w.num_tiles > 0) produce<PAGE_SIZE>(s, a, w.b, w.kv_begin, w.kv_end, w.num_tiles, threadIdx.x, 0u, kv_map);
    }
    cp_async_wait_all();  // do not retire with copies in flight
    trace_at(p, 0).stamp(kTraceProducerDone);  // its own copies landed (TMA tiles: issued)
    return;
  }
  // 40 + 104 + 2 x 184 = 512 registers per thread slot of a warpgroup: the 64 Ki of the SM.
  const int tid = threadIdx.x - kProducerThreads;
  if (tid < 128) {
    cutlass::arch::warpgroup_reg_dealloc<104>();  // the softmax warpgroup
    if constexpr (SCHED) {
      consume_scheduled<NUM_HEADS, PAGE_SIZE, true>(p, s, tid);
    } else {
      const CtaWork w = cta_work<NUM_HEADS, PAGE_SIZE, kBlockM>(p);
      softmax_rows<NUM_HEADS, MLA_TRACE != 0>(p, s, w, piece_row_of<SPLIT, /*SCHED=*/false>(a, w.b, w.split), tid, 0u);
    }
    return;  // like the producer, it exits before the stores: only they allow the combine's launch
  } else {
    cutlass::arch::warpgroup_reg_alloc<184>();  // the P V warpgroups: O^T (128) and the promotion's accumulator (32)
    if constexpr (SCHED) {
      consume_scheduled<NUM_HEADS, PAGE_SIZE, false>(p, s, tid);
    } else {
      const CtaWork w = cta_work<NUM_HEADS, PAGE_SIZE, kBlockM>(p);
      pv_rows<NUM_HEADS, MLA_TRACE != 0>(p, s, w, piece_row_of<SPLIT, /*SCHED=*/false>(a, w.b, w.split), tid, 0u);
    }
    allow_dependent_launch<SPLIT>();  // past this warpgroup's stores
  }
}

}  // namespace fast
}  // namespace mla
