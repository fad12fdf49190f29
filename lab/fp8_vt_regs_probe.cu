// The fp8 fast mode's P V without a V^T buffer (docs/design.md 3.2, the second way), checked and timed
// on its own (a probe, not the product). One warpgroup computes, for 256 of the 512 latent values:
//   O^T [256 dims x 64 rows] = V^T [256 dims x 64 tokens] P^T [64 tokens x 64 rows]
// with register-sourced fp8 wgmma (m64 n64 k32, e4m3 x e4m3 -> fp32). A = V^T is built in registers from
// the tile as the cache stores it, tokens x 512 bytes in the 128-byte-swizzled K-major layout that
// S = Q K^T reads anyway: per warp and k-step one ldmatrix.trans.x4 (the bytes taken as 16-bit pairs)
// gives each thread two adjacent dims of two adjacent tokens per register, and four byte permutes
// (prmt) give the four A registers. The fragment then holds
//   row m = 16 w + r (r < 8) -> dim 16 w + 2 r,  row 16 w + 8 + r -> dim 16 w + 2 r + 1   (pi)
//   column k = 16 h + 4 q + i -> token 16 h + 8 (i >> 1) + 2 q + (i & 1)                  (sigma)
// so P^T is stored with its tokens in sigma order (P_s[row][k] = P[row][sigma(k)]) and O^T's rows come
// out in pi order. The probe checks:
//   1. the fast fragments against a byte-by-byte fill of the same (pi, sigma) fragment (ldmatrix and
//      prmt mapping);
//   2. O = P V against a CPU product in double (the wgmma register layouts assumed here);
//   3. colsum(V) over the tile's tokens (the centred-P correction, design.md 3.3) from the same A
//      fragments times a B of ones (m64 n8 k32): each thread gets the sums of its own O^T rows;
// then times `reps` rounds of the fast build plus the wgmmas (clock64), the column sums alone, and the same wgmmas on
// fragments built byte by byte and against the shared-memory V^T chain of lab/fp8_wgmma_probe.cu
// (O half: 64 x 256 x 64, about 330 cycles with S).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I <cutlass include> \
//     -o /tmp/fp8_vt_regs_probe lab/fp8_vt_regs_probe.cu && /tmp/fp8_vt_regs_probe
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/float8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>


using namespace cute;
using E4 = cutlass::float_e4m3_t;

constexpr int kTok = 64, kLat = 512, kRows = 64, kDims = 256, kMBlocks = kDims / 64, kKSteps = kTok / 32;

using LayoutV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4>{}, Shape<Int<kTok>, Int<kLat>>{}));
using LayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<E4>{}, Shape<Int<kRows>, Int<kTok>>{}));
using LayoutOnes = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<E4>{}, Shape<_8, Int<kTok>>{}));

struct Smem {
  alignas(1024) E4 v[kTok * kLat];
  alignas(1024) E4 pt[kRows * kTok];  // B operand: [rows x tokens], tokens K-major, in sigma order
  alignas(1024) E4 ones[8 * kTok];    // B operand of the column sums: 8 columns of 1.0
};

__host__ __device__ constexpr int sigma(int k) {  // fragment column -> token
  return 16 * (k >> 4) + 8 * ((k & 3) >> 1) + 2 * ((k >> 2) & 3) + (k & 1);
}
__host__ __device__ constexpr int pi(int m) {  // fragment row (0..63 of an m-block) -> dim within it
  return 16 * (m >> 4) + 2 * (m & 7) + ((m >> 3) & 1);
}

// The A registers of (m-block mb, k-step ks) for this thread, fast: ldmatrix.trans.x4 + 4 prmt.
__device__ __forceinline__ void a_fast(const Smem& s, int mb, int ks, int warp, int lane, uint32_t (&a)[4]) {
  Tensor sv = make_tensor(make_smem_ptr(s.v), LayoutV{});
  const int j = lane / 8, i = lane % 8;                 // matrix j: tokens 8 j .. 8 j + 7 of the k-step
  const E4* row = &sv(ks * 32 + 8 * j + i, mb * 64 + warp * 16);  // 16 contiguous bytes: the warp's 16 dims
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(row));
  uint32_t r0, r1, r2, r3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  // r_j = {(t, 2p), (t, 2p + 1), (t + 1, 2p), (t + 1, 2p + 1)} with t = 8 j + 2 (lane % 4), p = lane / 4
  a[0] = __byte_perm(r0, r1, 0x6420);  // dim 2p:     tokens 2q, 2q + 1, 8 + 2q, 9 + 2q
  a[1] = __byte_perm(r0, r1, 0x7531);  // dim 2p + 1
  a[2] = __byte_perm(r2, r3, 0x6420);  // dim 2p, tokens + 16
  a[3] = __byte_perm(r2, r3, 0x7531);
}

