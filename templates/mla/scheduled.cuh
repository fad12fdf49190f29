// The balanced schedule's walk inside the decode kernel (schedule.cuh holds the schedule's layout and
// schedule.cu the kernel that makes it): a scheduled CTA covers the (request, tile) range [B_c, B_c+1),
// one segment per request it touches. The 64-row path of 16-bit caches takes it (kSchedulable; this
// file's produce_scheduled / consume_scheduled), and so does the fp8 fast kernel (fp8_fast.cuh, with its
// own producer and math warpgroups over the same walk, for_each_segment). The transposed path instead
// launches one CTA per segment (sched_st_work), so its kernels keep their one-range loop.
#pragma once
#include <cuda_runtime.h>

#include "arch.cuh"
#include "config.cuh"
#include "consumer_rows64.cuh"
#include "params.cuh"
#include "producer.cuh"
#include "schedule.cuh"
#include "trace.cuh"

namespace mla {

using namespace cute;

// The scheduled CTA's index c and query-row block (grid x = m_block + num_m_blocks * c).
__device__ __forceinline__ void sched_cta(const DecodeParams& p, int& c, int& m_block) {
  uint32_t cx;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
  m_block = int(cx) % p.num_m_blocks;
  c = int(cx) / p.num_m_blocks;
}

// Whether the scheduled CTA's row block holds no placed row of request b (params.cuh row_block_empty).
// Not inlined: inlined into the producer (40 registers) its loads push the producer's cp.async
// addresses to local memory.
template <int NUM_HEADS, int ROWS = kBlockM>
__device__ __noinline__ bool sched_rows_empty(const DecodeParams& p, int b) {
  int c, m_block;
  sched_cta(p, c, m_block);
  return row_block_empty<NUM_HEADS, ROWS>(p.a, b, m_block);
}

// The segment of request b from tile t in CTA c, whose range ends at (end_b, end_t). CtaWork.split is
// the segment's piece, or -1 when the CTA covers the whole request (it writes out directly). A request
// whose tile count differs from the one it was scheduled with (the schedule was made for other
// seq_lens) gets no tiles and NaN rows, like a seq_len the block table cannot address; a row block
// without a placed row (row_block_empty) gets no tiles.
template <int NUM_HEADS, int PAGE_SIZE, int ROWS = kBlockM>
__device__ __forceinline__ CtaWork sched_segment(const DecodeParams& p, int c, int m_block, int b, int t, int end_b,
                                                 int end_t) {
  const MlaDecodeArgs& a = p.a;
  const ScheduleView sv{a.schedule, a.sched_ctas};
  const int32_t* r = sv.request(b);
  const int sched_tiles = r[kReqTiles];
  CtaWork w;
  w.b = b;
  w.m_block = m_block;
  w.seq_len = checked_seq_len<PAGE_SIZE>(a, b, w.bad_len);
  if (tiles_of(w.seq_len) != sched_tiles) w.bad_len = true;
  if (w.bad_len) w.seq_len = 0;
  const int t1 = b == end_b ? end_t : sched_tiles;
  w.kv_begin = w.bad_len ? 0 : t * kBlockN;
  w.kv_end = w.bad_len ? 0 : int(min(int64_t(w.seq_len), int64_t(t1) * kBlockN));  // t1 * 64 may reach 2^31
  w.num_tiles = w.bad_len || sched_rows_empty<NUM_HEADS, ROWS>(p, b) ? 0 : t1 - t;
  w.split = r[kReqPieces] == 1 ? -1 : r[kReqFirstPiece] + (c - r[kReqFirstCta]);
  return w;
}

// The transposed path runs each segment as a CTA of its own (grid x = m_block + num_m_blocks * k for
// entry k of the schedule's segment table; k past the table's count: no work, sched_st_has_segment).
__device__ __forceinline__ int sched_st_segment_index(const DecodeParams& p, int& m_block) {
  uint32_t cx;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
  m_block = int(cx) % p.num_m_blocks;
  return int(cx) / p.num_m_blocks;
}
__device__ __forceinline__ bool sched_st_has_segment(const DecodeParams& p) {
  int m_block;
  const int k = sched_st_segment_index(p, m_block);
  return k < p.a.schedule[schedule_segments_offset(p.a.batch, p.a.sched_ctas)];
}
// The request of the transposed scheduled CTA's segment (and its row block).
__device__ __forceinline__ int sched_st_request(const DecodeParams& p, int& m_block) {
  const int k = sched_st_segment_index(p, m_block);
  return p.a.schedule[schedule_segments_offset(p.a.batch, p.a.sched_ctas) + 1 + 2 * k];
}
template <int NUM_HEADS, int PAGE_SIZE, int ROWS>
__device__ __forceinline__ CtaWork sched_st_work(const DecodeParams& p) {
  int m_block;
  const int k = sched_st_segment_index(p, m_block);
  const int32_t* seg = p.a.schedule + schedule_segments_offset(p.a.batch, p.a.sched_ctas) + 1 + 2 * k;
  const int b = seg[0], c = seg[1];
  const ScheduleView sv{p.a.schedule, p.a.sched_ctas};
  const int t = sv.bound_req(c) == b ? sv.bound_tile(c) : 0;
  return sched_segment<NUM_HEADS, PAGE_SIZE, ROWS>(p, c, m_block, b, t, sv.bound_req(c + 1), sv.bound_tile(c + 1));
}
// The one range of keys a CTA runs outside the 64-row scheduled walk: a uniform CTA's (request, split)
// or a transposed scheduled CTA's segment. (The 64-row scheduled kernels walk their segments in
// produce_scheduled / consume_scheduled and take no such range: empty work.)
template <int NUM_HEADS, int PAGE_SIZE, int ROWS, bool SCHED>
__device__ __forceinline__ CtaWork one_range_work(const DecodeParams& p) {
  if constexpr (!SCHED) {
    return cta_work<NUM_HEADS, PAGE_SIZE, ROWS>(p);
  } else if constexpr (ROWS != kBlockM) {
    return sched_st_work<NUM_HEADS, PAGE_SIZE, ROWS>(p);
  } else {
    return CtaWork{};
  }
}

// Whether the cursor (b, t) is still before the CTA's end bound (lexicographic order).
__device__ __forceinline__ bool sched_before(int b, int t, int end_b, int end_t) {
  return b < end_b || (b == end_b && t < end_t);
}

// The CTA's segments in order: segment(w) for each (sched_segment's CtaWork). The loop keeps only the
// cursor live across a segment: the CTA index is read again from %ctaid and the end bound from the
// schedule each time, which the producers (40 registers) and the fast kernel's math warpgroups need.
template <int NUM_HEADS, int PAGE_SIZE, class Segment>
__device__ __forceinline__ void for_each_segment(const DecodeParams& p, Segment&& segment) {
  const ScheduleView sv{p.a.schedule, p.a.sched_ctas};
  int b, t;
  {
    int c, m_block;
    sched_cta(p, c, m_block);
    b = sv.bound_req(c);
    t = sv.bound_tile(c);
  }
  for (;; ++b, t = 0) {
    int c, m_block;
    sched_cta(p, c, m_block);
    const int end_b = sv.bound_req(c + 1), end_t = sv.bound_tile(c + 1);
    if (!sched_before(b, t, end_b, end_t)) break;
    segment(sched_segment<NUM_HEADS, PAGE_SIZE>(p, c, m_block, b, t, end_b, end_t));
  }
}

// The scheduled producer: per segment with tiles, Q (once the math warps are done with the previous
// segment's Q: q_empty) and its tiles. The ring continues across segments: each stage counts its own
// uses, a segment's tile 0 always takes stage 0, and `state` carries the parities: bits 0-1 those of
// the stages' next uses, bit 2 Q's next fill, bit 3 set once Q was filled. The producer runs at 40
// registers: for_each_segment keeps only its cursor live across produce, and this walk only state.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, class Storage>
__device__ __forceinline__ void produce_scheduled(const DecodeParams& p, Storage& s, const void* kv_map) {
  int state = 0;
  trace_at(p, 0).stamp(kTraceProducerStart);
  for_each_segment<NUM_HEADS, PAGE_SIZE>(p, [&](const CtaWork& w) {
    if (w.num_tiles == 0) return;
    if (state & 8) {
      wait_barrier(&s.q_empty, ((state >> 2) & 1) ^ 1);
      if constexpr (MLA_TRACE != 0) {  // bit 4: the second segment's Q was stamped
        if (!(state & 16)) trace_at(p, 0).stamp(kTraceSegQIssued);
        state |= 16;
      }
    }
    produce<Cache, NUM_HEADS, PAGE_SIZE>(s, p.a, w.b, w.m_block, w.kv_begin, w.kv_end, w.num_tiles, int(threadIdx.x),
                                         kv_map, state & 3);
    state ^= (((w.num_tiles + 1) / 2) & 1) | (((w.num_tiles / 2) & 1) << 1) | 4;
    state |= 8;
  });
  trace_at(p, 0).stamp(kTraceProducerDone);
}

// The scheduled math warpgroups: rows_64 for each segment in turn (a segment without tiles only
// writes its placed rows: out 0 and lse -inf, or NaN; a row block without any, nothing), with the
// stage and Q parities the producer uses.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
__device__ __forceinline__ void consume_scheduled(const DecodeParams& p, SharedStorage<Cache>& s) {
  static_assert(SPLIT, "a scheduled launch writes workspace pieces: split variants only");
  const MlaDecodeArgs& a = p.a;
  int c, m_block;
  sched_cta(p, c, m_block);
  const ScheduleView sv{a.schedule, a.sched_ctas};
  int b = sv.bound_req(c), t = sv.bound_tile(c);
  const int end_b = sv.bound_req(c + 1), end_t = sv.bound_tile(c + 1);
  int u0 = 0, u1 = 0, k = 0, seg = 0;
  for (; sched_before(b, t, end_b, end_t); ++b, t = 0, ++seg) {
    const CtaWork w = sched_segment<NUM_HEADS, PAGE_SIZE>(p, c, m_block, b, t, end_b, end_t);
    const int64_t piece_row = piece_row_of<SPLIT, /*SCHED=*/true>(a, w.b, w.split);
    const int phases = (u0 & 1) | ((u1 & 1) << 1) | ((k & 1) << 2);
    if (MLA_TRACE != 0 && k == 1 && w.num_tiles > 0) {  // trace builds: the second segment with tiles, in phases
      const TraceSink tr = trace_at(p, kProducerThreads);
      if (tr.p != nullptr) {
        wait_barrier(&s.q_full, k & 1);
        tr.stamp(kTraceQLanded);
        tr.put(kTraceSegTiles, uint64_t(w.num_tiles));
      }
      rows_64<Cache, NUM_HEADS, /*kStaged=*/false, /*kTrace=*/MLA_TRACE != 0>(p, s, w, piece_row, p.scale_log2, 1.f,
                                                                              phases, seg & 1);
      tr.stamp(kTraceSegEnd);
    } else {
      rows_64<Cache, NUM_HEADS, /*kStaged=*/false>(p, s, w, piece_row, p.scale_log2, 1.f, phases, seg & 1);
      if (MLA_TRACE != 0 && k == 0 && w.num_tiles > 0) trace_at(p, kProducerThreads).stamp(kTraceSegPrevEnd);
    }
    if (w.num_tiles > 0) {
      u0 += (w.num_tiles + 1) / 2;
      u1 += w.num_tiles / 2;
      ++k;
    }
  }
  if constexpr (MLA_TRACE != 0) {  // k: segments with tiles; u0 + u1: their tiles
    const TraceSink tr = trace_at(p, kProducerThreads);
    tr.stamp(kTraceStored);
    tr.info(u0 + u1);
    tr.put(kTraceSegments, uint64_t(k));
  }
  allow_dependent_launch<SPLIT>();
}


}  // namespace mla
