// Per-CTA phase trace: a diagnostic build, not a product path (-DMLA_TRACE=1; the default 0 compiles
// none of it, and the kernels' SASS is the untraced one). In a trace build every uniform-launch CTA
// (not the balanced schedule's) stamps %globaltimer (ns) at its phases into the spare columns
// 512..1023 of its first query row of `out`: a caller that wants a trace passes `out` as a view
// out_big[..., :512] of a [batch, q_len, num_heads, 1024] buffer (scripts/trace_case.py does), and a
// CTA traces only when out's head stride is at least 1024 elements, so a normal `out` is never
// written past its rows. The stamps of split s sit at 64-bit word 8 s of the spare half (splits 0-15).
// The balanced schedule's CTAs (no out row of their own) stamp into the workspace instead, past its
// partial results: CTA x (grid x index) at 64-bit word 8 x of the tail, when the launch's
// workspace_bytes covers the tail (benchmarks/trace.py --balanced enlarges the plan's workspace).
#pragma once
#include <stdint.h>

#include "abi.h"
#include "constants.cuh"

#ifndef MLA_TRACE
#define MLA_TRACE 0
#endif

namespace mla {

enum TraceSlot : int {
  kTraceEntry = 0,          // first math thread, at kernel entry
  kTraceProducerStart = 1,  // producer thread 0, past the barrier set-up, about to issue its copies
  kTraceQLanded = 2,        // first math thread: Q in shared memory (q_full complete)
  kTraceLoopDone = 3,       // first math thread: its warpgroup's main loop done (before the row sums / merge)
  kTraceStored = 4,         // first math thread: past its epilogue's stores
  kTraceProducerDone = 5,   // producer thread 0: its last copy landed
  kTraceInfo = 6,           // (sm id << 32) | tiles of the split (scheduled CTA: of all its segments)
  kTraceSegments = 7,       // scheduled CTA: its segments with tiles
};
constexpr int kTraceSlots = 8;
constexpr int kTraceMaxSplits = kHeadDimV * 2 / 8 / kTraceSlots;  // 16: 8 stamps each in 1024 spare bytes

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// Where one CTA's stamps go: null when the CTA (or this thread) does not trace.
struct TraceSink {
  uint64_t* p;
  __device__ __forceinline__ void stamp(int slot) const {
    if constexpr (MLA_TRACE != 0) {
      if (p != nullptr) p[slot] = global_timer_ns();
    }
  }
  __device__ __forceinline__ void put(int slot, uint64_t v) const {
    if constexpr (MLA_TRACE != 0) {
      if (p != nullptr) p[slot] = v;
    }
  }
  __device__ __forceinline__ void info(int tiles) const {
    if constexpr (MLA_TRACE != 0) {
      if (p != nullptr) {
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
        p[kTraceInfo] = (uint64_t(sm) << 32) | uint32_t(tiles);
      }
    }
  }
};

// The sink of the CTA whose query-row block starts at row grow0 (qi * NUM_HEADS + h) of request b,
// split `split`; `tracer`: whether the calling thread is one that stamps.
template <int NUM_HEADS>
__device__ __forceinline__ TraceSink trace_sink(const MlaDecodeArgs& a, int b, int grow0, int split, bool tracer) {
  TraceSink s{nullptr};
  if constexpr (MLA_TRACE != 0) {
    const int qi = grow0 / NUM_HEADS, h = grow0 % NUM_HEADS;
    if (tracer && a.out_stride_head >= 2 * kHeadDimV && qi < a.q_len && h < a.num_heads && split >= 0 &&
        split < kTraceMaxSplits) {
      // out's element type is 16-bit for every cache dtype (fp8 caches write bf16).
      char* row = static_cast<char*>(a.out) +
                  (int64_t(b) * a.out_stride_batch + int64_t(qi) * a.out_stride_token + int64_t(h) * a.out_stride_head +
                   kHeadDimV) * 2;
      s.p = reinterpret_cast<uint64_t*>(row) + split * kTraceSlots;
    }
  }
  return s;
}

// The sink of scheduled CTA x (grid x index) of a launch whose partial results take result_bytes of
// the workspace (split_workspace); null unless the workspace holds the tail of gridDim.x stamp blocks.
__device__ __forceinline__ TraceSink trace_sink_scheduled(const MlaDecodeArgs& a, int64_t result_bytes, bool tracer) {
  TraceSink s{nullptr};
  if constexpr (MLA_TRACE != 0) {
    const int64_t tail = int64_t(gridDim.x) * kTraceSlots * 8;
    if (tracer && a.workspace != nullptr && a.workspace_bytes >= ((result_bytes + 7) / 8) * 8 + tail) {
      s.p = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(a.workspace) + (result_bytes + 7) / 8 * 8) +
            int64_t(blockIdx.x) * kTraceSlots;
    }
  }
  return s;
}

}  // namespace mla
