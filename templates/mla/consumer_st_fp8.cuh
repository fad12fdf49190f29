// The transposed math warpgroups for fp8 caches (SharedStorageStFp8): the same
// S^T = K Q^T, column softmax and O^T += V^T P^T as consume_st (consumer_st.cuh), but the KV operand
// never exists in fp16 in shared memory. Each thread loads the raw e4m3 bytes of its own fragment with
// 16-byte shared loads, converts them to fp16 in registers (exact) and issues register-sourced wgmma
// (A from registers, B = Q or P^T from shared memory). Compared with widening in place this takes the
// 72 KiB of fp16 stores per tile and half of the wgmma operand reads out of shared memory, and the ring
// holds 4 stages of 36 KiB raw bytes instead of 2 fp16 stages, so loads run further ahead.
//
// Why the orders below: the fp16 fragment of wgmma's A operand (m64k16, PTX "register fragment A")
// gives a thread rows g, g + 8 (g = lane / 4) and columns 2t, 2t+1, 2t+8, 2t+9 (t = lane % 4) of its
// warp's 16 x 16 block, two values per register. A GEMM does not care in which order its k index runs,
// nor in which order the rows of its result are stored, as long as both operands agree, so:
// - S^T (A = K, rows = tokens, k = the 576 values): in each 64-value block the Q tile is stored
//   permuted (producer.cuh st_q_dim) so that a thread's values for k-steps j = 0..3 are bytes
//   4j .. 4j+3 of one 16-byte load of its token row (values 16 t .. 16 t + 15): 2 loads a slot.
// - O^T (A = V^T, rows = the 512 latent values, k = tokens): O^T's row r of atom m in warp w is stored
//   as latent value 128 w + 16 g + 2 m + (r >= 8) (st_regs_dim), so a thread's 16 values over the 8
//   atoms are 16 contiguous bytes of a token row; a k-step then needs 4 loads (tokens 2t, 2t+1, 2t+8,
//   2t+9) and byte permutes pair two tokens per register. P^T is stored with tokens in the order
//   st_token(k) = k ^ ((k >> 1) & 1), which puts two even and two odd token rows in every load
//   instruction, and the raw ring's 16-byte chunks are swizzled by (row >> 1) & 3 (raw_offset), so the
//   lanes of a quarter warp hit distinct bank groups (4 wavefronts per V^T load instead of 8).
#pragma once
#include <cuda_runtime.h>

#include "arch.cuh"
#include "config.cuh"
#include "consumer_st.cuh"
#include "layouts.cuh"
#include "producer_fp8.cuh"  // load_q_pairs, store_q_chunk

