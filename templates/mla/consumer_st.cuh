// The transposed ("S^T") math warpgroups for variants of at most 32 heads (config.cuh kUseSt).
//
// Why: the 64-row consumer (consumer_rows64.cuh) puts a CTA's query rows (qi, h) on wgmma M = 64. With 16
// heads and q_len 1 only 16 of those rows are real, so three quarters of every S and P V wgmma is
// padding and the 16-head bf16 kernel sits at its tensor-core time per tile (~2 us per 64-token tile
// per SM), which also keeps the fp8 cache from being faster than bf16. Here the roles swap: the KV
// tile's 64 tokens are M and the CTA's kRows = 8, 16 or 32 query rows are N (wgmma n8 / n16 / n32):
//   S^T[64 x kRows]  = K[64 x 576] Q^T               (A = KV tile, K-major; B = Q, K-major)
//   O^T[512 x kRows] += V^T[512 x 64] P^T[64 x kRows] (A = the same stage read MN-major; B = P^T)
// so the tensor work per tile scales with kRows instead of 64.
//
// Ownership (two math warpgroups; the fp8 register path runs three by default, Storage::kMathWgs,
// and rotates tile t through stage t % 4 there): tile t lives in stage t % 2 and belongs wholly to
// math warpgroup t % 2, which computes
// its S^T, its softmax and O^T += V^T P^T over all 512 latent rows. Each warpgroup keeps its own
// running max, row sums and O^T (512 x kRows fp32 over 128 threads: 64 registers at 16 rows, 128 at
// 32); there is no hand-off
// inside the loop, so each stage's slots are read by that warpgroup's 4 warps only (kv_empty expects
// 4 arrivals). The RoPE slot is released once S^T is done, the latent slots once P V is done. At the
// end the two partial softmaxes are merged exactly as flash-decoding merges splits (Dao et al. 2023,
// "Flash-Decoding for long-context inference"): m = max(m0, m1), l = l0 e^(m0 - m) + l1 e^(m1 - m),
// O = O0 e^(m0 - m) + O1 e^(m1 - m).
//
// Math per warpgroup: the FlashAttention-2 online softmax (Dao 2023) per query row, i.e. per column n
// of S^T, in the log2 domain: m_n = max over keys, p = exp2(s - m_n), l_n = sum p, o_n = sum p v; a
// new max rescales O^T's column and l_n by exp2(m_old - m_new). Masked scores are -inf and a column
// whose max is still -inf subtracts 0, so no -inf - (-inf) = NaN appears.
//
// Accumulator layout (wgmma m64nN, as in consumer_rows64.cuh, now read transposed): element i of a thread's
// 64 x kRows fragment is token (M) 16 * warp + lane / 4 + 8 * ((i >> 1) & 1) and query row (N)
// (i >> 2) * 8 + 2 * (lane % 4) + (i & 1). A thread therefore holds kRows / 4 distinct columns (4 at
// kRows 16), indexed here by c = (i >> 2) * 2 + (i & 1); O^T's fragment (MMA, 8 atoms along M, 1)
// uses the same column mapping for its MMA index, so one alpha per c rescales both.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>

#include "arch.cuh"
#include "config.cuh"
#include "layouts.cuh"
#include "mma.cuh"