// The same registers byte by byte from the (pi, sigma) definition and the assumed wgmma A layout
// (register g of thread (warp, lane): row 16 warp + lane / 4 + 8 (g & 1), columns 16 (g >> 1) + 4 (lane % 4) + 0..3).
__device__ __forceinline__ void a_slow(const Smem& s, int mb, int ks, int warp, int lane, uint32_t (&a)[4]) {
  Tensor sv = make_tensor(make_smem_ptr(s.v), LayoutV{});
  for (int g = 0; g < 4; ++g) {
    const int m = 16 * warp + lane / 4 + 8 * (g & 1);
    uint32_t w = 0;
    for (int b = 0; b < 4; ++b) {
      const int k = 16 * (g >> 1) + 4 * (lane % 4) + b;
      const E4 e = sv(ks * 32 + sigma(k), mb * 64 + pi(m));
      w |= uint32_t(reinterpret_cast<const uint8_t&>(e)) << (8 * b);
    }
    a[g] = w;
  }
}

__device__ __forceinline__ void wgmma_64x64x32(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[32], bool zero) {
  using namespace cute::SM90::GMMA;
  MMA_64x64x32_F32E4M3E4M3_RS_TN<>::fma(a[0], a[1], a[2], a[3], desc_b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7],
                                        d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15], d[16], d[17], d[18],
                                        d[19], d[20], d[21], d[22], d[23], d[24], d[25], d[26], d[27], d[28], d[29],
                                        d[30], d[31], zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
}

__device__ __forceinline__ void wgmma_64x8x32(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[4], bool zero) {
  using namespace cute::SM90::GMMA;
  MMA_64x8x32_F32E4M3E4M3_RS_TN<>::fma(a[0], a[1], a[2], a[3], desc_b, d[0], d[1], d[2], d[3],
                                       zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
}

// Orders the accumulators around the asynchronous wgmmas (before the first arrive, after the wait).
template <int N>
__device__ __forceinline__ void fence_acc(float (&x)[kMBlocks][N]) {
  CUTE_UNROLL
  for (int mb = 0; mb < kMBlocks; ++mb) {
    CUTE_UNROLL
    for (int e = 0; e < N; ++e) warpgroup_fence_operand(x[mb][e]);
  }
}

// acc += V^T B over the tile's 64 tokens for the warpgroup's 4 m-blocks, A = V^T from registers (fast:
// ldmatrix + prmt; else byte by byte), B [N x 64 tokens] K-major in shared memory: P^T (N 64) or the
// ones of the column sums (N 8; then every column of a thread's result holds the same sum).
template <bool kFast, int N, class TensorB>
__device__ __forceinline__ void vt_chain(const Smem& s, const TensorB& sb, int warp, int lane,
                                         float (&acc)[kMBlocks][N / 2]) {
  fence_acc(acc);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int mb = 0; mb < kMBlocks; ++mb) {
    CUTE_UNROLL
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[4];
      if constexpr (kFast) a_fast(s, mb, ks, warp, lane, a); else a_slow(s, mb, ks, warp, lane, a);
      const uint64_t desc = uint64_t(GMMA::make_gmma_desc<GMMA::Major::K>(
          local_tile(sb, Shape<Int<N>, _32>{}, make_coord(0, ks))));
      if constexpr (N == 8) wgmma_64x8x32(a, desc, acc[mb], ks == 0); else wgmma_64x64x32(a, desc, acc[mb], ks == 0);
    }
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  fence_acc(acc);
}

// O^T = V^T P^T for this thread's accumulators.
template <bool kFast>
__device__ __forceinline__ void pv(const Smem& s, int warp, int lane, float (&o)[kMBlocks][32]) {
  vt_chain<kFast, kRows>(s, make_tensor(make_smem_ptr(s.pt), LayoutPt{}), warp, lane, o);
}

// The column sums of V over the tile's tokens for this thread's O^T rows, from the same A fragments:
// cs[mb][0] and cs[mb][2] are the sums of rows m = 16 warp + lane / 4 and m + 8 of m-block mb.
__device__ __forceinline__ void colsum(const Smem& s, int warp, int lane, float (&cs)[kMBlocks][4]) {
  vt_chain<true, 8>(s, make_tensor(make_smem_ptr(s.ones), LayoutOnes{}), warp, lane, cs);
}

