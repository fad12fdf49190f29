// The MLA decode kernel: one CTA computes attention for one block of query rows (q_len x num_heads)
// of one request over one split of its keys (or, scheduled, over the run of (request, tile) pairs the
// balanced schedule gives it).
//
// Math (FlashAttention-2 online softmax, Dao 2023, with the MLA latent cache of DeepSeek-V2,
// arXiv:2405.04434): for query row i, s_ij = softmax_scale * <q_i, k_j> over the 576 values,
// p_ij = exp(s_ij - m_i), o_i = sum_j p_ij v_j / sum_j p_ij, lse_i = m_i + log(sum_j p_ij).
// Scores live in the exp2 domain (scale folded with log2 e); masked scores are -inf and a row whose
// max is still -inf subtracts 0, so no inf - inf can appear; KV rows past the split are zero in shared
// memory, so a NaN in an unused cache slot never meets a zero probability.
//
// A CTA is warp-specialized: one producer warpgroup and two (fp8 transposed path at <= 16 rows: three)
// math warpgroups. Which code each role runs:
//   path (config.cuh)        producer                       math warpgroups           epilogue (epilogue.cuh)
//   64-row, 16-bit           produce (producer.cuh)         rows_64 / consume_two_stage (consumer_rows64.cuh)
//                                                                                     store_rows, store_rows_staged
//   64-row, fp8              produce_fp8 (producer_fp8.cuh) the same, widened slots   store_rows
//   transposed, 16-bit       produce                        consume_st (consumer_st.cuh), merge_st   store_rows_st
//   transposed, fp8          produce_fp8_ring               consume_st_regs (consumer_st_fp8.cuh), merge_st
//   balanced schedule        produce_scheduled / consume_scheduled (scheduled.cuh) on the 64-row 16-bit path;
//                            the transposed path runs one segment per CTA (sched_st_work) through its own code
// Shared memory per path: layouts.cuh; named barriers: arch.cuh; the launch: launch.cuh.
// Rows are ordered qi * NUM_HEADS + h; rows with h >= num_heads or qi >= q_len are padding (Q zero,
// never stored).
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the library does not link libcuda)
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "abi.h"
#include "arch.cuh"
#include "config.cuh"
#include "consumer_rows64.cuh"
#include "consumer_st.cuh"
#include "consumer_st_fp8.cuh"
#include "epilogue.cuh"
#include "layouts.cuh"
#include "params.cuh"
#include "producer.cuh"
#include "producer_fp8.cuh"
#include "scheduled.cuh"
#include "trace.cuh"

