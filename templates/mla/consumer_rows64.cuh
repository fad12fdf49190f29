// The 64-row path's math warpgroups (see kernel.cuh for the whole CTA): S = Q K^T, the online
// softmax, and O += P V over the KV tiles the producer lands in shared memory, "seesaw" ownership:
// tile t lives in stage t % 2 (the short-split fp8 kernel: 32-token tiles, stage t % 4) and its S and
// softmax belong to math warpgroup t % 2 alone (S = 64 x 64, N = 64: each wgmma reads 2 KiB of Q and
// 2 KiB of K, as fast as the tensor core consumes them). Both
// warpgroups then multiply the tile's P with their own half of V (warpgroup w owns O[:, 256w ..
// 256w + 255]). The running row max is handed from one warpgroup to the other through shared memory,
// tile after tile, so both rescale O and the row sums by the same factors in the same order and the
// result is exactly the sequential online softmax. While one warpgroup runs its softmax on the CUDA
// cores, the other's wgmma keeps the tensor cores busy.
//
// Math (FlashAttention-2 online softmax, Dao 2023): per row i, m_i = max_j s_ij, p_ij = exp2(s_ij -
// m_i) in the log2 domain, l_i = sum_j p_ij, o_i = sum_j p_ij v_j; when m_i moves from m to m', O and
// l are multiplied by exp2(m - m'). Masked scores are -inf, and a row whose max is still -inf
// subtracts 0 instead, so no -inf - (-inf) = NaN can appear.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>

#include "arch.cuh"
#include "config.cuh"
#include "epilogue.cuh"
#include "layouts.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "row_softmax.cuh"

namespace mla {

using namespace cute;

// What a math thread needs to know about its CTA's keys and rows.
struct MathContext {
  int kv_begin;         // first key of the split
  int num_tiles;        // tiles in the split (> 0): kBlockN tokens, the 64-row storage's kTileN on that path
  int key_limit[2];     // keys >= key_limit[r] are masked for row row0 + 8r (split end, causal)
  int unmasked_end;     // the least key_limit of the warp's rows: a tile below it needs no mask
  float score_scale;    // softmax_scale * log2(e) (times the fp8 factors)
  int wg, tid_wg, lane;
  int row0;             // this thread's accumulator rows: row0 and row0 + 8
  // Barrier parities of a scheduled CTA's segment (kernel.cuh consume_scheduled; 0 otherwise): bit s
  // the parity of stage s's first use in this segment, bit 2 that of Q's (two stages: scheduled
  // kernels are 16-bit, kernel.cuh rows_64 asserts it).
  int phases;
};

// ---------------------------------------------------------------------------------------------
// Softmax pieces on a 64 x N fp32 accumulator fragment (row_softmax.cuh has the layout).

// scale_mask_rowmax (row_softmax.cuh) on the S fragment, with the context's scale and limits.
template <class Frag>
__device__ __forceinline__ void scale_mask_rowmax(Frag& S, const MathContext& c, int tile_start, float (&tile_max)[2]) {
  scale_mask_rowmax<decltype(size(S))::value>([&](int i) -> float& { return S(i); }, [&](int) { return c.score_scale; },
                                       tile_start, c.unmasked_end, c.key_limit, c.lane, tile_max);
}

// O times alpha, only when some row of the warp moved (once the max settles, most tiles skip it).
// The caller guarantees that no wgmma writing O is in flight.
template <class FragO>
__device__ __forceinline__ void rescale_o(FragO& O, const float (&alpha)[2]) {
  if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
    CUTE_UNROLL
    for (int i = 0; i < size(O); ++i) O(i) *= alpha[(i >> 1) & 1];
  }
}
// l and O times alpha.
template <class FragO>
__device__ __forceinline__ void rescale(FragO& O, float (&l)[2], const float (&alpha)[2]) {
  l[0] *= alpha[0];
  l[1] *= alpha[1];
  rescale_o(O, alpha);
}

