// The MLA decode kernel body: one CTA computes attention for one block of 64 query rows
// (q_len x num_heads) of one request over one split of its keys.
//
// Math (FlashAttention-2 online softmax, Dao 2023, with the MLA latent cache of DeepSeek-V2,
// arXiv:2405.04434): for query row i, s_ij = softmax_scale * <q_i, k_j> over the 576 values,
// p_ij = exp(s_ij - m_i), o_i = sum_j p_ij v_j / sum_j p_ij, lse_i = m_i + log(sum_j p_ij).
// Scores live in the exp2 domain (scale folded with log2 e); masked scores are -inf and a row whose
// max is still -inf subtracts 0, so no inf - inf can appear; KV rows past the split are zero in shared
// memory, so a NaN in an unused cache slot never meets a zero probability.
//
// Structure per CTA (384 threads = 3 warpgroups, warp-specialized):
//   - warpgroup 0 (producer, 40 registers) gathers Q once and then the KV tiles through block_table
//     with 16-byte cp.async into a ring of 2 tiles x 9 sub-tiles of 64 columns; each sub-tile slot has
//     a "full" mbarrier (the copies landed) and an "empty" one (every math warp finished reading it),
//     so loads for tile t+2 start as soon as the sub-tiles of tile t they overwrite are released;
//   - math warpgroup w (232 registers) computes S for tokens [32w, 32w+32) of the tile with wgmma (SS),
//     starting on each 64-column sub-tile as soon as it lands;
//   - the row max is exchanged through shared memory, P (16-bit) is written to shared memory;
//   - math warpgroup w accumulates O[:, 256w : 256w+256] += P V with wgmma (SS), V read from the same
//     tile, without waiting: P V of tile t runs on the tensor cores while S of tile t+1 is issued;
//     O is rescaled only when a row max moved;
//   - a warpgroup releases the RoPE sub-tile and the other half's latent sub-tiles right after S, and
//     its own half's once its P V completed.
// Rows are ordered qi * NUM_HEADS + h; rows with h >= num_heads or qi >= q_len are padding (Q zero,
// never stored).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "abi.h"
#include "constants.cuh"
#include "layouts.cuh"

namespace mla {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Small device helpers.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// 16-byte copy that writes zeros and reads nothing when !valid (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// The mbarrier receives one arrival once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)));
}
// Barrier 4 over the 128 producer threads only (the fp8 staging tiles).
__device__ __forceinline__ void producer_barrier() {
  asm volatile("bar.sync 4, %0;\n" ::"n"(kProducerThreads) : "memory");
}

// Four e4m3 values (one 32-bit word, lowest byte first) -> four fp16 values (two words), exactly.
__device__ __forceinline__ uint2 e4m3x4_to_f16x4(uint32_t v) {
  uint2 r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"(v));
  return r;
}
// Two bf16 values (one word, lower element first) -> two fp16 values times kFp8QPrescale.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2_prescaled(uint32_t v) {
  __half2 h = __floats2half2_rn(__uint_as_float(v << 16) * kFp8QPrescale,
                                __uint_as_float(v & 0xffff0000u) * kFp8QPrescale);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Barrier `id` (1..15) over the 256 math threads only; the producer never takes part.
__device__ __forceinline__ void math_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(128 * kNumWarpgroups));
}
__device__ __forceinline__ void wait_barrier(uint64_t* bar, int parity) {
  cutlass::arch::ClusterBarrier::wait(bar, uint32_t(parity));
}
__device__ __forceinline__ void arrive_barrier(uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); }

template <class Element>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<cutlass::bfloat16_t>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<cutlass::half_t>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <class Frag>
__device__ __forceinline__ void fence_fragment(Frag& frag) {
  CUTE_UNROLL
  for (int i = 0; i < size(frag); ++i) warpgroup_fence_operand(frag(i));
}

// C[M x N] (+)= A B^T over all k-blocks of the partitioned operands, one warpgroup.
template <class TiledMma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, FragA const& a, FragB const& b, FragC& c,
                                               bool zero_init) {
  fence_fragment(c);
  warpgroup_arrive();
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  fence_fragment(c);
}

// ---------------------------------------------------------------------------------------------
// Kernel parameters: the ABI struct plus values derived once on the host.

struct DecodeParams {
  MlaDecodeArgs a;
  int num_m_blocks;     // ceil(NUM_HEADS * q_len / kBlockM)
  float scale_log2;     // softmax_scale * log2(e)
};

