// The schedule kernel and its launcher (one per library, not per variant): see schedule.cuh for what
// the schedule is and its layout.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "abi.h"
#include "schedule.cuh"

namespace mla {

// Whole 64-key tiles that hold `keys` keys (kernel.cuh's tiles_of, without its includes).
__device__ __forceinline__ int schedule_tiles(int keys) { return keys / 64 + (keys % 64 != 0); }

// One CTA of kScheduleThreads threads: (1) each request's tiles and the cumulative cost (tiles +
// overhead per request), (2) the CTA bounds B_c at cost c * ceil(total / G), by binary search over the
// cumulative cost, (3) each request's first CTA and piece count, by binary search over the bounds,
// and its first piece (an exclusive scan). A seq_len the block table cannot address (< 0 or > max_keys)
// counts 0 tiles; the decode kernel gives that request NaN.
__global__ void __launch_bounds__(kScheduleThreads) mla_schedule_kernel(const int32_t* seq_lens, int batch,
                                                                        int64_t max_keys, int ctas, int overhead,
                                                                        int32_t* out) {
  using Scan = cub::BlockScan<int64_t, kScheduleThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry;
  int32_t* bounds = out;
  int32_t* req = out + 2 * (int64_t(ctas) + 1);
  const int64_t head = 2 * (int64_t(ctas) + 1) + 4 * int64_t(batch);
  int64_t* cost = reinterpret_cast<int64_t*>(out + head + (head & 1));  // cost[b]: cumulative cost before b

  // (1) tiles per request, cumulative cost.
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < batch; base += kScheduleThreads) {
    const int b = base + int(threadIdx.x);
    int64_t c = 0;
    if (b < batch) {
      const int len = seq_lens[b];
      const int tiles = len < 0 || int64_t(len) > max_keys ? 0 : schedule_tiles(len);
      req[4 * b + kReqTiles] = tiles;
      c = tiles + overhead;
    }
    int64_t excl, sum;
    Scan(temp).ExclusiveSum(c, excl, sum);
    if (b < batch) cost[b] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  const int64_t total = carry;
  const int64_t per_cta = max(int64_t(1), (total + ctas - 1) / ctas);

  // (2) B_c = the (request, tile) at cost c * per_cta; a cut inside a request's overhead falls on its
  // tile 0, so every B_c.tile is below the request's tile count (or 0).
  for (int c = threadIdx.x; c <= ctas; c += kScheduleThreads) {
    const int64_t x = int64_t(c) * per_cta;
    int rb = batch, rt = 0;
    if (c < ctas && x < total) {
      int lo = 0, hi = batch - 1;  // the last request whose cost starts at or before x
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cost[mid] <= x) lo = mid; else hi = mid - 1;
      }
      rb = lo;
      rt = int(max(int64_t(0), x - cost[lo] - overhead));
    }
    bounds[2 * c] = rb;
    bounds[2 * c + 1] = rt;
  }
  __syncthreads();

  // (3) the CTAs covering request b: from the last c with B_c <= (b, 0) to the last c with
  // B_c <= (b, tiles - 1); every CTA in between covers at least one of its tiles (the bounds inside a
  // request are distinct tiles).
  auto last_cta_at = [&](int b, int t) {
    int lo = 0, hi = ctas - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      const int mb = bounds[2 * mid], mt = bounds[2 * mid + 1];
      if (mb < b || (mb == b && mt <= t)) lo = mid; else hi = mid - 1;
    }
    return lo;
  };
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < batch; base += kScheduleThreads) {
    const int b = base + int(threadIdx.x);
    int64_t pieces = 0;
    if (b < batch) {
      const int tiles = req[4 * b + kReqTiles];
      const int first = last_cta_at(b, 0);
      const int last = tiles > 0 ? last_cta_at(b, tiles - 1) : first;
      req[4 * b + kReqFirstCta] = first;
      req[4 * b + kReqPieces] = last - first + 1;
      pieces = last - first + 1;
    }
    int64_t excl, sum;
    Scan(temp).ExclusiveSum(pieces, excl, sum);
    if (b < batch) req[4 * b + kReqFirstPiece] = int(carry + excl);
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
}

}  // namespace mla

// Writes the schedule of `batch` requests (seq_lens: device int32 [batch]) for `ctas` CTAs per
// query-row block into `schedule` (device, mla_variants_schedule_ints(batch, ctas) int32 values, 8-byte
// aligned) on `stream`. max_keys: the most keys a request's block-table row addresses; overhead: the
// fixed cost of a request in tiles (>= 1). Returns a cudaError_t code.
extern "C" int mla_variants_schedule(const int32_t* seq_lens, int32_t batch, int64_t max_keys, int32_t ctas,
                                     int32_t overhead, int32_t* schedule, void* stream) {
  if (seq_lens == nullptr || schedule == nullptr || batch < 1 || ctas < 1 || overhead < 1 || max_keys < 0 ||
      reinterpret_cast<uintptr_t>(schedule) % 8 != 0) {
    return int(cudaErrorInvalidValue);
  }
  mla::mla_schedule_kernel<<<1, mla::kScheduleThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      seq_lens, batch, max_keys, ctas, overhead, schedule);
  return int(cudaGetLastError());
}

extern "C" int64_t mla_variants_schedule_ints(int32_t batch, int32_t ctas) { return mla::schedule_ints(batch, ctas); }
