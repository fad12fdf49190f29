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
#include "primitives.cuh"
#include "producer.cuh"

namespace mla {

using namespace cute;

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
