// Per-CTA phase trace: a diagnostic build, not a product path (-DMLA_TRACE=1; the default 0 compiles
// none of it, and the kernels' SASS is the untraced one). In a trace build the library owns one
// device buffer (exports.cu: allocated by the first mla_variants_trace_* call, on the device current
// then) and every decode CTA stamps %globaltimer (ns) at its phases into its own 16 words there: CTA
// (x, y) of the grid at word 16 (x + gridDim.x y). Each launch overwrites the stamps of the one before,
// so read them after every call (mla_variants_trace_read / _clear; lab/trace.py does). Nothing
// of a call's own inputs or outputs is touched. Launches on another device, launches while tracing is
// switched off (mla_variants_trace_enable), and launches before the buffer exists do not trace.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "config.cuh"

#ifndef MLA_TRACE
#define MLA_TRACE 0
#endif

namespace mla {

enum TraceSlot : int {
  kTraceEntry = 0,          // first math thread, at kernel entry
  kTraceProducerStart = 1,  // producer thread 0, past the barrier set-up (uniform 16-bit kernels: Q already in flight)
  kTraceQLanded = 2,        // first math thread: Q in shared memory (q_full complete; uniform launches; on the
                            // fp8 register path its bf16 rows, before the math warps round them; in the fp8
                            // fast kernel Q rounded to e4m3 by the P V warpgroups)
  kTraceLoopDone = 3,       // first math thread: its warpgroup's main loop done (uniform launches; fp8 fast
                            // kernel: the softmax warpgroup's S and softmax of every tile)
  kTraceStored = 4,         // first math thread (fp8 fast kernel: of the first P V warpgroup): past its (last
                            // segment's) epilogue stores
  kTraceProducerDone = 5,   // producer thread 0: its last copy landed (TMA tiles: issued)
  kTraceInfo = 6,           // (sm id << 32) | the CTA's tiles
  kTraceSegments = 7,       // scheduled CTA: its segments with tiles (uniform launches: 0)
  kTraceLoopDoneLast = 8,   // first thread of the last math warpgroup: its main loop done (uniform launches;
                            // on the 64-row path, where the warpgroups share every tile, both end
                            // together and the lag only shows skew)
  kTraceMerged = 9,         // first math thread: the warpgroups' results merged, before the stores (uniform;
                            // fp8 fast kernel: the first P V thread past kBarEnd, the rows' factors written)
  // A scheduled 64-row CTA (16-bit) stamps slots 2, 3, 8 and 9 for its second segment with tiles instead
  // (and slot 4 there too, which its last stores overwrite), and around it:
  kTraceSegPrevEnd = 10,    // first math thread: past the first segment's stores
  kTraceSegQIssued = 11,    // producer thread 0: the second segment's Q issued (past the q_empty wait)
  kTraceSegEnd = 12,        // first math thread: past the second segment's stores
  kTraceSegTiles = 13,      // the second segment's tiles
};
constexpr int kTraceSlots = 16;  // 14 used; room for more without changing the layout again
constexpr int64_t kTraceMaxCtas = int64_t(1) << 17;  // 16 MiB of stamps; CTAs past it do not trace
constexpr int64_t kTraceBytes = kTraceMaxCtas * kTraceSlots * 8;

#if MLA_TRACE
// The trace buffer a launch on the current device passes its CTAs (exports.cu), or null.
uint64_t* trace_buffer_for_launch();
#endif

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

// The calling CTA's sink in `base` (the launch's trace buffer) for thread `thread` alone. The thread
// and CTA indices are read afresh (volatile moves), so no value stays live across the kernel's
// phases only for the trace (the 40-register producer and the math warpgroups spilled when one did).
__device__ __forceinline__ TraceSink trace_sink(uint64_t* base, int thread) {
  TraceSink s{nullptr};
  if constexpr (MLA_TRACE != 0) {
    uint32_t tid, cx, cy, nx;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(cy));
    asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(nx));
    const int64_t cta = int64_t(cx) + int64_t(nx) * cy;
    if (base != nullptr && tid == uint32_t(thread) && cta < kTraceMaxCtas) s.p = base + cta * kTraceSlots;
  }
  return s;
}

}  // namespace mla
