// How fast the tensor cores run the wgmma shapes the decode kernels issue, on their own (a probe, not the
// product). The fp8 fast kernel (templates/mla/fp8_fast.cuh) multiplies in small shapes: S as 18 k-steps of
// m64n64k32 from shared memory, P V as register-sourced m64n64k32 pairs, each pair waited for (the per-tile
// promotion). vLLM's fp8 fork multiplies P V as m64n256k32. This measures, per shape, the tensor work per SM
// cycle when every SM runs one CTA of 1 or 2 warpgroups that issue the same chain over and over:
//
//   chain = warpgroup_arrive; K / k wgmmas m64 nN k (one accumulator); commit; wait 0   (repeated reps times)
//
// and prints cycles per chain (clock64, median over the CTAs), MACs per SM cycle, the fraction of the
// dense peak (4096 fp8 / 2048 16-bit MACs per SM cycle on H100 and H200), and the SM clock the chain ran
// at (clock64 cycles over %globaltimer ns), so a clock drop under the power cap is not read as a slow
// shape. Operands are random finite values, never checked: only the timing matters here.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I $(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include \
//     -o /tmp/wgmma_rate lab/wgmma_rate.cu && /tmp/wgmma_rate [reps]
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

using namespace cute;
using E4 = cutlass::float_e4m3_t;
using BF = cutlass::bfloat16_t;

constexpr int kSmemBytes = 200 * 1024;

// One shape: element type T, N columns, reduction length K per chain, A from registers (RS) or shared
// memory (SS). Both operands K-major (fp8 allows nothing else), the widest swizzle K allows.
// The widest K-major swizzle atom whose row (128, 64 or 32 bytes) divides K's bytes.
template <class T, int K>
auto k_atom() {
  if constexpr ((K * sizeof(T)) % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<T>{};
  } else if constexpr ((K * sizeof(T)) % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<T>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<T>{};
  }
}

template <class T, int N, int K, bool RS>
struct Shape_ {
  using LayoutA = decltype(tile_to_shape(k_atom<T, K>(), Shape<_64, Int<K>>{}));
  using LayoutB = decltype(tile_to_shape(k_atom<T, K>(), Shape<Int<N>, Int<K>>{}));
  static auto op() {
    if constexpr (RS) {
      return GMMA::rs_op_selector<T, T, float, Shape<_64, Int<N>, Int<K>>, GMMA::Major::K, GMMA::Major::K>();
    } else {
      return GMMA::ss_op_selector<T, T, float, Shape<_64, Int<N>, Int<K>>, GMMA::Major::K, GMMA::Major::K>();
    }
  }
  using Mma = decltype(make_tiled_mma(op()));
  using Elem = T;
  static constexpr int kN = N, kK = K;
  static constexpr bool kRS = RS;
  static constexpr int kBOffset = ((64 * K * int(sizeof(T)) + 1023) / 1024) * 1024;
  static_assert(kBOffset + N * K * int(sizeof(T)) <= kSmemBytes, "operands do not fit");
};

// Every warpgroup of the CTA runs `reps` chains on the same shared operands; thread 0 of each warpgroup
// records its clock64 and globaltimer spans. out: per CTA and warpgroup, [cycles, ns].
template <class S>
__global__ void __launch_bounds__(256, 1) rate(long long* out, int reps, int wgs) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using T = typename S::Elem;
  const int tid = threadIdx.x % 128, wg = threadIdx.x / 128;
  // Random finite operands: every byte in 0x00-0x37 (as e4m3, or as either half of a 16-bit value).
  for (int i = threadIdx.x; i < kSmemBytes / 4; i += blockDim.x) {
    const uint32_t x = uint32_t(i) * 2654435761u + 12345u;
    reinterpret_cast<uint32_t*>(smem)[i] = x & 0x37373737u;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (wg >= wgs) return;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem)), typename S::LayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem + S::kBOffset)), typename S::LayoutB{});
  typename S::Mma mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor tA = thr.partition_fragment_A(sA);
  Tensor tB = thr.partition_fragment_B(sB);
  Tensor acc = partition_fragment_C(mma, Shape<_64, Int<S::kN>>{});
  if constexpr (S::kRS) {  // the A registers: finite values
    CUTE_UNROLL
    for (int i = 0; i < size(tA); ++i) tA(i) = T(0.25f * float(1 + (i & 3)));
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) = 0.f;
  long long c0 = 0, c1 = 0;
  uint64_t g0 = 0, g1 = 0;
  for (int r = -2; r < reps; ++r) {  // two untimed chains first
    if (r == 0) {
      c0 = clock64();
      asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(g0));
    }
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) warpgroup_fence_operand(acc(i));
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tA); ++k) cute::gemm(mma, tA(_, _, k), tB(_, _, k), acc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) warpgroup_fence_operand(acc(i));
  }
  c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(g1));
  float keep = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) keep += acc(i);
  if (tid == 0) {
    long long* o = out + 2 * (int64_t(blockIdx.x) * 2 + wg);
    o[0] = c1 - c0;
    o[1] = (long long)(g1 - g0) + (keep == 1.2345e30f ? 1 : 0);  // keeps the accumulators alive
  }
}

