// The schedule kernel and its launcher (one per library, not per variant): see schedule.cuh for what
// the schedule is and its layout.
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "abi.h"
#include "schedule.cuh"

namespace mla {

// Whole 64-key tiles that hold `keys` keys (params.cuh tiles_of, without its includes).
__device__ __forceinline__ int schedule_tiles(int keys) { return keys / 64 + (keys % 64 != 0); }

// The busiest CTA's work and the number of shared-request pieces of the cut `bounds` (see schedule.cuh):
// thread c walks CTA c's segments as the decode kernel will (sched_before / sched_segment).
struct MaxOp {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};
struct CutPrice {
  int64_t max_work;
  int64_t pieces;
};
template <class Reduce>
__device__ CutPrice price_cut(const int32_t* bounds, const int32_t* req, int ctas, int overhead,
                              typename Reduce::TempStorage& temp) {
  int64_t work_max = 0, pieces = 0;
  for (int c = threadIdx.x; c < ctas; c += kScheduleThreads) {
    int b = bounds[2 * c], t = bounds[2 * c + 1];
    const int end_b = bounds[2 * c + 2], end_t = bounds[2 * c + 3];
    int64_t work = 0;
    for (; b < end_b || (b == end_b && t < end_t); ++b, t = 0) {
      const int tiles = req[4 * b + kReqTiles];
      const int t1 = b == end_b ? end_t : tiles;
      work += (t1 - t) + overhead;
      pieces += !(t == 0 && t1 == tiles);
    }
    work_max = max(work_max, work);
  }
  CutPrice price;
  price.max_work = Reduce(temp).Reduce(work_max, MaxOp{});
  __syncthreads();
  price.pieces = Reduce(temp).Sum(pieces);
  __syncthreads();
  return price;  // valid in thread 0
}

// One CTA of kScheduleThreads threads: (1) each request's tiles and the cumulative cost (tiles +
// overhead per request), (2) the balanced cut: bounds B_c at cost c * ceil(total / G), by binary
// search over the cumulative cost; the uniform-equivalent cut of `uniform_splits` splits into the
// scratch; both priced, the cheaper kept (schedule.cuh), (3) each request's first CTA and piece count,
// by binary search over the kept bounds, and its first piece (an exclusive scan). A seq_len the block
// table cannot address (< 0 or > max_keys) counts 0 tiles; the decode kernel gives that request NaN.
__global__ void __launch_bounds__(kScheduleThreads, 1) mla_schedule_kernel(const int32_t* seq_lens, int batch,
                                                                        int64_t max_keys, int ctas, int overhead,
                                                                        int uniform_splits, bool segment_table,
                                                                        int32_t* out) {
  using Scan = cub::BlockScan<int64_t, kScheduleThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScheduleThreads>;
  using Sort = cub::BlockRadixSort<uint32_t, kScheduleThreads, kSegmentSortItems, uint32_t>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
    typename Sort::TempStorage sort;
  } temp;
  __shared__ int64_t carry, carry_shared, busiest;
  __shared__ int use_alt;
  int32_t* bounds = out;
  int32_t* req = out + 2 * (int64_t(ctas) + 1);
  int64_t* cost = reinterpret_cast<int64_t*>(out + schedule_cost_offset(batch, ctas));  // before request b
  int32_t* alt = out + schedule_alt_offset(batch, ctas);

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
    Scan(temp.scan).ExclusiveSum(c, excl, sum);
    if (b < batch) cost[b] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  const int64_t total = carry;
  const int64_t per_cta = max(int64_t(1), (total + ctas - 1) / ctas);