// Where the split-KV partial results live inside the workspace.
struct SplitWorkspace {
  float* o;     // [num_kv_splits, batch, q_len, num_heads, 512], already divided by the row sum
  float* lse;   // [num_kv_splits, batch, q_len, num_heads], natural log, -inf for an empty split
};

__host__ __device__ __forceinline__ SplitWorkspace split_workspace(const MlaDecodeArgs& a) {
  const int64_t rows = int64_t(a.num_kv_splits) * a.batch * a.q_len * a.num_heads;
  return SplitWorkspace{a.workspace, a.workspace + rows * kHeadDimV};
}

// The key range [begin, end) that split `split` of a request with `seq_len` keys covers. Every
// split of a request gets the same whole number of kBlockN tiles, so the work divides evenly.
__host__ __device__ __forceinline__ void split_range(int seq_len, int num_splits, int split, int& begin,
                                                     int& end) {
  const int tiles = (seq_len + kBlockN - 1) / kBlockN;
  const int tiles_per_split = (tiles + num_splits - 1) / num_splits;
  begin = min(seq_len, split * tiles_per_split * kBlockN);
  end = min(seq_len, begin + tiles_per_split * kBlockN);
}

// ---------------------------------------------------------------------------------------------
// The producer warpgroup: global -> shared copies, all 16-byte cp.async.