// P = exp2(S - m_sub) into the 64 x 64 swizzled P tile at p (columns col_base + fragment column),
// row sums into l.
template <int kTileN = kBlockN, class Element, class Frag>
__device__ __forceinline__ void exp_store_p(const Frag& S, const MathContext& c, const float (&m_sub)[2], float (&l)[2],
                                            Element* p, int col_base) {
  CUTE_UNROLL
  for (int i = 0; i < size(S); i += 2) {
    const int r = (i >> 1) & 1;
    const float p0 = exp2_ftz(S(i) - m_sub[r]);
    const float p1 = exp2_ftz(S(i + 1) - m_sub[r]);
    l[r] += p0 + p1;
    const int col = col_base + (i >> 2) * 8 + 2 * (c.lane % 4);
    *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(p) + p_offset<kTileN>(c.row0 + 8 * r, col)) =
        pack2<Element>(p0, p1);
  }
}

// ---------------------------------------------------------------------------------------------
// Two-stage "seesaw" consumer. The hand-over between the two math warpgroups runs on named barriers
// (arch.cuh: kBarMaxA, kBarPA, kBarMaxPB, kBarOwnP + wg; one side arrives, the other waits).
// Empty-barrier arrivals a slot of a stage needs, one per math warp that reads it: stage w's tiles
// are read for S by warpgroup w (all 9 slots) and for P V by warpgroup v (latent slots 4v .. 4v+3);
// the RoPE slot holds P, which both read.
__host__ __device__ constexpr int two_stage_empty_count(int stage, int slot) {
  return slot == kSubTiles - 1 ? 8 : (slot / 4 == stage % 2 ? 4 : 8);  // stage s: warpgroup s % 2's tiles
}

