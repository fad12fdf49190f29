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
//   cost [batch + 1]      int64 scratch (the cumulative cost), only used while scheduling.
// A request with no key (seq_len 0) has cost overhead and is covered by exactly one CTA (which writes
// out 0 and lse -inf). Pieces number at most batch + G - 1 (every inner boundary splits at most one
// request), the workspace's size (split_workspace).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace mla {

constexpr int kScheduleThreads = 1024;

__host__ __device__ __forceinline__ int64_t schedule_ints(int batch, int ctas) {
  // bounds + requests, rounded up to even so that the int64 scratch is 8-byte aligned, + the scratch
  const int64_t head = 2 * (int64_t(ctas) + 1) + 4 * int64_t(batch);
  return head + (head & 1) + 2 * (int64_t(batch) + 1);
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