template <class S>
static void run(const char* name, int reps, int sms, long long* d_out) {
  constexpr int kMacs = 64 * S::kN * S::kK;
  constexpr int macs_per_clk_peak = sizeof(typename S::Elem) == 1 ? 4096 : 2048;  // dense, per SM cycle
  CHECK(cudaFuncSetAttribute(rate<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  for (int wgs = 1; wgs <= 2; ++wgs) {
    CHECK(cudaMemset(d_out, 0, sizeof(long long) * 4 * sms));
    rate<S><<<sms, 256, kSmemBytes>>>(d_out, reps, wgs);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> h(4 * sms);
    CHECK(cudaMemcpy(h.data(), d_out, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost));
    std::vector<double> cyc, ghz;
    for (int b = 0; b < sms; ++b) {
      for (int w = 0; w < wgs; ++w) {
        const long long c = h[4 * b + 2 * w], ns = h[4 * b + 2 * w + 1];
        cyc.push_back(double(c) / reps);
        if (ns > 0) ghz.push_back(double(c) / double(ns));
      }
    }
    std::sort(cyc.begin(), cyc.end());
    std::sort(ghz.begin(), ghz.end());
    const double med = cyc[cyc.size() / 2];
    const double per_clk = double(kMacs) * wgs / med;
    std::printf("%-34s wgs %d: %8.1f cycles/chain (%.1f-%.1f), %6.0f MAC/clk/SM = %5.1f%% of peak, SM clock %.2f GHz\n",
                name, wgs, med, cyc.front(), cyc.back(), per_clk, 100.0 * per_clk / macs_per_clk_peak,
                ghz.empty() ? 0.0 : ghz[ghz.size() / 2]);
  }
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 2000;
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  long long* d_out = nullptr;
  CHECK(cudaMalloc(&d_out, sizeof(long long) * 4 * sms));
  std::printf("%d CTAs (one per SM), %d chains each; chain = wgmmas into one accumulator, commit, wait 0\n", sms, reps);
  // The fp8 fast kernel's shapes, and the fork's P V.
  run<Shape_<E4, 64, 512, false>>("fp8 SS n64  K512 (S's 16 of 18)", reps, sms, d_out);
  run<Shape_<E4, 64, 576, false>>("fp8 SS n64  K576 (64-byte swizzle)", reps, sms, d_out);
  run<Shape_<E4, 64, 64, true>>("fp8 RS n64  K64  (P V round)", reps, sms, d_out);
  run<Shape_<E4, 64, 256, true>>("fp8 RS n64  K256 (8 k-steps)", reps, sms, d_out);
  run<Shape_<E4, 64, 64, false>>("fp8 SS n64  K64", reps, sms, d_out);
  run<Shape_<E4, 128, 512, false>>("fp8 SS n128 K512", reps, sms, d_out);
  run<Shape_<E4, 256, 64, true>>("fp8 RS n256 K64  (fork's P V)", reps, sms, d_out);
  run<Shape_<E4, 256, 64, false>>("fp8 SS n256 K64", reps, sms, d_out);
  run<Shape_<E4, 256, 512, false>>("fp8 SS n256 K512", reps, sms, d_out);
  // The 16-bit seesaw's shapes, for scale.
  run<Shape_<BF, 64, 576, false>>("bf16 SS n64  K576 (S)", reps, sms, d_out);
  run<Shape_<BF, 256, 64, true>>("bf16 RS n256 K64  (P V)", reps, sms, d_out);
  run<Shape_<BF, 256, 256, false>>("bf16 SS n256 K256", reps, sms, d_out);
  CHECK(cudaFree(d_out));
  return 0;
}
