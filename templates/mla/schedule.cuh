// The balanced schedule: which keys each CTA of a scheduled decode launch covers.
//
// The uniform split gives every request the same number of CTAs, so in a ragged batch the longest
// request sets the time, and every CTA pays its start-up and its partial-output store however little
// it computes. The schedule instead lays the batch's work on one line, request after request, each
// request costing its 64-key tiles plus a fixed overhead (its Q load and epilogue, in tiles), and cuts
// the line into sched_ctas equal runs: CTA c takes the run [B_c, B_c+1), which may end inside a
// request, span several, or begin inside one (FlashMLA's "get_mla_metadata" does the same split).
// A request covered by one CTA is written to out directly; one covered by several CTAs gets one
// partial result ("piece") per CTA in the workspace, merged by the combine kernel.
//
// It is computed on the device once per decode step (MLADecodePlan.schedule, one small kernel: graph
// capturable, no host synchronization) and read by every layer's launch of that step.
//
// Layout (int32 values; batch requests, G = sched_ctas CTAs per query-row block):
//   bounds [2 (G + 1)]   B_c = (request, tile) for c = 0..G: CTA c covers (b, t) with B_c <= (b, t) < B_c+1
//                         (lexicographic); B_0 = (0, 0), B_G = (batch, 0), and B_c.tile < tiles(B_c.request)
//                         unless it is 0;
//   requests [4 batch]   per request: its tile count when scheduled, the first CTA that covers it, its
//                         first piece, its number of pieces (1: written directly by that CTA);
//   cost [batch + 1]      int64 scratch (the cumulative cost), only used while scheduling;
//   alt [2 (G + 1)]       scratch: the bounds of the uniform-equivalent cut (below);
//   kind [1]              which cut the schedule holds: 0 balanced, 1 uniform-equivalent;
//   shared [1 + G]        the number of requests with more than one piece, then those requests in order
//                         (at most G - 1: each lies across one of the G - 1 inner bounds). The combine
//                         walks this list, so a batch of unshared requests costs it one small wave.
//   segments [1 + 2 (batch + G)]  the number of segments (request pieces, one per CTA they touch, at
//                         most batch + G - 1), then (request, CTA) per segment: the transposed path runs
//                         each segment as a CTA of its own (kernel.cuh sched_st_work) instead of walking
//                         a run, the costliest first (tables of up to 4096 segments; by cost class, 256
//                         classes of the busiest run's price, request order within a class), so the
//                         hardware hands the short ones to the SMs that finish first. Written only
//                         for plans that launch the transposed path (segment_table); else 0 segments.
// The kernel builds two cuts and keeps the one its cost model prices lower: the balanced cut above,
// and the uniform-equivalent cut, which gives each CTA k consecutive (request, split) pieces of the
// uniform split into S splits (k = ceil(batch S / G); the uniform launch's work when batch S <= G).
// A cut's price, in tiles: its busiest CTA's tiles plus `overhead` per segment, plus kPieceCost per
// piece of a request that several CTAs share (its partial written, then read by the combine); the
// balanced cut is kept only when it is priced below kBalancedMargin times the other (both values are
// policy, config.cuh; docs/design.md says how they were fitted).
// A request with no key (seq_len 0) has cost overhead and is covered by exactly one CTA (which writes
// out 0 and lse -inf). Pieces number at most batch + G - 1 (every inner boundary splits at most one
// request), the workspace's size (split_workspace).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "config.cuh"  // kPieceCost, kBalancedMargin

namespace mla {

constexpr int kScheduleThreads = 512;  // one CTA a launch (up to 128 registers a thread): no spills
constexpr int kSegmentSortItems = 8;  // segments a thread sorts: tables of up to 4096 go longest first


// Offsets (in int32) of the layout's parts.
__host__ __device__ __forceinline__ int64_t schedule_cost_offset(int batch, int ctas) {
  const int64_t head = 2 * (int64_t(ctas) + 1) + 4 * int64_t(batch);
  return head + (head & 1);  // 8-byte aligned for the int64 cost
}
__host__ __device__ __forceinline__ int64_t schedule_alt_offset(int batch, int ctas) {
  return schedule_cost_offset(batch, ctas) + 2 * (int64_t(batch) + 1);
}
__host__ __device__ __forceinline__ int64_t schedule_kind_offset(int batch, int ctas) {
  return schedule_alt_offset(batch, ctas) + 2 * (int64_t(ctas) + 1);
}
__host__ __device__ __forceinline__ int64_t schedule_shared_offset(int batch, int ctas) {
  return schedule_kind_offset(batch, ctas) + 1;
}
__host__ __device__ __forceinline__ int64_t schedule_segments_offset(int batch, int ctas) {
  return schedule_shared_offset(batch, ctas) + 1 + ctas;
}
__host__ __device__ __forceinline__ int64_t schedule_ints(int batch, int ctas) {
  return schedule_segments_offset(batch, ctas) + 1 + 2 * (int64_t(batch) + ctas);
}

struct ScheduleView {
  const int32_t* p;
  int ctas;
  __device__ __forceinline__ int bound_req(int c) const { return p[2 * c]; }
  __device__ __forceinline__ int bound_tile(int c) const { return p[2 * c + 1]; }
  __device__ __forceinline__ const int32_t* request(int b) const { return p + 2 * (ctas + 1) + 4 * b; }
};
// Fields of a request's entry.
constexpr int kReqTiles = 0, kReqFirstCta = 1, kReqFirstPiece = 2, kReqPieces = 3;

}  // namespace mla