namespace mla {

using namespace cute;

// Every slot of a stage is read by the four warps of the warpgroup that owns its current tile only.
constexpr int kStEmptyCount = 4;

// Column index c (0 .. kRows / 4 - 1) and query row n of accumulator element i.
__device__ __forceinline__ constexpr int st_col_index(int i) { return (i >> 2) * 2 + (i & 1); }
__device__ __forceinline__ int st_col(int i, int lane) { return (i >> 2) * 8 + 2 * (lane % 4) + (i & 1); }
__device__ __forceinline__ int st_col_of_index(int c, int lane) { return (c >> 1) * 8 + 2 * (lane % 4) + (c & 1); }

// Latent value held in O^T's row 16 warp + lane / 4 + 8 hi of atom m on the fp8 register path
// (consume_st_regs: a thread's 16 values over the 8 atoms are 16 contiguous latent values).
__device__ __forceinline__ int st_regs_dim(int warp, int lane, int m, int hi) {
  return 128 * warp + 16 * (lane / 4) + 2 * m + hi;
}

// Token order of P^T's k index on the fp8 register path (an involution inside every pair of tokens).
__device__ __forceinline__ constexpr int st_token(int k) { return k ^ ((k >> 1) & 1); }

template <int kRows>
struct StContext {
  static constexpr int kCols = kRows / 4;  // distinct query rows per thread
  int kv_begin;
  int num_tiles;           // kBlockN-token tiles in the split (> 0 in the loops; merge_st also sees 0)
  int key_limit[kCols];    // keys >= key_limit[c] are masked for column c (split end, causal); unused
                           // where Storage::key_limit holds them (kKeyLimitShared), to spare registers
  int unmasked_end;        // the least key limit of the warp's columns: a tile below it needs no mask
  float score_scale;       // softmax_scale * log2(e) (times the fp8 factors)
  int wg, tid_wg, warp, lane;
};

// One tile's softmax step on the transposed path, shared by consume_st and consume_st_regs: scale and
// mask S^T (tokens tok0, tok0 + 8 of the tile starting at key kv_begin + 64 t), the column max over
// the warpgroup, the running max / sum update, O^T rescaled when a max moved, and P = exp2(s - max)
// as 16-bit into P^T (element (n, token); kPermuteTokens stores token tok at k index st_token(tok),
// the order consume_st_regs reads V^T in). The caller fences and synchronizes before P^T is read.
// Whether each column's mask limit lives in shared memory (Storage::key_limit, written by the kernel)
// instead of StContext's registers: the fp8 register path with three warpgroups (152 registers) or
// with 32 rows (O^T takes 128).
template <class Storage>
constexpr bool kKeyLimitShared = Storage::kRegWiden && (Storage::kMathWgs == 3 || Storage::kRowsPerCta > 16);

template <bool kPermuteTokens, class Storage, class FragS, class FragO, int kRows>
__device__ __forceinline__ void st_softmax_to_pt(Storage& s, const StContext<kRows>& c, int t, int tok0, FragS& tSrS,
                                                 FragO& tOrO, float (&m_run)[kRows / 4], float (&l_run)[kRows / 4],
                                                 typename Storage::Element* pt) {
  constexpr int kCols = kRows / 4;
  using Element = typename Storage::Element;
  // ---- Scale, mask, column max over the thread's 2 tokens, the warp's 8 token pairs (lanes that
  // share lane % 4), then the warpgroup's 4 warps through shared memory.
  const int tile_start = c.kv_begin + t * kBlockN;
  const int wg = c.wg;
  float cmax[kCols];
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) cmax[j] = -INFINITY;
  if (tile_start <= c.unmasked_end - kBlockN) {  // warp-uniform; written so that no int overflows near INT_MAX
    CUTE_UNROLL
    for (int e = 0; e < size(tSrS); ++e) {
      const int j = st_col_index(e);
      tSrS(e) *= c.score_scale;
      cmax[j] = fmaxf(cmax[j], tSrS(e));
    }
  } else {
    CUTE_UNROLL
    for (int e = 0; e < size(tSrS); ++e) {
      const int key = tile_start + tok0 + 8 * ((e >> 1) & 1);
      const int j = st_col_index(e);
      int limit;
      if constexpr (kKeyLimitShared<Storage>) {
        limit = s.key_limit[4 * wg + c.warp][st_col(e, c.lane)];  // this warp's row, written by the kernel
      } else {
        limit = c.key_limit[j];
      }
      const float v = key < limit ? tSrS(e) * c.score_scale : -INFINITY;
      tSrS(e) = v;
      cmax[j] = fmaxf(cmax[j], v);
    }
  }
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) {
    cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffff, cmax[j], 4));
    cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffff, cmax[j], 8));
    cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffff, cmax[j], 16));
    if (c.lane < 4) s.col_stat[wg][c.warp][st_col_of_index(j, c.lane)] = cmax[j];
  }
  // The previous tile's readers of col_stat all passed that tile's P^T barrier before these stores.
  warpgroup_barrier(kBarStWg + wg);
  float alpha[kCols], m_sub[kCols];
  bool moved = false;
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) {
    const int n = st_col_of_index(j, c.lane);
    float m_new = m_run[j];
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, s.col_stat[wg][w][n]);
    m_sub[j] = m_new == -INFINITY ? 0.f : m_new;
    alpha[j] = exp2_ftz(m_run[j] - m_sub[j]);
    m_run[j] = m_new;
    moved |= alpha[j] != 1.f;
    l_run[j] *= alpha[j];
  }
  // O^T times alpha (no P V of this warpgroup is in flight); once the max settles most tiles skip it.
  if (__any_sync(0xffffffff, moved)) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOrO); ++m) {
      CUTE_UNROLL
      for (int e = 0; e < size<0>(tOrO); ++e) tOrO(e, m, 0) *= alpha[st_col_index(e)];
    }
  }
  // ---- P = exp2(s - m_sub) as 16-bit into P^T: element (n, token) of the kRows x 64 tile. The
  // previous tile's P V read P^T; every warp waited for it before the column-max barrier above.
  CUTE_UNROLL
  for (int e = 0; e < size(tSrS); ++e) {
    const int j = st_col_index(e);
    const float pe = exp2_ftz(tSrS(e) - m_sub[j]);
    l_run[j] += pe;
    const Element pv = Element(pe);
    const int tok = tok0 + 8 * ((e >> 1) & 1);
    *reinterpret_cast<Element*>(reinterpret_cast<char*>(pt) +
                                swizzled_offset(st_col(e, c.lane), kPermuteTokens ? st_token(tok) : tok, kRows)) = pv;
  }
}