namespace mla {

using namespace cute;

// The tensor map a producer loads full tiles with (kTmaPages kernels whose host encoded one; not the
// fp8 short-split kernel), or null: every tile by cp.async.
template <class Cache, int PAGE_SIZE, int ROWS, bool SHORT>
__device__ __forceinline__ const void* kv_map_of(const DecodeParams& p) {
  if constexpr (kTmaPages<Cache, PAGE_SIZE, ROWS> && !SHORT) {
    if (p.use_tma) return &p.kv_map;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: x = m_block + num_m_blocks * request, y = split (balanced schedule: x = m_block +
// num_m_blocks * c, y = 1).

// SCHED: the balanced-schedule instantiation (launched only with a.schedule set; kSchedulable split
// variants): a separate kernel rather than a branch, so uniform calls pay nothing for it.
// SHORT: the short-split instantiation of fp8 split variants on the 64-row path (32-token tiles in
// four stages; a variant's second kernel, config.cuh SecondKernel::kShortSplit).
// ROWS: query rows per CTA, which picks the path: kBlockM the 64-row one, 8 / 16 / 32 the transposed
// one. The variant's own kernel takes kRowBlock, and transposed variants also have kernels of larger
// row blocks up to kStMaxRows for q_len > 1 (config.cuh rows_for); the 16-bit ones also a 64-row kernel
// (their second kernel, SecondKernel::kRows64) for more rows per request.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT, bool SCHED = false, bool SHORT = false,
          int ROWS = kRowBlock<NUM_HEADS, CacheTypes<Cache>::kFp8>>
__global__ void __launch_bounds__(KernelStorage<Cache, ROWS>::kThreads, 1)
    mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Types = CacheTypes<Cache>;
  using Element = typename Types::Mma;
  using L = KernelLayouts<Element>;
  using Storage = KernelStorage<Cache, ROWS, SHORT>;
  constexpr bool kSt = ROWS != kBlockM;
  static_assert(!SHORT || (Types::kFp8 && !kSt && SPLIT && !SCHED), "short tiles: fp8 split variants, 64-row path");
  static_assert(!kSt || (ROWS >= kRowBlock<NUM_HEADS, Types::kFp8> && ROWS <= kStMaxRows),
                "the transposed path: the variant's own row block or a larger one for q_len > 1");
  extern __shared__ char smem_raw[];
  // Aligned by pointer arithmetic on smem_raw (not through an integer), so the compiler still knows
  // every access below is to shared memory (LDS/STS rather than generic LD/ST).
  char* smem_aligned = smem_raw + ((1024 - (reinterpret_cast<uintptr_t>(smem_raw) & 1023)) & 1023);
  Storage& s = *reinterpret_cast<Storage*>(smem_aligned);

  const MlaDecodeArgs& a = p.a;
  // The scheduled instantiation walks the schedule's segments instead of one (request, split) per CTA.
  static_assert(!SCHED || (SPLIT && (kSt || kSchedulable<Cache, NUM_HEADS>)),
                "the scheduled kernel: split variants of the 64-row 16-bit path or of the transposed path");
  // A transposed scheduled CTA runs one segment of the schedule's table, or nothing past its end.
  if constexpr (SCHED && kSt) {
    if (!sched_st_has_segment(p)) return;
  }
  // The producer threads issue their Q copies first in the 16-bit kernels that know their request at
  // entry (the uniform ones, and the transposed scheduled one from its segment's table entry), before
  // the seq_lens load and the barrier set-up (Q's address does not depend on seq_len), and a math
  // thread initialises the barriers. The fp8 producers (produce_fp8, produce_fp8_ring) issue Q
  // themselves; a 64-row scheduled CTA learns each segment's request on its walk.
  constexpr bool kQFirst = (!SCHED || kSt) && !Types::kFp8;
  if constexpr (kQFirst) {
    if (threadIdx.x < kProducerThreads) {
      int b, m_block;
      if constexpr (SCHED) {
        b = sched_st_request(p, m_block);
      } else {
        int split;
        cta_coords(p, b, m_block, split);
      }
      load_q_block<typename Storage::Element, NUM_HEADS, Storage::kRowsPerCta>(s.q, a, b, m_block, threadIdx.x);
    }
  }
  // In an MLA_TRACE build (trace.cuh) producer thread 0 and the first math thread stamp the CTA's phases.
  trace_at(p, kProducerThreads).stamp(kTraceEntry);
  // The CTA's request, query-row block and keys (the producer's copy; the math warpgroups compute
  // their own after setmaxnreg, so that nothing computed here stays live into their region).
  const CtaWork w0 = one_range_work<NUM_HEADS, PAGE_SIZE, ROWS, SCHED>(p);

  if (threadIdx.x == (kQFirst ? kProducerThreads : 0)) {
    cutlass::arch::ClusterBarrier::init(&s.q_full, kProducerThreads);
    if constexpr (kSchedulable<Cache, NUM_HEADS>) cutlass::arch::ClusterBarrier::init(&s.q_empty, 4 * kNumWarpgroups);
    CUTE_UNROLL
    for (int i = 0; i < Storage::kRing * kSubTiles; ++i) {
      // bf16/fp16 and the fp8 register path: every producer thread's copies (a TMA slot: thread 0's
      // arrive.expect_tx plus its arrival for the other 127); fp8 widened in shared memory: the
      // widening threads' stores.
      cutlass::arch::ClusterBarrier::init(&s.kv_full[i],
                                          Types::kFp8 && !Storage::kRegWiden ? kFp8WidenThreads : kProducerThreads);
      // One arrival per math warp that reads the slot (see consume_two_stage; consume_st: the owning
      // warpgroup's four warps).
      cutlass::arch::ClusterBarrier::init(&s.kv_empty[i],
                                          kSt ? kStEmptyCount : two_stage_empty_count(i / kSubTiles, i % kSubTiles));
      if constexpr (Types::kFp8 && !Storage::kRegWiden) cutlass::arch::ClusterBarrier::init(&s.raw_full[i], kFp8CopyThreads);
    }
    cutlass::arch::fence_barrier_init();
    fence_proxy_async_shared();  // the initialized barriers, as TMA's complete_tx (async proxy) sees them
  }
  __syncthreads();

  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Storage::kProducerRegsUsed>();
    if constexpr (SCHED && !kSt) {
      produce_scheduled<Cache, NUM_HEADS, PAGE_SIZE>(p, s, kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      return;
    }
    const int b = w0.b, m_block = w0.m_block, kv_begin = w0.kv_begin, kv_end = w0.kv_end, num_tiles = w0.num_tiles;
    if (num_tiles > 0) {
      trace_at(p, 0).stamp(kTraceProducerStart);
      if constexpr (Storage::kRegWiden) {
        produce_fp8_ring<NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x);
      } else if constexpr (Types::kFp8) {
        produce_fp8<NUM_HEADS, PAGE_SIZE>(s, a, b, m_block, kv_begin, kv_end,
                                          tiles_of_n<Storage::kTileN>(kv_end - kv_begin, num_tiles), threadIdx.x,
                                          kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      } else {
        produce<Cache, NUM_HEADS, PAGE_SIZE, kQFirst>(s, a, b, m_block, kv_begin, kv_end, num_tiles, threadIdx.x,
                                                      kv_map_of<Cache, PAGE_SIZE, ROWS, SHORT>(p));
      }
      trace_at(p, 0).stamp(kTraceProducerDone);  // past its cp.async.wait_all (TMA tiles: issued)
    } else if constexpr (kQFirst) {
      // No tiles (empty split or bad seq_len): Q goes unused.
      cp_async_wait_all();  // do not retire with copies in flight
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Storage::kMathRegsUsed>();
  if constexpr (SCHED && !kSt) {
    consume_scheduled<Cache, NUM_HEADS, PAGE_SIZE, SPLIT>(p, s);
    return;
  }
  // hides behind the wait for Q
  const CtaWork w = one_range_work<NUM_HEADS, PAGE_SIZE, ROWS, SCHED>(p);
  const int b = w.b, m_block = w.m_block, split = w.split, seq_len = w.seq_len, kv_begin = w.kv_begin, kv_end = w.kv_end,
            num_tiles = w.num_tiles;
  const bool bad_len = w.bad_len;
  if constexpr (MLA_TRACE != 0) {
    const TraceSink tr = trace_at(p, kProducerThreads);
    tr.info(num_tiles);
    if (num_tiles > 0 && tr.p != nullptr) {  // Q's arrival, seen by the first math thread alone
      wait_barrier(&s.q_full, 0);
      tr.stamp(kTraceQLanded);
    }
  }

  const int tid = threadIdx.x - kProducerThreads;
  // Broadcast from lane 0 so the compiler sees a warp-uniform value: wgmma inside branches on wg
  // would otherwise be serialized (ptxas C7520).
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const int tid_wg = tid % 128;
  const int lane = tid % 32;

  // Score scale (log2 domain) and output scale. An fp8 cache holds real / k_scale and q was loaded
  // times kFp8QPrescale, so scores take k_scale / kFp8QPrescale and the output k_scale.
  float score_scale = p.scale_log2, v_scale = 1.f;
  if constexpr (Types::kFp8) {
    v_scale = a.k_scale_ptr != nullptr ? __ldg(a.k_scale_ptr) : a.k_scale;
    score_scale *= v_scale / kFp8QPrescale;
  }

  if constexpr (kSt) {
    // Transposed path: this thread's query rows are columns of S^T (consumer_st.cuh). Columns past
    // the real rows take qi = q_len - 1 (finite scores from zero Q rows, never stored).
    constexpr int kRows = ROWS;
    using LS = StLayouts<Element, kRows>;
    StContext<kRows> ctx;
    ctx.kv_begin = kv_begin;
    ctx.num_tiles = num_tiles;
    ctx.score_scale = score_scale;
    ctx.wg = wg;
    ctx.tid_wg = tid_wg;
    ctx.warp = tid_wg / 32;
    ctx.lane = lane;
    float m_run[kRows / 4], l_run[kRows / 4];
    int least_limit = kv_end;
    CUTE_UNROLL
    for (int j = 0; j < kRows / 4; ++j) {
      const int qi = (m_block * kRows + st_col_of_index(j, lane)) / NUM_HEADS;
      const int limit = min(kv_end, seq_len - (a.q_len - 1 - min(qi, a.q_len - 1)));
      least_limit = min(least_limit, limit);
      if constexpr (kKeyLimitShared<Storage>) {
        // This warp's row of s.key_limit (st_softmax_to_pt): lanes 0-3 write all kRows columns.
        if (lane < 4) s.key_limit[tid / 32][st_col_of_index(j, lane)] = limit;
      } else {
        ctx.key_limit[j] = limit;
      }
      m_run[j] = -INFINITY;
      l_run[j] = 0.f;
    }
    ctx.unmasked_end = __reduce_min_sync(0xffffffff, least_limit);
    __syncwarp();
    if constexpr (Storage::kRegWiden) {
      if (num_tiles > 0) convert_q_st_fp8(s, tid);  // the producer only copied Q's bf16 rows
    }
    // O^T: all 512 latent rows.
    Tensor tOrO = partition_fragment_C(typename LS::TiledMmaO{}, Shape<Int<kHeadDimV>, Int<kRows>>{});
    clear(tOrO);
    if (num_tiles > 0) {
      if constexpr (Storage::kRegWiden) {
        consume_st_regs(s, ctx, tOrO, m_run, l_run);
      } else {
        consume_st(s, ctx, tOrO, m_run, l_run);
      }
    }
    trace_at(p, kProducerThreads).stamp(kTraceLoopDone);
    trace_at(p, kProducerThreads + 128 * (Storage::kMathWgs - 1)).stamp(kTraceLoopDoneLast);
    merge_st(s, ctx, tOrO, m_run, l_run, v_scale, bad_len);
    trace_at(p, kProducerThreads).stamp(kTraceMerged);
    const int64_t piece_row = piece_row_of<SPLIT, SCHED>(a, b, split);
    store_rows_st<typename Types::Out, NUM_HEADS, SPLIT>(p, s, b, piece_row, m_block, tid, v_scale, bad_len);
    trace_at(p, kProducerThreads).stamp(kTraceStored);
    allow_dependent_launch<SPLIT>();
    return;
  } else {
    const int64_t piece_row = piece_row_of<SPLIT, /*SCHED=*/false>(a, b, split);
    // Non-split kernels on TMA pages stage out through shared memory (epilogue.cuh store_rows_staged).
    constexpr bool kStaged = !SPLIT && kTmaPages<Cache, PAGE_SIZE, ROWS>;
    rows_64<Cache, NUM_HEADS, kStaged, /*kTrace=*/MLA_TRACE != 0, /*kShort=*/SHORT>(p, s, w, piece_row, score_scale,
                                                                                  v_scale, /*phases=*/0, /*buf=*/0);
    allow_dependent_launch<SPLIT>();
  }  // !kSt
}

}  // namespace mla