// kSFirst: warpgroup 1 queues S(b) before P V(a), so the tensor cores have work while warpgroup 0
// runs the softmax of tile a; tile a's slots are then released only after S(b) has its data.
// kSFirst = false releases tile a right after P V(a) and issues S(b) after it, which gives the fp8
// producer's copy and widen warps more slack to refill tile a + 2. Both orders are deadlock-free with
// the fp8 producer's separate copy and widen warps (a single producer thread group that copied t + 1
// before widening t would deadlock with kSFirst). The 16-bit kernels and the fp8 short-split kernel
// run S first, the fp8 64-token kernel P V first (docs/design.md).
template <bool kSFirst, class Cache, bool kShort, class FragO>
__device__ __forceinline__ void consume_two_stage(SharedStorage<Cache, kShort>& s, const MathContext& c, FragO& tOrO,
                                                  float (&m_run)[2], float (&l_run)[2]) {
  using Element = typename CacheTypes<Cache>::Mma;
  constexpr int kTileN = SharedStorage<Cache, kShort>::kTileN;  // tile t: stage t % kRing, warpgroup t % 2
  constexpr int kRing = SharedStorage<Cache, kShort>::kRing;
  static_assert(kRing % 2 == 0, "tiles 2i and 2i + 1 in stages sa and sa + 1");
  using L = KernelLayouts<Element, kTileN>;
  typename L::TiledMmaS mma_s;
  typename L::TiledMmaO mma_o;
  mma_o.accumulate_ = GMMA::ScaleOut::One;  // O starts cleared and only ever accumulates
  auto thr_s = mma_s.get_thread_slice(c.tid_wg);
  auto thr_o = mma_o.get_thread_slice(c.tid_wg);
  const int wg = c.wg;

  // Operands of both stages: K, P (in the stage's RoPE slot) and this warpgroup's half of V.
  Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(s.q), typename L::SmemLayoutQ{}));
  auto k_frag = [&](int st) {
    return thr_s.partition_fragment_B(make_tensor(make_smem_ptr(s.kv[st]), typename L::SmemLayoutKV{}));
  };
  auto p_frag = [&](int st) {
    return thr_o.partition_fragment_A(make_tensor(make_smem_ptr(stage_p<kTileN>(s.kv[st])), typename L::SmemLayoutP{}));
  };
  auto v_frag = [&](int st) {
    Tensor sVt = make_tensor(make_smem_ptr(s.kv[st]), typename L::SmemLayoutVt{});
    return thr_o.partition_fragment_B(
        local_tile(sVt, Shape<Int<kHeadDimV / kNumWarpgroups>, Int<kTileN>>{}, make_coord(wg, 0)));
  };
  float alpha[2], m_sub[2], m_new[2];
  wait_barrier(&s.q_full, (c.phases >> 2) & 1);
  // Ordering of the shared hand-overs below. racecheck reports some as hazards: it does not model an
  // arrive/sync loop, unequal crossings of the per-warpgroup barriers before a common one, or stores
  // handed to a cp.async through an mbarrier (lab/racecheck_named_barriers.cu modes 12, 18 and 20
  // report the same on ordered code; docs/performance.md, "racecheck"):
  // - row_max[0]: written by warpgroup 0, bar.arrive kBarMaxA; read by warpgroup 1 after bar.sync
  //   kBarMaxA. Warpgroup 0 writes it again only after bar.sync kBarMaxPB, which warpgroup 1 arrives at
  //   after its read. row_max[1] is the mirror image (kBarMaxPB, then kBarMaxA of the next pair).
  // - P in a stage's RoPE slot: written over K's RoPE columns after the warp's wait on its own S wgmma,
  //   which covers the warpgroup's whole wgmma group (its shared-memory reads included). Then every
  //   thread's stores, bar.sync kBarOwnP + wg over its warpgroup (and bar.arrive kBarPA from warpgroup
  //   0, kBarMaxPB from warpgroup 1, which the other syncs on before its P V over the same P), then
  //   lane 0's mbarrier arrive on the slot's empty barrier (release), then the producer's wait on it
  //   (acquire) before its next copy into the slot.

  for (int i = 0; i < (c.num_tiles + 1) / 2; ++i) {
    const int sa = (2 * i) % kRing, sb = sa + 1;   // the stages of tiles a = 2i and b = 2i + 1
    const int use = i / (kRing / 2);               // their use in this piece of work
    const int parity0 = (use ^ (c.phases >> sa)) & 1;
    const int parity1 = (use ^ (c.phases >> sb)) & 1;
    const bool has_b = 2 * i + 1 < c.num_tiles;    // tile b exists
    uint64_t* empty0 = &s.kv_empty[sa * kSubTiles];
    uint64_t* empty1 = &s.kv_empty[sb * kSubTiles];
    if (wg == 0) {
      // ---- tile a = 2i, stage sa: S, softmax, P into the RoPE slot, O_left += P V.
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kTileN>>{});
      issue_s(mma_s, tSrQ, k_frag(sa), tSrS, &s.kv_full[sa * kSubTiles], parity0);
      warpgroup_wait<0>();
      fence_fragment(tSrS);
      release(empty0 + 4, 4, c.lane);  // the right half of V is warpgroup 1's to release
      float tile_max[2];
      scale_mask_rowmax(tSrS, c, c.kv_begin + 2 * i * kTileN, tile_max);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        m_new[r] = fmaxf(m_run[r], tile_max[r]);
        if (c.lane % 4 == 0) s.row_max[0][c.row0 + 8 * r] = m_new[r];
      }
      math_barrier_arrive(kBarMaxA);
      advance_max(m_run, m_new, alpha, m_sub);
      rescale(tOrO, l_run, alpha);  // nothing of this warpgroup is in flight
      exp_store_p<kTileN>(tSrS, c, m_sub, l_run, stage_p<kTileN>(s.kv[sa]), 0);
      fence_proxy_async_shared();  // P stores -> wgmma reads
      math_barrier_arrive(kBarPA);
      warpgroup_barrier(kBarOwnP + wg);
      issue_pv(mma_o, p_frag(sa), v_frag(sa), tOrO);
      warpgroup_wait<0>();
      fence_fragment(tOrO);
      release(empty0, 4, c.lane);
      release(empty0 + kSubTiles - 1, 1, c.lane);
      if (has_b) {
        // ---- tile b: warpgroup 1's P; O_left += P V once O is on warpgroup 1's new max.
        math_barrier(kBarMaxPB);
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) m_new[r] = s.row_max[1][c.row0 + 8 * r];
        advance_max(m_run, m_new, alpha, m_sub);
        rescale(tOrO, l_run, alpha);
        issue_pv(mma_o, p_frag(sb), v_frag(sb), tOrO);
        warpgroup_wait<0>();
        fence_fragment(tOrO);
        release(empty1, 4, c.lane);
        release(empty1 + kSubTiles - 1, 1, c.lane);
      }
    } else {
      // ---- tile b = 2i + 1 (stage sb) is this warpgroup's; with kSFirst its S goes first.
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kTileN>>{});
      if (kSFirst && has_b) issue_s(mma_s, tSrQ, k_frag(sb), tSrS, &s.kv_full[sb * kSubTiles], parity1);
      // ---- tile a (warpgroup 0's): follow its max, O_right += P V.
      math_barrier(kBarMaxA);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) m_new[r] = s.row_max[0][c.row0 + 8 * r];
      advance_max(m_run, m_new, alpha, m_sub);
      rescale(tOrO, l_run, alpha);  // no P V of this warpgroup is in flight
      math_barrier(kBarPA);
      issue_pv(mma_o, p_frag(sa), v_frag(sa), tOrO);
      if (!kSFirst) {  // release tile a before anything waits for tile b
        warpgroup_wait<0>();
        fence_fragment(tOrO);
        release(empty0 + 4, 4, c.lane);
        release(empty0 + kSubTiles - 1, 1, c.lane);
        if (has_b) issue_s(mma_s, tSrQ, k_frag(sb), tSrS, &s.kv_full[sb * kSubTiles], parity1);
      }
      if (has_b) {
        // ---- tile b: softmax, P, O_right += P V. Queue: S(b), then P V(a) with kSFirst.
        if (kSFirst) {
          warpgroup_wait<1>();
        } else {
          warpgroup_wait<0>();
        }
        fence_fragment(tSrS);
        release(empty1, 4, c.lane);  // the left half of V is warpgroup 0's to release
        float tile_max[2];
        scale_mask_rowmax(tSrS, c, c.kv_begin + (2 * i + 1) * kTileN, tile_max);
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          m_new[r] = fmaxf(m_run[r], tile_max[r]);
          if (c.lane % 4 == 0) s.row_max[1][c.row0 + 8 * r] = m_new[r];
        }
        advance_max(m_run, m_new, alpha, m_sub);
        l_run[0] *= alpha[0];
        l_run[1] *= alpha[1];
        exp_store_p<kTileN>(tSrS, c, m_sub, l_run, stage_p<kTileN>(s.kv[sb]), 0);
        fence_proxy_async_shared();
        math_barrier_arrive(kBarMaxPB);
        if (kSFirst) {
          warpgroup_wait<0>();  // P V(a) is done: release its slots, then O may be rescaled
          fence_fragment(tOrO);
          release(empty0 + 4, 4, c.lane);
          release(empty0 + kSubTiles - 1, 1, c.lane);
        }
        rescale_o(tOrO, alpha);
        warpgroup_barrier(kBarOwnP + wg);
        issue_pv(mma_o, p_frag(sb), v_frag(sb), tOrO);
        warpgroup_wait<0>();
        fence_fragment(tOrO);
        release(empty1 + 4, 4, c.lane);
        release(empty1 + kSubTiles - 1, 1, c.lane);
      } else if (kSFirst) {
        warpgroup_wait<0>();
        fence_fragment(tOrO);
        release(empty0 + 4, 4, c.lane);
        release(empty0 + kSubTiles - 1, 1, c.lane);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The 64-row path's math warpgroups for one piece of work w (a CTA of the uniform split, or one
// segment of a scheduled CTA): S, softmax and O over w's tiles (consume_two_stage), then the epilogue, to
// out/lse (piece_row -1) or to the workspace piece starting at row piece_row. phases: the ring stages'
// and Q's barrier parities (MathContext); buf: which row_sum buffer the epilogue uses (segments
// alternate, so a warpgroup that runs ahead into the next segment never overwrites sums the other is
// still reading). kTrace: stamp the CTA's phase trace (trace.cuh; uniform launches of an MLA_TRACE build).
// kShort: the short-split fp8 kernel's storage (32-token tiles, four stages) and its S-first order.
template <class Cache, int NUM_HEADS, bool kStaged, bool kTrace = false, bool kShort = false>
__device__ __forceinline__ void rows_64(const DecodeParams& p, SharedStorage<Cache, kShort>& s, const CtaWork& w,
                                        int64_t piece_row, float score_scale, float v_scale, int phases, int buf) {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  using L = KernelLayouts<Element>;
  static_assert(SharedStorage<Cache, kShort>::kRing == 2 || !kSchedulable<Cache, NUM_HEADS>,
                "MathContext::phases holds the parities of two stages (and Q's in bit 2)");
  const MlaDecodeArgs& a = p.a;
  const int tid = threadIdx.x - kProducerThreads;
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const int tid_wg = tid % 128;
  const int lane = tid % 32;
  const int row0 = (tid_wg / 32) * 16 + lane / 4;  // this thread's rows: row0 and row0 + 8
  // Causal, bottom-right aligned: query qi sees keys < seq_len - (q_len - 1 - qi).
  int key_limit[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int qi = (w.m_block * kBlockM + row0 + 8 * r) / NUM_HEADS;
    key_limit[r] = min(w.kv_end, w.seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
  }

  Tensor tOrO = partition_fragment_C(typename L::TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDimV / kNumWarpgroups>>{});
  clear(tOrO);
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  if (w.num_tiles > 0) {
    const int num_tiles = tiles_of_n<SharedStorage<Cache, kShort>::kTileN>(w.kv_end - w.kv_begin, w.num_tiles);
    const int unmasked_end = __reduce_min_sync(0xffffffff, min(key_limit[0], key_limit[1]));
    const MathContext ctx{w.kv_begin, num_tiles, {key_limit[0], key_limit[1]}, unmasked_end, score_scale, wg, tid_wg,
                          lane, row0, phases};
    consume_two_stage</*kSFirst=*/!Types::kFp8 || kShort>(s, ctx, tOrO, m_run, l_run);
    if constexpr (kSchedulable<Cache, NUM_HEADS>) {
      if (lane == 0) arrive_barrier(&s.q_empty);  // this warp's S wgmmas are done with Q
    }
  }
  if constexpr (kTrace) {
    trace_at(p, kProducerThreads).stamp(kTraceLoopDone);
    trace_at(p, kProducerThreads + 128 * (kNumWarpgroups - 1)).stamp(kTraceLoopDoneLast);
  }

  // Both warpgroups end on the same row max; their row sums (over their own columns of P) add up.
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 2);
    if (lane % 4 == 0) s.row_sum[buf][wg][row0 + 8 * r] = l_run[r];
  }
  // row_sum[buf]: written above, read below after bar.sync kBarEnd over both warpgroups; written again
  // two pieces later, past the next piece's kBarEnd, which both cross after these reads.
  math_barrier(kBarEnd);
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceMerged);
  float inv_sum[2], lse[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const float l = s.row_sum[buf][0][row0 + 8 * r] + s.row_sum[buf][1][row0 + 8 * r];
    // A row that saw no key (empty request, empty split, or q_len > seq_len): out 0, lse -inf.
    inv_sum[r] = l > 0.f ? v_scale / l : 0.f;
    lse[r] = l > 0.f ? (m_run[r] + log2f(l)) * kLn2 : -INFINITY;
    if (w.bad_len) inv_sum[r] = lse[r] = __int_as_float(0x7fc00000);  // NaN
  }
  if constexpr (kStaged) {
    // A non-split kernel (piece_row is -1). Past kBarEnd no math warp reads the ring, and a uniform
    // launch's producer has no tile left.
    static_assert(sizeof(s.kv[0]) >= kBlockM * (kHeadDimV / kNumWarpgroups) * sizeof(typename Types::Out),
                  "a stage holds a warpgroup's block of O");
    store_rows_staged<typename Types::Out, NUM_HEADS>(p, reinterpret_cast<char*>(s.kv[wg]), w.b, w.m_block, wg, tid_wg,
                                                      row0, tOrO, inv_sum, lse);
  } else {
    // Split kernels store their pieces (or, run with one split, out) straight from the accumulators.
    store_rows<typename Types::Out, NUM_HEADS>(p, w.b, piece_row, w.m_block, wg, row0, tOrO, inv_sum, lse);
  }
  if constexpr (kTrace) trace_at(p, kProducerThreads).stamp(kTraceStored);
}

}  // namespace mla