// The warpgroup's loop over its tiles t = wg, wg + 2, ... (all in stage wg). On return O^T, m_run and
// the thread's partial l (over its own two token rows of each tile, not yet reduced) are this
// warpgroup's share of the split.
template <class Storage, class FragO, int kRows = Storage::kRowsPerCta>
__device__ __forceinline__ void consume_st(Storage& s, const StContext<kRows>& c, FragO& tOrO,
                                           float (&m_run)[kRows / 4], float (&l_run)[kRows / 4]) {
  constexpr int kCols = kRows / 4;
  using Element = typename Storage::Element;
  using L = KernelLayouts<Element>;
  using LS = StLayouts<Element, kRows>;
  typename LS::TiledMmaS mma_s;
  typename LS::TiledMmaO mma_o;
  mma_o.accumulate_ = GMMA::ScaleOut::One;  // O^T starts cleared and only ever accumulates
  auto thr_s = mma_s.get_thread_slice(c.tid_wg);
  auto thr_o = mma_o.get_thread_slice(c.tid_wg);
  const int wg = c.wg;
  if (wg >= c.num_tiles) return;  // a single tile: warpgroup 1 has nothing (warp-uniform)

  Element* stage = s.kv[wg];
  Element* pt = s.pt[wg];
  // S^T = K Q^T: note the operand order, A = the KV tile (tokens on M), B = Q (rows on N).
  Tensor tSrK = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(stage), typename L::SmemLayoutKV{}));
  Tensor tSrQ = thr_s.partition_fragment_B(make_tensor(make_smem_ptr(s.q), typename LS::SmemLayoutQ{}));
  // O^T += V^T P^T: A = V^T (512 x 64, MN-major view of the same stage), B = P^T (kRows x 64).
  Tensor tOrV = thr_o.partition_fragment_A(make_tensor(make_smem_ptr(stage), typename L::SmemLayoutVt{}));
  Tensor tOrP = thr_o.partition_fragment_B(make_tensor(make_smem_ptr(pt), typename LS::SmemLayoutPt{}));
  uint64_t* full = &s.kv_full[wg * kSubTiles];
  uint64_t* empty = &s.kv_empty[wg * kSubTiles];
  const int tok0 = 16 * c.warp + c.lane / 4;  // this thread's token rows: tok0 and tok0 + 8

  wait_barrier(&s.q_full, 0);
  int i = 0;
  for (int t = wg; t < c.num_tiles; t += kNumWarpgroups, ++i) {
    const int parity = i & 1;  // use i of stage wg
    // ---- S^T, each 64-column k-slice issued as soon as its slot has landed.
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kRows>>{});
    issue_s(mma_s, tSrK, tSrQ, tSrS, full, parity);  // mma.cuh; A = the KV tile, B = Q here
    warpgroup_wait<0>();
    fence_fragment(tSrS);
    release(empty + kSubTiles - 1, 1, c.lane);  // the RoPE slot is read by S^T only

    st_softmax_to_pt</*kPermuteTokens=*/false>(s, c, t, tok0, tSrS, tOrO, m_run, l_run, pt);
    fence_proxy_async_shared();  // P^T stores -> wgmma reads
    warpgroup_barrier(kBarStWg + wg);

    // ---- O^T += V^T P^T over the 64 tokens (4 k-steps), 8 atoms of 64 latent rows each.
    issue_pv(mma_o, tOrV, tOrP, tOrO);  // mma.cuh; A = V^T, B = P^T here
    warpgroup_wait<0>();
    fence_fragment(tOrO);
    release(empty, kSubTiles - 1, c.lane);  // the latent slots (K and V) are done
  }
}