  // (2) The balanced cut: B_c = the (request, tile) at cost c * per_cta; a cut inside a request's
  // overhead falls on its tile 0, so every B_c.tile is below the request's tile count (or 0).
  // The uniform-equivalent cut: CTA c starts at piece c * k of the batch * S pieces (request j / S,
  // split j % S of ceil(tiles / S) tiles; a split past a short request's end starts the next request).
  const int splits = uniform_splits;
  const int64_t num_pieces = int64_t(batch) * splits;
  const int64_t k = (num_pieces + ctas - 1) / ctas;
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
    const int64_t j = int64_t(c) * k;
    int ub = batch, ut = 0;
    if (c < ctas && j < num_pieces) {
      ub = int(j / splits);
      const int s = int(j % splits), tiles = req[4 * ub + kReqTiles];
      const int t = s * ((tiles + splits - 1) / splits);
      if (s > 0 && t >= tiles) {
        ++ub;
      } else {
        ut = t;
      }
    }
    alt[2 * c] = ub;
    alt[2 * c + 1] = ut;
  }
  __syncthreads();
  const CutPrice bal = price_cut<Reduce>(bounds, req, ctas, overhead, temp.reduce);
  const CutPrice uni = price_cut<Reduce>(alt, req, ctas, overhead, temp.reduce);
  if (threadIdx.x == 0) {
    const float bal_price = float(bal.max_work) + kPieceCost * float(bal.pieces);
    const float uni_price = float(uni.max_work) + kPieceCost * float(uni.pieces);
    use_alt = !(bal_price < kBalancedMargin * uni_price);
    busiest = use_alt ? uni.max_work : bal.max_work;
    out[schedule_kind_offset(batch, ctas)] = use_alt;
  }
  __syncthreads();
  if (use_alt) {
    for (int i = threadIdx.x; i < 2 * (ctas + 1); i += kScheduleThreads) bounds[i] = alt[i];
    __syncthreads();
  }

  // (3) the CTAs covering request b: from the last c with B_c <= (b, 0) to the last c with
  // B_c <= (b, tiles - 1); every CTA in between covers at least one of its tiles (the bounds inside a
  // request are distinct tiles). Requests with several pieces are listed in order for the combine.
  auto last_cta_at = [&](int b, int t) {
    int lo = 0, hi = ctas - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      const int mb = bounds[2 * mid], mt = bounds[2 * mid + 1];
      if (mb < b || (mb == b && mt <= t)) lo = mid; else hi = mid - 1;
    }
    return lo;
  };
  int32_t* segments = out + schedule_segments_offset(batch, ctas);
  int32_t* shared_list = out + schedule_shared_offset(batch, ctas);
  if (threadIdx.x == 0) carry = carry_shared = 0;
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
    Scan(temp.scan).ExclusiveSum(pieces, excl, sum);
    if (b < batch) {
      req[4 * b + kReqFirstPiece] = int(carry + excl);
      for (int j = 0; segment_table && j < pieces; ++j) {  // the segment table in request order, sorted in (4)
        segments[1 + 2 * (carry + excl + j)] = b;
        segments[2 + 2 * (carry + excl + j)] = req[4 * b + kReqFirstCta] + j;
      }
    }
    const int64_t piece_sum = sum;
    __syncthreads();
    const int64_t is_shared = pieces > 1;
    Scan(temp.scan).ExclusiveSum(is_shared, excl, sum);
    if (is_shared) shared_list[1 + carry_shared + excl] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
      carry += piece_sum;
      carry_shared += sum;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) shared_list[0] = int(carry_shared);

  // (4) the segment table, longest first: a stable sort of the request-order table by each segment's
  // cost class, 255 - floor(256 cost / (busiest + 1)) for cost = its tiles + overhead (the hardware
  // starts CTAs in this order, so the short ones fill in behind the long ones: longest processing time
  // first). Tables of more than kSegmentSortItems * kScheduleThreads segments stay in request order, as
  // do batches of 2^20 requests or more and more than 4096 CTAs (a segment sorts as b * 4096 + c).
  // Without segment_table (64-row and fast plans, which walk runs) no table: 0 segments.
  const int64_t num_segments = segment_table ? carry : 0;
  __syncthreads();  // the request-order table and req[] as every thread wrote them
  if (segment_table && num_segments <= int64_t(kSegmentSortItems) * kScheduleThreads && batch < (1 << 20) &&
      ctas <= 4096) {
    uint32_t key[kSegmentSortItems];
    uint32_t seg[kSegmentSortItems];
    #pragma unroll
    for (int j = 0; j < kSegmentSortItems; ++j) {
      const int64_t i = int64_t(threadIdx.x) * kSegmentSortItems + j;  // blocked: the stable order is i's
      key[j] = 255u;
      seg[j] = 0;
      if (i < num_segments) {
        const int b = segments[1 + 2 * i], c = segments[2 + 2 * i];
        const int t0 = bounds[2 * c] == b ? bounds[2 * c + 1] : 0;
        const int t1 = bounds[2 * c + 2] == b ? bounds[2 * c + 3] : req[4 * b + kReqTiles];
        key[j] = 255u - uint32_t((int64_t(t1 - t0) + overhead) * 256 / (busiest + 1));
        seg[j] = (uint32_t(b) << 12) | uint32_t(c);
      }
    }
    __syncthreads();
    Sort(temp.sort).Sort(key, seg, 0, 8);
    #pragma unroll
    for (int j = 0; j < kSegmentSortItems; ++j) {
      const int64_t i = int64_t(threadIdx.x) * kSegmentSortItems + j;
      if (i < num_segments) {
        segments[1 + 2 * i] = int32_t(seg[j] >> 12);
        segments[2 + 2 * i] = int32_t(seg[j] & 4095u);
      }
    }
  }
  if (threadIdx.x == 0) segments[0] = int(num_segments);
}

}  // namespace mla

