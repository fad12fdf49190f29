// Device primitives of the Hopper architecture that every role uses: the named-barrier ids, cp.async,
// mbarrier and TMA (cp.async.bulk.tensor) wrappers, proxy fences and dtype conversions.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "config.cuh"

namespace mla {

// ---------------------------------------------------------------------------------------------
// Named barriers (bar.sync / bar.arrive ids; 0 is __syncthreads), all of them here. Each id names who
// meets there.
// 64-row path, the two math warpgroups' seesaw hand-over (consumer_rows64.cuh; 256 threads, one side
// arrives, the other waits):
constexpr int kBarMaxA = 1;    // warpgroup 0 published the row max after its tile (row_max[0])
constexpr int kBarPA = 2;      // warpgroup 0's P is in its tile's RoPE slot
constexpr int kBarMaxPB = 3;   // warpgroup 1 published the row max after its tile (row_max[1]) and its P
constexpr int kBarOwnP = 4;    // + wg (4, 5): the warpgroup's own four warps finished writing P (128 threads);
                               // in the fp8 fast kernel, P V warpgroup wg's staged O is complete
constexpr int kBarEnd = 6;     // both warpgroups' row sums are in row_sum (the 64-row epilogue); in the fp8
                               // fast kernel, all 384 math threads: row_factor written, Q and P^T read
// 64-row path, the fp8 producer (producer_fp8.cuh):
constexpr int kBarFp8Copy = 7;  // the 64 copy threads (TMA tiles: warp 1 waits for warp 0's issue loop)
constexpr int kBarWiden = 8;    // the 64 widening threads: every raw byte of a slot read before fp16 lands on it
// transposed path (consumer_st.cuh, consumer_st_fp8.cuh):
constexpr int kBarStWg = 9;      // + wg (9, 10, 11): the 128 threads of one math warpgroup
constexpr int kBarStMerge = 12;  // all math warpgroups: statistics and O exchange at the end
// every path:
constexpr int kBarProducer = 13;  // the 128 producer threads (TMA tiles: warps 1-3 wait for warp 0's issue loop)
constexpr int kBarStQ = 14;       // all math warpgroups of the transposed fp8 path: Q rounded to fp16
// fp8 fast kernel (fp8_fast.cuh):
constexpr int kBarQ = 15;  // its 384 math threads: Q rounded to e4m3 and stored

// ---------------------------------------------------------------------------------------------
// Copies, barriers, fences and conversions.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Wait for every cp.async this thread issued.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Close this thread's cp.async issued since its last commit into a group (none issued: an empty group),
// and wait until at most N of its most recent groups are pending. Only the 64-row fp8 producer
// (produce_fp8) commits groups (Q's copies, then tile 0's); every other wait is cp_async_wait_all.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// 16-byte copy that writes zeros and reads nothing when !valid (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// The mbarrier receives one arrival once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)));
}
// Orders this thread's earlier shared-memory accesses (generic proxy, cp.async included) before later
// async-proxy accesses (wgmma operand reads). The "memory" clobber also keeps the compiler from moving
// shared-memory stores past it (cutlass::arch::fence_view_async_shared has none).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four e4m3 values (one 32-bit word, lowest byte first) -> four fp16 values (two words), exactly.
__device__ __forceinline__ uint2 e4m3x4_to_f16x4(uint32_t v) {
  uint2 r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"(v));
  return r;
}
// Two bf16 values (one word, lower element first) -> two fp16 values times kFp8QPrescale.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2_prescaled(uint32_t v) {
  __half2 h = __floats2half2_rn(__uint_as_float(v << 16) * kFp8QPrescale,
                                __uint_as_float(v & 0xffff0000u) * kFp8QPrescale);
  return *reinterpret_cast<uint32_t*>(&h);
}
// Eight bf16 values (a 16-byte chunk) -> eight fp16 values times kFp8QPrescale.
__device__ __forceinline__ uint4 bf16x8_to_f16x8_prescaled(uint4 v) {
  return make_uint4(bf16x2_to_f16x2_prescaled(v.x), bf16x2_to_f16x2_prescaled(v.y), bf16x2_to_f16x2_prescaled(v.z),
                    bf16x2_to_f16x2_prescaled(v.w));
}

// Barrier `id` over the kMathThreads math threads only (256, or 384 with three math warpgroups); the
// producer never takes part. One side of a hand-over arrives (its shared-memory writes before the arrive are visible to the waiters), the
// other waits with math_barrier.
template <int kMathThreads = 128 * kNumWarpgroups>
__device__ __forceinline__ void math_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kMathThreads) : "memory");
}
// The same named barrier reached from different code, as warp-specialized roles do (fp8_fast.cuh): PTX's
// bar.sync is barrier.sync.aligned, which every thread must reach through the same instruction, so
// these take barrier.sync without .aligned (synccheck reports the aligned form as divergence).
template <int kThreads>
__device__ __forceinline__ void role_barrier(int id) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void math_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(128 * kNumWarpgroups) : "memory");
}
// Barrier `id` over the 128 threads of one math warpgroup.
__device__ __forceinline__ void warpgroup_barrier(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
// mbarrier wait (acquire) and arrive (release) with "memory" clobbers, so the compiler keeps this
// thread's plain shared-memory loads after the wait and its stores before the arrive (CUTLASS's
// ClusterBarrier::wait / arrive have no clobber).
__device__ __forceinline__ void wait_barrier(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred p;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, 0x989680;\n"
      "@!p bra wait_%=;\n}\n" ::"r"(smem_u32(bar)), "r"(uint32_t(parity))
      : "memory");
}
__device__ __forceinline__ void arrive_barrier(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// TMA (cp.async.bulk.tensor) pieces. The elected thread announces the bytes a copy will deliver on
// the mbarrier (this also counts as its arrival), then issues the copy, which completes the
// transaction on that mbarrier. The tensor map lives in the kernel's parameter space
// (__grid_constant__), addressed generically.
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// `count` arrivals at once (the TMA producer thread arrives for the whole producer warpgroup).
__device__ __forceinline__ void arrive_barrier_count(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// The map's box (tma_map.cuh: 64 tokens x 64 16-bit values, 64 tokens x 64 bytes for the fp8 producer,
// or 64 tokens x 128 bytes for the fp8 fast kernel) at coordinates (c0, c1, c2) into shared memory at
// smem_dst (1024-byte aligned, so a 128-byte swizzle is the one wgmma reads).
__device__ __forceinline__ void tma_load_3d(uint32_t smem_dst, const void* tensor_map, uint64_t* bar, int c0,
                                            int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(smem_dst), "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

template <class Element>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<cutlass::bfloat16_t>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<cutlass::half_t>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The two 16-bit values of a pack2 word, widened (exactly) to fp32.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<cutlass::bfloat16_t>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<cutlass::half_t>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// 2^x for the online softmax (its weights p and factors alpha): one MUFU.EX2. exp2f wraps the same
// instruction in a range test and two multiplies that keep results below 2^-126 as subnormals; here
// they are flushed to 0 (bit-identical to exp2f otherwise). Such a weight moves its row's sum (>= 1)
// by less than an ulp and out by less than 2^-126 max|v| / sum. exp2_ftz(-inf) = 0 and NaN stays NaN.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace mla