// Whether merge_st writes O^T as float4 (the register path's row order: a thread's 16 values per query
// row are latent values 16 g' .. 16 g' + 15, g' = 8 warp + lane / 4). Float4 q of such a group is
// stored at position q ^ (g' & 1): a quarter warp (two g', four query rows 2 apart, stride 516 floats)
// then covers 8 distinct 16-byte bank groups; store_rows_st swaps the halves back.
template <class Storage>
constexpr bool kMergeV4 = Storage::kRegWiden;
// Whether merge_st leaves each row's output scale and lse in s.row_out for store_rows_st (not on the
// fp8 register path, whose three warpgroups have no registers to spare for it there: it spilled).
template <class Storage>
constexpr bool kRowOutInMerge = !Storage::kRegWiden;

// Final max and row sum of query row n once merge_st has published the
// statistics: m (-inf for a row that saw no key) and l.
template <class Storage>
__device__ __forceinline__ void st_row_stats(const Storage& s, int n, float& m, float& l) {
  m = s.wg_max[0][n];
  CUTE_UNROLL
  for (int w = 1; w < Storage::kMathWgs; ++w) m = fmaxf(m, s.wg_max[w][n]);
  const float m_sub = m == -INFINITY ? 0.f : m;
  l = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < Storage::kMathWgs; ++w) {
    const float lw = s.col_stat[w][0][n] + s.col_stat[w][1][n] + s.col_stat[w][2][n] + s.col_stat[w][3][n];
    l += lw * exp2_ftz(s.wg_max[w][n] - m_sub);
  }
}

// Query row n's output scale (v_scale / l; 0 for a row that saw no key) and lse (natural log; -inf for
// such a row), both NaN for a request with a bad seq_len.
template <class Storage>
__device__ __forceinline__ void st_row_out(const Storage& s, int n, float v_scale, bool bad_len, float& inv_sum,
                                           float& lse) {
  float m, l;
  st_row_stats(s, n, m, l);
  inv_sum = l > 0.f ? v_scale / l : 0.f;
  lse = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  if (bad_len) inv_sum = lse = __int_as_float(0x7fc00000);  // NaN
}

// A warpgroup's final statistics into slot w of s.col_stat / s.wg_max: per warp its row sums over the
// thread's token rows reduced across the warp (col_stat[w][warp][n]), and the running max (wg_max[w][n],
// the same in every warp). The loop's last col_stat reads happened before its last P^T barrier.
template <class Storage, int kRows>
__device__ __forceinline__ void st_publish_stats(Storage& s, const StContext<kRows>& c, const float (&m_run)[kRows / 4],
                                                 float (&l_run)[kRows / 4], int w) {
  CUTE_UNROLL
  for (int j = 0; j < kRows / 4; ++j) {
    l_run[j] += __shfl_xor_sync(0xffffffff, l_run[j], 4);
    l_run[j] += __shfl_xor_sync(0xffffffff, l_run[j], 8);
    l_run[j] += __shfl_xor_sync(0xffffffff, l_run[j], 16);
    if (c.lane < 4) {
      const int n = st_col_of_index(j, c.lane);
      s.col_stat[w][c.warp][n] = l_run[j];
      if (c.warp == 0) s.wg_max[w][n] = m_run[j];
    }
  }
}