__device__ __forceinline__ Smem& load_tile(char* smem_raw, const uint8_t* v, const uint8_t* p) {
  Smem& s = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (reinterpret_cast<uintptr_t>(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x;
  Tensor sv = make_tensor(make_smem_ptr(s.v), LayoutV{});
  Tensor spt = make_tensor(make_smem_ptr(s.pt), LayoutPt{});
  for (int i = tid; i < kTok * kLat; i += 128) sv(i / kLat, i % kLat) = reinterpret_cast<const E4*>(v)[i];
  for (int i = tid; i < kRows * kTok; i += 128) {
    const int r = i / kTok, k = i % kTok;
    spt(r, k) = reinterpret_cast<const E4*>(p)[r * kTok + 32 * (k / 32) + sigma(k % 32)];
  }
  Tensor sones = make_tensor(make_smem_ptr(s.ones), LayoutOnes{});
  for (int i = tid; i < 8 * kTok; i += 128) sones(i / kTok, i % kTok) = E4(1.f);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  return s;
}

// v: [tokens][512] raw bytes; p: [rows][tokens] bytes; out: O [rows][256 dims] fp32; bad: fragment mismatches.
__global__ void __launch_bounds__(128, 1) check(const uint8_t* v, const uint8_t* p, float* out, int* bad,
                                                float* sums) {
  extern __shared__ char smem_raw[];
  const Smem& s = load_tile(smem_raw, v, p);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int mismatches = 0;
  for (int mb = 0; mb < kMBlocks; ++mb) {
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t f[4], g[4];
      a_fast(s, mb, ks, warp, lane, f);
      a_slow(s, mb, ks, warp, lane, g);
      for (int r = 0; r < 4; ++r) mismatches += f[r] != g[r];
    }
  }
  atomicAdd(bad, mismatches);
  float o[kMBlocks][32];
  pv<true>(s, warp, lane, o);
  for (int mb = 0; mb < kMBlocks; ++mb) {  // the accumulator layout: row m, column n of the m-block
    for (int j = 0; j < 8; ++j) {
      for (int e = 0; e < 4; ++e) {
        const int m = 16 * warp + lane / 4 + 8 * (e >> 1), n = 8 * j + 2 * (lane % 4) + (e & 1);
        out[n * kDims + mb * 64 + pi(m)] = o[mb][4 * j + e];
      }
    }
  }
  float cs[kMBlocks][4];
  colsum(s, warp, lane, cs);
  if (lane % 4 == 0) {  // columns 0-1 of the n8 result; every column holds the same sum
    for (int mb = 0; mb < kMBlocks; ++mb) {
      sums[mb * 64 + pi(16 * warp + lane / 4)] = cs[mb][0];
      sums[mb * 64 + pi(16 * warp + lane / 4 + 8)] = cs[mb][2];
    }
  }
}

// Cycles per round of `round` over `reps` rounds, by this thread's clock (the timing kernels use thread 0's).
template <class Round>
__device__ __forceinline__ long long cycles_per_round(int reps, Round round) {
  const long long t0 = clock64();
  for (int r = 0; r < reps; ++r) round();
  return (clock64() - t0) / reps;
}

// Cycles per round of the column sums alone (the centred-P correction's extra wgmmas).
__global__ void __launch_bounds__(128, 1) timing_colsum(const uint8_t* v, const uint8_t* p, int reps, long long* cycles,
                                                        float* sink) {
  extern __shared__ char smem_raw[];
  const Smem& s = load_tile(smem_raw, v, p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float cs[kMBlocks][4];
  const long long c = cycles_per_round(reps, [&] { colsum(s, warp, lane, cs); });
  sink[threadIdx.x] = cs[0][0] + cs[kMBlocks - 1][3];
  if (threadIdx.x == 0) *cycles = c;
}

// Cycles per round of pv<kFast> over `reps` rounds (thread 0's clock).
template <bool kFast>
__global__ void __launch_bounds__(128, 1) timing(const uint8_t* v, const uint8_t* p, int reps, long long* cycles,
                                                 float* sink) {
  extern __shared__ char smem_raw[];
  const Smem& s = load_tile(smem_raw, v, p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float o[kMBlocks][32];
  const long long c = cycles_per_round(reps, [&] { pv<kFast>(s, warp, lane, o); });
  float acc = 0.f;
  CUTE_UNROLL
  for (int mb = 0; mb < kMBlocks; ++mb) {
    CUTE_UNROLL
    for (int e = 0; e < 32; ++e) acc += o[mb][e];  // static indices: the accumulators stay in registers
  }
  sink[threadIdx.x] = acc;
  if (threadIdx.x == 0) *cycles = c;
}

static double e4m3(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  if (exp == 15 && man == 7) return NAN;
  const double v = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -v : v;
}

int main() {
  std::vector<uint8_t> v(kTok * kLat), p(kRows * kTok);
  srand(5);
  auto rnd = [] {  // finite e4m3 bytes, |x| below 8
    uint8_t b;
    do b = uint8_t(rand() & 0xff); while (((b >> 3) & 15) > 9 || ((b & 0x7f) == 0x7f));
    return b;
  };
  for (auto& b : v) b = rnd();
  for (auto& b : p) b = rnd() & 0x7f;  // P >= 0
  uint8_t *dv, *dp;
  float *dout, *dsink, *dsums;
  int* dbad;
  long long* dcyc;
  cudaMalloc(&dv, v.size());
  cudaMalloc(&dp, p.size());
  cudaMalloc(&dout, kRows * kDims * sizeof(float));
  cudaMalloc(&dsink, 128 * sizeof(float));
  cudaMalloc(&dbad, sizeof(int));
  cudaMalloc(&dcyc, 3 * sizeof(long long));
  cudaMalloc(&dsums, kDims * sizeof(float));
  cudaMemcpy(dv, v.data(), v.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size(), cudaMemcpyHostToDevice);
  cudaMemset(dbad, 0, sizeof(int));
  const int smem = int(sizeof(Smem)) + 1024;
  cudaFuncSetAttribute(check, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(timing<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(timing<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(timing_colsum, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check<<<1, 128, smem>>>(dv, dp, dout, dbad, dsums);
  timing_colsum<<<1, 128, smem>>>(dv, dp, 200, dcyc + 2, dsink);
  timing<true><<<1, 128, smem>>>(dv, dp, 200, dcyc, dsink);
  timing<false><<<1, 128, smem>>>(dv, dp, 200, dcyc + 1, dsink);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("launch failed: %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::vector<float> out(kRows * kDims);
  int bad = 0;
  long long cyc[3];
  std::vector<float> sums(kDims);
  cudaMemcpy(sums.data(), dsums, kDims * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(&bad, dbad, sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemcpy(cyc, dcyc, sizeof cyc, cudaMemcpyDeviceToHost);
  double worst = 0.0;
  for (int n = 0; n < kRows; ++n) {
    for (int d = 0; d < kDims; ++d) {
      double ref = 0.0, mag = 0.0;
      for (int t = 0; t < kTok; ++t) {
        const double x = e4m3(p[n * kTok + t]) * e4m3(v[t * kLat + d]);
        ref += x;
        mag += std::fabs(x);
      }
      worst = std::fmax(worst, std::fabs(out[n * kDims + d] - ref) / (mag > 0 ? mag : 1.0));
    }
  }
  double worst_sum = 0.0;
  for (int d = 0; d < kDims; ++d) {
    double ref = 0.0, mag = 0.0;
    for (int t = 0; t < kTok; ++t) {
      ref += e4m3(v[t * kLat + d]);
      mag += std::fabs(e4m3(v[t * kLat + d]));
    }
    worst_sum = std::fmax(worst_sum, std::fabs(sums[d] - ref) / (mag > 0 ? mag : 1.0));
  }
  std::printf("colsum(V) from the A fragments x ones (m64 n8 k32): max |err| / sum |v| = %.2e  %s\n", worst_sum,
              worst_sum < 1e-2 ? "checked" : "WRONG");
  std::printf("fragments: %d of %d registers differ from the byte-by-byte fill  %s\n", bad,
              128 * 4 * kMBlocks * kKSteps, bad ? "WRONG" : "checked");
  std::printf("O = P V (V^T from registers): max |err| / sum |products| = %.2e  %s\n", worst,
              worst < 1e-2 ? "checked" : "WRONG");
  std::printf("per round (64 x 256 x 64, one warpgroup): ldmatrix + prmt + wgmma %lld cycles; byte-by-byte fill %lld; "
              "colsum alone %lld\n", cyc[0], cyc[1], cyc[2]);
  return bad != 0 || !(worst < 1e-2) || !(worst_sum < 1e-2);
}