// Q block: eight producer threads copy one 1152-byte row (9 chunks each), 16 rows per pass.
template <class Element, int NUM_HEADS>
__device__ __forceinline__ void load_q_block(Element* sq, const MlaDecodeArgs& a, int b, int m_block, int ptid) {
  const int sub = ptid % kThreadsPerRow;
  constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
  CUTE_UNROLL
  for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + ptid / kThreadsPerRow;
    const int grow = m_block * kBlockM + row;
    const int qi = grow / NUM_HEADS;
    const int h = grow % NUM_HEADS;
    const bool valid = qi < a.q_len && h < a.num_heads;
    const char* nope = static_cast<const char*>(a.q_nope);
    const char* pe = static_cast<const char*>(a.q_pe);
    if (valid) {
      nope += (int64_t(b) * a.q_nope_stride_batch + int64_t(qi) * a.q_nope_stride_token +
               int64_t(h) * a.q_nope_stride_head) * int64_t(sizeof(Element));
      pe += (int64_t(b) * a.q_pe_stride_batch + int64_t(qi) * a.q_pe_stride_token +
             int64_t(h) * a.q_pe_stride_head) * int64_t(sizeof(Element));
    }
    CUTE_UNROLL
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      const int c = sub + k * kThreadsPerRow;
      const uint32_t dst = smem_u32(sq) + swizzled_offset(row, c * kChunkElems, kBlockM);
      const char* src = c < kKvLoraRank / kChunkElems ? nope + (valid ? c * 16 : 0)
                                                       : pe + (valid ? (c - kKvLoraRank / kChunkElems) * 16 : 0);
      cp_async_16_zfill(dst, src, valid);  // padding rows: zeros
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
  cp_async_wait<0>();  // do not retire while copies are in flight
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
    const int grow = m_block * kBlockM + row;
    const int qi = grow / NUM_HEADS;
    const int h = grow % NUM_HEADS;
    const bool valid = qi < a.q_len && h < a.num_heads;
    const char* nope = static_cast<const char*>(a.q_nope) +
                       (int64_t(b) * a.q_nope_stride_batch + int64_t(qi) * a.q_nope_stride_token +
                        int64_t(h) * a.q_nope_stride_head) * 2;
    const char* pe = static_cast<const char*>(a.q_pe) +
                     (int64_t(b) * a.q_pe_stride_batch + int64_t(qi) * a.q_pe_stride_token +
                      int64_t(h) * a.q_pe_stride_head) * 2;
#pragma unroll 3  // a few loads in flight within the producer's 40 registers
    for (int k = 0; k < kChunksPerRow / kThreadsPerRow; ++k) {
      const int c = sub + k * kThreadsPerRow;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (valid) {
        v = __ldg(reinterpret_cast<const uint4*>(c < kKvLoraRank / kChunkElems ? nope + c * 16
                                                                                : pe + (c - kKvLoraRank / kChunkElems) * 16));
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
  CUTE_UNROLL
  for (int pass = 0; pass < 2; ++pass) {
    const int n = pass * 32 + ptid / 4;
    const int token = tile_start + n;
    const bool valid = token < kv_end;
    const char* src = valid ? cache + int64_t(table[token / PAGE_SIZE]) * a.kv_stride_page +
                                  int64_t(token % PAGE_SIZE) * a.kv_stride_token
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
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------------------------
// Epilogue: normalised O and lse for the thread's two rows, to `out`/`lse` or to the workspace.

template <class Out, int NUM_HEADS, bool SPLIT, class FragO>
__device__ __forceinline__ void store_rows(const DecodeParams& p, int b, int split, int m_block, int wg,
                                           int row0, FragO const& o, const float (&inv_sum)[2],
                                           const float (&lse)[2]) {
  const MlaDecodeArgs& a = p.a;
  const int lane = threadIdx.x % 32;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int grow = m_block * kBlockM + row0 + 8 * r;
    const int qi = grow / NUM_HEADS;
    const int h = grow % NUM_HEADS;
    if (qi >= a.q_len || h >= a.num_heads) continue;
    if (SPLIT && a.num_kv_splits > 1) {  // a split variant run with one split writes out directly
      const SplitWorkspace ws = split_workspace(a);
      const int64_t ws_row = ((int64_t(split) * a.batch + b) * a.q_len + qi) * a.num_heads + h;
      float* dst = ws.o + ws_row * kHeadDimV + wg * (kHeadDimV / kNumWarpgroups) + 2 * (lane % 4);
      CUTE_UNROLL
      for (int j = 0; j < size(o) / 4; ++j) {
        const float2 v = make_float2(o(4 * j + 2 * r) * inv_sum[r], o(4 * j + 2 * r + 1) * inv_sum[r]);
        *reinterpret_cast<float2*>(dst + 8 * j) = v;
      }
      if (wg == 0 && lane % 4 == 0) ws.lse[ws_row] = lse[r];
    } else {
      Out* dst = static_cast<Out*>(a.out) + int64_t(b) * a.out_stride_batch +
                     int64_t(qi) * a.out_stride_token + int64_t(h) * a.out_stride_head +
                     wg * (kHeadDimV / kNumWarpgroups) + 2 * (lane % 4);
      CUTE_UNROLL
      for (int j = 0; j < size(o) / 4; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            pack2<Out>(o(4 * j + 2 * r) * inv_sum[r], o(4 * j + 2 * r + 1) * inv_sum[r]);
      }
      if (wg == 0 && lane % 4 == 0) {
        a.lse[int64_t(b) * a.lse_stride_batch + int64_t(h) * a.lse_stride_head + int64_t(qi) * a.lse_stride_token] = lse[r];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: x = m_block + num_m_blocks * request, y = split.

template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
__global__ void __launch_bounds__(kNumThreads, 1) mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  using L = KernelLayouts<Element>;
  constexpr int kKvStages = Types::kKvStages;
  extern __shared__ char smem_raw[];
  char* smem_aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  SharedStorage<Cache>& s = *reinterpret_cast<SharedStorage<Cache>*>(smem_aligned);

  const MlaDecodeArgs& a = p.a;
  const int m_block = blockIdx.x % p.num_m_blocks;
  const int b = blockIdx.x / p.num_m_blocks;
  const int split = blockIdx.y;

  // Keys of this request. A seq_len that block_table cannot address (or a negative one) is never
  // read past the table: the request's rows get NaN, so the bad input cannot pass for an answer.
  const int raw_len = a.seq_lens[b];
  const bool bad_len = raw_len < 0 || int64_t(raw_len) > int64_t(a.max_pages_per_seq) * PAGE_SIZE;
  const int seq_len = bad_len ? 0 : raw_len;
  int kv_begin, kv_end;
  split_range(seq_len, a.num_kv_splits, split, kv_begin, kv_end);
  const int num_tiles = (kv_end - kv_begin + kBlockN - 1) / kBlockN;

  if (threadIdx.x == 0) {
    cutlass::arch::ClusterBarrier::init(&s.q_full, kProducerThreads);
    CUTE_UNROLL
    for (int i = 0; i < kKvStages * kSubTiles; ++i) {
      cutlass::arch::ClusterBarrier::init(&s.kv_full[i], kProducerThreads);
      cutlass::arch::ClusterBarrier::init(&s.kv_empty[i], 4 * kNumWarpgroups);  // one arrival per math warp
    }
    if constexpr (Types::kFp8) {
      cutlass::arch::ClusterBarrier::init(&s.staging.full[0], kProducerThreads);
      cutlass::arch::ClusterBarrier::init(&s.staging.full[1], kProducerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (num_tiles > 0) {
      if constexpr (Types::kFp8) {
        produce_fp8<NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x);
      } else {
        produce<Cache, NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<kMathRegs>();

  const int tid = threadIdx.x - kProducerThreads;
  const int wg = tid / 128;
  const int tid_wg = tid % 128;
  const int lane = tid % 32;
  const bool warp_leader = lane == 0;
  const int row0 = (tid_wg / 32) * 16 + lane / 4;  // this thread's rows: row0 and row0 + 8

  // Score scale (log2 domain) and output scale. An fp8 cache holds real / k_scale and q was loaded
  // times kFp8QPrescale, so scores take k_scale / kFp8QPrescale and the output k_scale.
  float score_scale = p.scale_log2, v_scale = 1.f;
  if constexpr (Types::kFp8) {
    v_scale = a.k_scale_ptr != nullptr ? __ldg(a.k_scale_ptr) : a.k_scale;
    score_scale *= v_scale / kFp8QPrescale;
  }

  // Causal, bottom-right aligned: query qi sees keys < seq_len - (q_len - 1 - qi).
  int key_limit[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int qi = (m_block * kBlockM + row0 + 8 * r) / NUM_HEADS;
    key_limit[r] = min(kv_end, seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
  }

  typename L::TiledMmaS mma_s;
  typename L::TiledMmaO mma_o;
  mma_o.accumulate_ = GMMA::ScaleOut::One;  // O starts cleared and only ever accumulates
  auto thr_s = mma_s.get_thread_slice(tid_wg);
  auto thr_o = mma_o.get_thread_slice(tid_wg);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDimV / kNumWarpgroups>>{});
  clear(tOrO);
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  if (num_tiles > 0) {
    Tensor sQ = make_tensor(make_smem_ptr(s.q), typename L::SmemLayoutQ{});
    Tensor sP = make_tensor(make_smem_ptr(s.p), typename L::SmemLayoutP{});
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);
    Tensor tOrP = thr_o.partition_fragment_A(sP);
    constexpr int kKStepsPerSubTile = kSubTileCols / 16;
    wait_barrier(&s.q_full, 0);

    for (int t = 0; t < num_tiles; ++t) {
      const int stage = t % kKvStages;
      const int full_parity = (t / kKvStages) & 1;
      const int tile_start = kv_begin + t * kBlockN;
      uint64_t* empty = &s.kv_empty[stage * kSubTiles];

      // S = Q K^T for this warpgroup's 32 tokens, each 64-column slice as soon as it lands.
      Tensor sK = make_tensor(make_smem_ptr(s.kv[stage]), typename L::SmemLayoutKV{});
      Tensor sKw = local_tile(sK, Shape<Int<kBlockN / kNumWarpgroups>, Int<kHeadDimK>>{}, make_coord(wg, 0));
      Tensor tSrK = thr_s.partition_fragment_B(sKw);
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN / kNumWarpgroups>>{});
      fence_fragment(tSrS);
      warpgroup_arrive();
      mma_s.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int c = 0; c < kSubTiles; ++c) {
        wait_barrier(&s.kv_full[stage * kSubTiles + c], full_parity);
        cutlass::arch::fence_view_async_shared();  // producer's cp.async writes -> this thread's wgmma reads
        CUTE_UNROLL
        for (int k = c * kKStepsPerSubTile; k < (c + 1) * kKStepsPerSubTile; ++k) {
          cute::gemm(mma_s, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
          mma_s.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      warpgroup_commit_batch();
      if (kKvStages > 1 && t > 0) {
        // P V of the previous tile (issued before this S, so it completes first) is done: its
        // V slices, this warpgroup's half of the previous stage, may be refilled.
        warpgroup_wait<1>();
        fence_fragment(tOrO);
        if (warp_leader) {
          const int prev = (t - 1) % kKvStages;
          CUTE_UNROLL
          for (int j = 0; j < 4; ++j) arrive_barrier(&s.kv_empty[prev * kSubTiles + 4 * wg + j]);
        }
      }
      warpgroup_wait<0>();
      fence_fragment(tSrS);
      // This warpgroup no longer reads the RoPE slice nor the other half's latent slices.
      if (warp_leader) {
        arrive_barrier(&empty[kSubTiles - 1]);
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) arrive_barrier(&empty[4 * (1 - wg) + j]);
      }

      // Scale, mask, and the partial row max over this warpgroup's tokens. Accumulator element i
      // of a 64xN wgmma tile is row row0 + 8*((i>>1)&1), column (i>>2)*8 + 2*(lane%4) + (i&1).
      float tile_max[2] = {-INFINITY, -INFINITY};
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const int r = (i >> 1) & 1;
        const int token = tile_start + wg * (kBlockN / kNumWarpgroups) + (i >> 2) * 8 + 2 * (lane % 4) + (i & 1);
        const float v = token < key_limit[r] ? tSrS(i) * score_scale : -INFINITY;
        tSrS(i) = v;
        tile_max[r] = fmaxf(tile_max[r], v);
      }
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
        if (lane % 4 == 0) s.row_stat[wg][row0 + 8 * r] = tile_max[r];
      }
      // Both warpgroups' maxima are visible, and both finished the previous tile's P V (so P is free).
      math_barrier(1);

      float alpha[2], m_sub[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m_run[r], fmaxf(s.row_stat[0][row0 + 8 * r], s.row_stat[1][row0 + 8 * r]));
        // While a row has seen no visible key its max is -inf: subtract 0 instead, so that
        // exp2(-inf - 0) = 0 and no -inf - (-inf) = NaN can appear.
        m_sub[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = exp2f(m_run[r] - m_sub[r]);
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); i += 2) {
        const int r = (i >> 1) & 1;
        const float p0 = exp2f(tSrS(i) - m_sub[r]);
        const float p1 = exp2f(tSrS(i + 1) - m_sub[r]);
        l_run[r] += p0 + p1;
        const int col = wg * (kBlockN / kNumWarpgroups) + (i >> 2) * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(s.p) + swizzled_offset(row0 + 8 * r, col, kBlockM)) =
            pack2<Element>(p0, p1);
      }
      // Rescale O only when some row's max moved (once the max settles, most tiles skip this).
      if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
        CUTE_UNROLL
        for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= alpha[(i >> 1) & 1];
      }
      cutlass::arch::fence_view_async_shared();  // P stores -> wgmma reads
      // P is complete, and both warpgroups have read the row maxima (row_stat may be rewritten).
      math_barrier(2);

      // O[:, 256 wg : 256 wg + 256] += P V.
      Tensor sVt = make_tensor(make_smem_ptr(s.kv[stage]), typename L::SmemLayoutVt{});
      Tensor sVw = local_tile(sVt, Shape<Int<kHeadDimV / kNumWarpgroups>, Int<kBlockN>>{}, make_coord(wg, 0));
      Tensor tOrV = thr_o.partition_fragment_B(sVw);
      // With two stages it is issued without waiting and runs on the tensor cores while the next
      // tile's S is issued. With one (fp8) the next tile needs these very slots, so wait and release.
      fence_fragment(tOrO);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOrP); ++k) cute::gemm(mma_o, tOrP(_, _, k), tOrV(_, _, k), tOrO);
      warpgroup_commit_batch();
      if constexpr (kKvStages == 1) {
        warpgroup_wait<0>();
        fence_fragment(tOrO);
        if (warp_leader) {
          CUTE_UNROLL
          for (int j = 0; j < 4; ++j) arrive_barrier(&empty[4 * wg + j]);
        }
      }
    }
    warpgroup_wait<0>();
    fence_fragment(tOrO);
  }

  // Combine the two warpgroups' partial row sums (row_stat is free: everyone passed barrier 2).
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 2);
    if (lane % 4 == 0) s.row_stat[wg][row0 + 8 * r] = l_run[r];
  }
  math_barrier(1);
  float inv_sum[2], lse[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const float l = s.row_stat[0][row0 + 8 * r] + s.row_stat[1][row0 + 8 * r];
    // A row that saw no key (empty request, empty split, or q_len > seq_len): out 0, lse -inf.
    inv_sum[r] = l > 0.f ? v_scale / l : 0.f;
    lse[r] = l > 0.f ? (m_run[r] + log2f(l)) * kLn2 : -INFINITY;
    if (bad_len) inv_sum[r] = lse[r] = __int_as_float(0x7fc00000);  // NaN
  }
  store_rows<typename Types::Out, NUM_HEADS, SPLIT>(p, b, split, m_block, wg, row0, tOrO, inv_sum, lse);
}

}  // namespace mla