namespace mla {

using namespace cute;

// One register-sourced wgmma m64 n kRows k16, fp16 x fp16 -> fp32, B K-major from shared memory.
template <int kRows, class Acc>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc_b, Acc&& d, GMMA::ScaleOut scale) {
  using namespace cute::SM90::GMMA;
  if constexpr (kRows == 32) {
    MMA_64x32x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>::fma(a[0], a[1], a[2], a[3], desc_b, d(0), d(1), d(2),
                                                                   d(3), d(4), d(5), d(6), d(7), d(8), d(9), d(10),
                                                                   d(11), d(12), d(13), d(14), d(15), scale);
  } else if constexpr (kRows == 16) {
    MMA_64x16x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>::fma(a[0], a[1], a[2], a[3], desc_b, d(0), d(1), d(2),
                                                                   d(3), d(4), d(5), d(6), d(7), scale);
  } else {
    MMA_64x8x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>::fma(a[0], a[1], a[2], a[3], desc_b, d(0), d(1), d(2),
                                                                  d(3), scale);
  }
}

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <int kN>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[kN][4]) {
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) {
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// The math warpgroups round Q into the fp16 tile once its bf16 rows have landed in
// o_x (q_full: every producer thread's Q copies), each thread ceil(chunks / math threads) chunks with all
// of its loads issued before any store; then each fences its stores for wgmma and all meet at kBarStQ.
// Every math thread of a CTA with tiles calls it (warpgroups that get no tile included), before
// consume_st_regs.
template <class Storage>
__device__ __forceinline__ void convert_q_st_fp8(Storage& s, int tid) {
  constexpr int kThreads = 128 * Storage::kMathWgs;
  constexpr int kChunks = Storage::kRowsPerCta * kChunksPerRow;
  constexpr int kPer = (kChunks + kThreads - 1) / kThreads;
  uint4 w[kPer];
  wait_barrier(&s.q_full, 0);
  CUTE_UNROLL
  for (int i = 0; i < kPer; ++i) {
    if (kChunks % kThreads == 0 || tid + i * kThreads < kChunks) w[i] = load_q_pairs(s, tid + i * kThreads);
  }
  CUTE_UNROLL
  for (int i = 0; i < kPer; ++i) {
    if (kChunks % kThreads == 0 || tid + i * kThreads < kChunks) store_q_chunk(s, tid + i * kThreads, w[i]);
  }
  fence_proxy_async_shared();  // rounded Q stores -> wgmma reads (writer side)
  math_barrier<kThreads>(kBarStQ);
}

// The warpgroup's loop over its tiles t = wg, wg + kMathWgs, ...: tile t in stage t % kRing. Same contract
// as consume_st, with O^T's rows in st_regs_dim order. With three math warpgroups (152 registers per
// thread) or 32 rows (O^T 128 registers) the K and V^T fragments are converted and issued in smaller
// wgmma batches (kKBatches, kVBatches); otherwise a slot's 4 k-steps and a k-step's 8 atoms at once.
template <class Storage, class FragO, int kRows = Storage::kRowsPerCta>
__device__ __forceinline__ void consume_st_regs(Storage& s, const StContext<kRows>& c, FragO& tOrO,
                                                float (&m_run)[kRows / 4], float (&l_run)[kRows / 4]) {
  constexpr int kCols = kRows / 4;
  static_assert(kRows == 8 || kRows == 16 || kRows == 32, "wgmma_rs picks n8, n16 or n32");
  static_assert(decltype(size<1>(tOrO))::value == 8, "O^T: 8 atoms of 64 latent rows");
  using Element = cutlass::half_t;
  using LS = StLayouts<Element, kRows>;
  typename LS::TiledMmaS mma_s;
  typename LS::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(c.tid_wg);
  auto thr_o = mma_o.get_thread_slice(c.tid_wg);
  const int wg = c.wg;
  if (wg >= c.num_tiles) return;  // fewer tiles than warpgroups: this one has nothing (warp-uniform)
  // Small batches where registers are short: three warpgroups (152 each), or 32 rows (O^T alone is 128).
  constexpr bool kTight = Storage::kMathWgs == 3 || kRows > 16;
  constexpr int kKBatches = kTight ? 2 : 1;  // S^T batches per 64-value slot
  constexpr int kKSteps = 4 / kKBatches;     // k-steps (wgmma) per batch
  constexpr int kVBatches = kTight ? 4 : 1;  // O^T batches per 16-token k-step
  constexpr int kWords = 4 / kVBatches;                       // words x (2 atoms each) per batch

  Element* pt = s.pt[wg];
  // Shared-memory descriptors of the B operands, one per k-step (the SS atoms' partitions give them).
  Tensor tSrQ = thr_s.partition_fragment_B(make_tensor(make_smem_ptr(s.q), typename LS::SmemLayoutQ{}));
  Tensor tOrP = thr_o.partition_fragment_B(make_tensor(make_smem_ptr(pt), typename LS::SmemLayoutPt{}));
  const int g = c.lane / 4, tq = c.lane % 4;
  const int tok0 = 16 * c.warp + g;  // this thread's token rows of S^T: tok0 and tok0 + 8
  // O^T: this thread's 16 latent values 128 warp + 16 g + (0..15) lie in slot (2 warp + g / 4) at byte
  // 16 (g % 4) of every token row.
  const int v_slot = 2 * c.warp + g / 4, v_chunk = g % 4;
  // Byte offsets of this thread's loads inside a slot, computed once (raw_offset inlined by hand: the
  // swizzle term (row >> 1) & 3 is the same for both K rows, and t for every V^T row of this thread).
  // K: rows tok0 and tok0 + 8. V^T, k-step k: rows st_token(16 k + 2t + {0, 1, 8, 9}) = 16 k + v_row[i].
  const int k_off = raw_offset(tok0, tq);
  // Rows v_row[2], v_row[3] are v_row[0], v_row[1] + 8 (same swizzle term): their offsets are + 512.
  const int v_row[2] = {2 * tq + (tq & 1), 2 * tq + 1 - (tq & 1)};
  const int v_off[2] = {raw_offset(v_row[0], v_chunk), raw_offset(v_row[1], v_chunk)};  // + 16 k rows: + 1024 k bytes

  // Q: convert_q_st_fp8 waited for q_full and the math warpgroups met after rounding it.
  for (int t = wg; t < c.num_tiles; t += Storage::kMathWgs) {
    // Tile t in stage t % kRing, the (t / kRing)-th fill of that stage (as the producer counts). With
    // two warpgroups a warpgroup alternates between two stages; with three, the stages rotate. Waiting
    // on parity (t / kRing) & 1 is safe because the fill of tile t - kRing completed before this
    // warpgroup's previous tile t - kMathWgs (each producer thread's arrivals track all its earlier copies).
    const int stage = t % Storage::kRing;
    const int parity = (t / Storage::kRing) & 1;
    uint64_t* full = &s.kv_full[stage * kSubTiles];
    uint64_t* empty = &s.kv_empty[stage * kSubTiles];

    // ---- S^T: per 64-value slot two 16-byte loads, 4 k-steps in kKBatches batches; the conversion of
    // one batch overlaps the wgmma of the previous one (two register buffers, at most one batch in
    // flight when one is refilled).
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kRows>>{});
    fence_fragment(tSrS);
    uint32_t ak[2][kKSteps][4];
    CUTE_UNROLL
    for (int sub = 0; sub < kSubTiles; ++sub) {
      wait_barrier(&full[sub], parity);
      const uint8_t* slot = s.kv[stage][sub];
      const uint4 r0 = lds128(slot + k_off);
      const uint4 r1 = lds128(slot + k_off + 8 * kSubTileCols);  // row + 8 keeps (row >> 1) & 3
      CUTE_UNROLL
      for (int h = 0; h < kKBatches; ++h) {  // k-steps j = kKSteps h .. kKSteps h + kKSteps - 1 of the slot
        uint32_t (&a)[kKSteps][4] = ak[(sub * kKBatches + h) & 1];
        CUTE_UNROLL
        for (int jj = 0; jj < kKSteps; ++jj) {
          const int j = kKSteps * h + jj;
          const uint2 lo = e4m3x4_to_f16x4(word(r0, j)), hi = e4m3x4_to_f16x4(word(r1, j));
          a[jj][0] = lo.x;  // row g,     columns 2t, 2t+1
          a[jj][1] = hi.x;  // row g + 8, columns 2t, 2t+1
          a[jj][2] = lo.y;  // row g,     columns 2t+8, 2t+9
          a[jj][3] = hi.y;  // row g + 8, columns 2t+8, 2t+9
        }
        if (sub == kSubTiles - 1 && h == 0) {  // the RoPE slot: read by S^T only (the conversions above
          __syncwarp();                        // used both 16-byte loads: every lane's loads are done)
          release(empty + sub, 1, c.lane);
        }
        fence_regs(a);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int jj = 0; jj < kKSteps; ++jj) {
          const int j = kKSteps * h + jj;
          wgmma_rs<kRows>(a[jj], uint64_t(tSrQ(0, 0, 4 * sub + j)), [&](int e) -> float& { return tSrS(e); },
                          sub == 0 && j == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();
      }
    }
    warpgroup_wait<0>();
    fence_fragment(tSrS);

    st_softmax_to_pt</*kPermuteTokens=*/true>(s, c, t, tok0, tSrS, tOrO, m_run, l_run, pt);
    fence_proxy_async_shared();  // P^T stores -> wgmma reads
    warpgroup_barrier(kBarStWg + wg);

    // ---- O^T += V^T P^T: per k-step (16 tokens) 4 loads, 8 atoms of 64 latent rows, in kVBatches
    // batches (two fragment buffers of 32 / kVBatches x 2 registers each).
    fence_fragment(tOrO);
    uint32_t av[2][2 * kWords][4];
    const uint8_t* vbase = s.kv[stage][v_slot];
    CUTE_UNROLL
    for (int k = 0; k < kBlockN / 16; ++k) {
      // k indices kk, kk + 1, kk + 8, kk + 9 of P^T, kk = 16 k + 2t
      const uint8_t* vk = vbase + 16 * k * kSubTileCols;  // 16 rows further keep (row >> 1) & 3
      const uint4 v0 = lds128(vk + v_off[0]);                      // token st_token(kk)
      const uint4 v1 = lds128(vk + v_off[1]);                      // st_token(kk + 1)
      const uint4 v2 = lds128(vk + v_off[0] + 8 * kSubTileCols);  // st_token(kk + 8)
      const uint4 v3 = lds128(vk + v_off[1] + 8 * kSubTileCols);  // st_token(kk + 9)
      CUTE_UNROLL
      for (int h = 0; h < kVBatches; ++h) {  // words x = kWords h .. kWords h + kWords - 1
        uint32_t (&a)[2 * kWords][4] = av[(k * kVBatches + h) & 1];
        CUTE_UNROLL
        for (int xx = 0; xx < kWords; ++xx) {  // word x: latent values 4x .. 4x+3 of this thread's 16 = atoms 2x, 2x+1
          const int x = kWords * h + xx;
          const uint32_t w0 = word(v0, x), w1 = word(v1, x), w2 = word(v2, x), w3 = word(v3, x);
          const uint2 p01a = e4m3x4_to_f16x4(__byte_perm(w0, w1, 0x5140));  // values 4x, 4x+1 of tokens kk, kk+1
          const uint2 p23a = e4m3x4_to_f16x4(__byte_perm(w2, w3, 0x5140));
          const uint2 p01b = e4m3x4_to_f16x4(__byte_perm(w0, w1, 0x7362));  // values 4x+2, 4x+3
          const uint2 p23b = e4m3x4_to_f16x4(__byte_perm(w2, w3, 0x7362));
          a[2 * xx][0] = p01a.x;      // row g (value 4x),       k 2t, 2t+1
          a[2 * xx][1] = p01a.y;      // row g + 8 (value 4x+1), k 2t, 2t+1
          a[2 * xx][2] = p23a.x;      // row g,                  k 2t+8, 2t+9
          a[2 * xx][3] = p23a.y;      // row g + 8,              k 2t+8, 2t+9
          a[2 * xx + 1][0] = p01b.x;  // atom 2x+1: values 4x+2 (row g) and 4x+3 (row g + 8)
          a[2 * xx + 1][1] = p01b.y;
          a[2 * xx + 1][2] = p23b.x;
          a[2 * xx + 1][3] = p23b.y;
        }
        if (k == kBlockN / 16 - 1 && h == 0) {  // every raw byte of K and V this warp needs is in registers
          __syncwarp();                          // (the conversions above used all four 16-byte loads)
          release(empty, kSubTiles - 1, c.lane);
        }
        fence_regs(a);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int m = 0; m < 2 * kWords; ++m) {
          wgmma_rs<kRows>(a[m], uint64_t(tOrP(0, 0, k)),
                          [&](int e) -> float& { return tOrO(e, 2 * kWords * h + m, 0); }, GMMA::ScaleOut::One);
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();
      }
    }
    warpgroup_wait<0>();
    fence_fragment(tOrO);
  }
}

}  // namespace mla