// Merges the math warpgroups' partial softmaxes into s.o_x (row n at n * kOxStride, unnormalised, on
// the common max) and leaves per column n in s.wg_max / s.col_stat what st_row_stats needs. Called by
// all math threads, also when the split has no tile (then everything is 0 and -inf). Warpgroup 0
// writes o_x, the others that owned a tile add theirs in turn. A warpgroup that owned no tile (w >=
// num_tiles: warpgroup w owns tiles w, w + kMathWgs, ...) is skipped with the barrier before its pass
// (a CTA-uniform condition): its O^T is zero and its factor exp2(-inf) = 0, so the pass would only add
// zeros.
// On the fp8 register path (Storage::kRegWiden) O^T's rows are in consume_st_regs' order (latent
// value st_regs_dim), else in order.
template <class Storage, class FragO, int kRows = Storage::kRowsPerCta>
__device__ __forceinline__ void merge_st(Storage& s, const StContext<kRows>& c, const FragO& tOrO,
                                         const float (&m_run)[kRows / 4], float (&l_run)[kRows / 4], float v_scale,
                                         bool bad_len) {
  constexpr int kCols = kRows / 4;
  const int wg = c.wg;
  // Ordering (racecheck reports some of these as hazards when warpgroups crossed their own barriers a
  // different number of times, which it does not model: lab/racecheck_named_barriers.cu modes 15, 18;
  // docs/performance.md, "racecheck"): every
  // hand-over of col_stat / wg_max / o_x / row_out between warpgroups crosses a bar.sync kBarStMerge
  // over all math threads: the statistics before the factors, each warpgroup's O^T pass before the
  // next one's, row_out and the last pass before the store (the barrier at the end here, or the
  // epilogue's). The passes skipped for warpgroups without a tile skip their barrier in every thread
  // (num_tiles is the same for the whole CTA).
  st_publish_stats(s, c, m_run, l_run, wg);
  math_barrier<128 * Storage::kMathWgs>(kBarStMerge);
  float f[kCols];  // this warpgroup's factor per column
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) {
    const int n = st_col_of_index(j, c.lane);
    float m = s.wg_max[0][n];
    CUTE_UNROLL
    for (int w = 1; w < Storage::kMathWgs; ++w) m = fmaxf(m, s.wg_max[w][n]);
    f[j] = exp2_ftz(m_run[j] - (m == -INFINITY ? 0.f : m));
  }
  // Element (MMA e, atom m) of O^T is latent row d = 64 m + 16 warp + lane / 4 + 8 ((e >> 1) & 1)
  // (register path: st_regs_dim), query row n = st_col(e).
  auto o_x = [&](int e, int m) -> float& {
    const int hi = (e >> 1) & 1;
    const int d = Storage::kRegWiden ? st_regs_dim(c.warp, c.lane, m, hi) : 64 * m + 16 * c.warp + c.lane / 4 + 8 * hi;
    return s.o_x[st_col(e, c.lane) * kOxStride + d];
  };
  if constexpr (kMergeV4<Storage>) {
    // Values 4q .. 4q+3 of column j's 16 are (atom 2q, row g), (2q, g + 8), (2q + 1, g), (2q + 1, g + 8).
    const int g = 8 * c.warp + c.lane / 4;
    auto merge_v4 = [&](bool add) {
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const int e0 = (j >> 1) * 4 + (j & 1), e1 = e0 + 2;  // rows g and g + 8 of column j
        float4* row = reinterpret_cast<float4*>(&s.o_x[st_col_of_index(j, c.lane) * kOxStride + 16 * g]);
        CUTE_UNROLL
        for (int q = 0; q < 4; ++q) {
          float4 v = make_float4(tOrO(e0, 2 * q, 0) * f[j], tOrO(e1, 2 * q, 0) * f[j], tOrO(e0, 2 * q + 1, 0) * f[j],
                                 tOrO(e1, 2 * q + 1, 0) * f[j]);
          float4* dst = row + (q ^ (g & 1));
          if (add) {
            const float4 o = *dst;
            v = make_float4(o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w);
          }
          *dst = v;
        }
      }
    };
    if (wg == 0) merge_v4(false);
    CUTE_UNROLL
    for (int w = 1; w < Storage::kMathWgs; ++w) {
      if (w >= c.num_tiles) break;  // CTA-uniform: warpgroups w.. had no tile (below)
      math_barrier<128 * Storage::kMathWgs>(kBarStMerge);
      if (wg == w) merge_v4(true);
    }
  } else {
    if (wg == 0) {
      CUTE_UNROLL
      for (int m = 0; m < size<1>(tOrO); ++m) {
        CUTE_UNROLL
        for (int e = 0; e < size<0>(tOrO); ++e) o_x(e, m) = tOrO(e, m, 0) * f[st_col_index(e)];
      }
    }
    CUTE_UNROLL
    for (int w = 1; w < Storage::kMathWgs; ++w) {
      if (w >= c.num_tiles) break;  // CTA-uniform: warpgroups w.. had no tile (below)
      math_barrier<128 * Storage::kMathWgs>(kBarStMerge);
      if (wg == w) {
        CUTE_UNROLL
        for (int m = 0; m < size<1>(tOrO); ++m) {
          CUTE_UNROLL
          for (int e = 0; e < size<0>(tOrO); ++e) o_x(e, m) += tOrO(e, m, 0) * f[st_col_index(e)];
        }
      }
    }
  }
  if constexpr (kRowOutInMerge<Storage>) {
    // Warpgroup 0 is idle while the others add their O^T (or done, when it owned the only tile): it
    // writes each row's scale and lse.
    if (wg == 0 && c.tid_wg < kRows) {
      st_row_out(s, c.tid_wg, v_scale, bad_len, s.row_out[0][c.tid_wg], s.row_out[1][c.tid_wg]);
    }
  }
  math_barrier<128 * Storage::kMathWgs>(kBarStMerge);
}

}  // namespace mla