// Writes the schedule of `batch` requests (seq_lens: device int32 [batch]) for `ctas` CTAs per
// query-row block into `schedule` (device, mla_variants_schedule_ints(batch, ctas) int32 values, 8-byte
// aligned) on `stream`. max_keys: the most keys a request's block-table row addresses; overhead: the
// fixed cost of a request in tiles (>= 1); uniform_splits: the split count of the uniform split the
// balanced cut is priced against (>= 1); segment_table: 1 to write the segment table (a plan that launches
// the transposed path), 0 not. Returns a cudaError_t code.
extern "C" int mla_variants_schedule(const int32_t* seq_lens, int32_t batch, int64_t max_keys, int32_t ctas,
                                     int32_t overhead, int32_t uniform_splits, int32_t segment_table,
                                     int32_t* schedule, void* stream) {
  if (seq_lens == nullptr || schedule == nullptr || batch < 1 || ctas < 1 || overhead < 1 || uniform_splits < 1 ||
      max_keys < 0 || (segment_table != 0 && segment_table != 1) ||
      reinterpret_cast<uintptr_t>(schedule) % 8 != 0) {
    return int(cudaErrorInvalidValue);
  }
  mla::mla_schedule_kernel<<<1, mla::kScheduleThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      seq_lens, batch, max_keys, ctas, overhead, uniform_splits, segment_table != 0, schedule);
  return int(cudaGetLastError());
}

extern "C" int64_t mla_variants_schedule_ints(int32_t batch, int32_t ctas) { return mla::schedule_ints(batch, ctas); }

// Where the schedule records which cut it kept (0 balanced, 1 uniform-equivalent), in int32 values.
extern "C" int64_t mla_variants_schedule_kind_offset(int32_t batch, int32_t ctas) {
  return mla::schedule_kind_offset(batch, ctas);
}

// The schedule's cost model (config.cuh): the tiles a shared request's piece costs, and the margin
// below which the balanced cut is kept. For tests that replay the kernel's choice on the host.
extern "C" void mla_variants_schedule_model(float* piece_cost, float* balanced_margin) {
  *piece_cost = mla::kPieceCost;
  *balanced_margin = mla::kBalancedMargin;
}
