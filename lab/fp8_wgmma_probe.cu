// The fp8 tensor-core operations of a planned fast mode, checked and timed on their own (a probe, not
// the product; docs/design.md 3.1-3.2). One warpgroup runs, from shared memory:
//   S [64 rows x 64 tokens]  = Q8 [64 x 512] K8^T        e4m3 x e4m3 -> fp32, both K-major, 128-byte swizzle
//                                                         (K8: the cache's raw latent bytes, tokens x 512)
//   O [64 rows x 512]        = P8 [64 x 64 tokens] V8     e4m3 x e4m3 -> fp32, V8 given as V^T (512 x 64
//                                                         tokens, K-major, 64-byte swizzle), two 256-column halves
// on random e4m3 operands, writes S and O to global memory and compares them with a CPU product in
// double precision (fp8 wgmma adds its products into a reduced-precision accumulator, so the bound is
// relative to the sum of |products|). Then it times `reps` rounds of both chains (clock64), against
// the bf16 chains of the same shapes (S over 576 columns, O over 512) that the seesaw issues per tile.
// Last, one 64-token tile end to end (tile_probe): S in e4m3, the softmax, P in e4m3 either plain (x 2^8)
// or centred per row (P = c + P', P' on a per-row power-of-2 scale, O = P'V / scale + c colsum(V); design.md
// 3.1), O in e4m3, against the CPU's softmax in double, on a flat and a peaked score distribution. The
// same computation emulated in torch on another draw of these inputs: flat (score std 0.017) centred
// 5.3e-5 / plain 2.4e-3 max |out err|, peaked (std 2) 9.7e-3 / 9.7e-3 (max |out| 0.08 / 0.53).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I $(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include \
//     -o /tmp/fp8_wgmma_probe lab/fp8_wgmma_probe.cu && /tmp/fp8_wgmma_probe
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

using namespace cute;
using E4 = cutlass::float_e4m3_t;
using BF = cutlass::bfloat16_t;


constexpr int kM = 64, kN = 64, kLat = 512, kHalf = 256;

using LayoutQ8 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4>{}, Shape<Int<kM>, Int<kLat>>{}));
using LayoutK8 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4>{}, Shape<Int<kN>, Int<kLat>>{}));
using LayoutVt8 = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<E4>{}, Shape<Int<kLat>, Int<kN>>{}));
using LayoutP8 = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<E4>{}, Shape<Int<kM>, Int<kN>>{}));
using MmaS8 = decltype(make_tiled_mma(GMMA::ss_op_selector<E4, E4, float, Shape<Int<kM>, Int<kN>, Int<kLat>>>()));
using MmaO8 = decltype(make_tiled_mma(GMMA::ss_op_selector<E4, E4, float, Shape<Int<kM>, Int<kHalf>, Int<kN>>,
                                                           GMMA::Major::K, GMMA::Major::K>()));
// The bf16 chains of the seesaw, for the timing comparison (operands left as whatever shared memory holds).
using LayoutQ16 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<BF>{}, Shape<Int<kM>, Int<576>>{}));
using LayoutK16 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<BF>{}, Shape<Int<kN>, Int<576>>{}));
using LayoutVt16 = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<BF>{}, Shape<Int<kLat>, Int<kN>>{}, Step<_2, _1>{}));
using LayoutP16 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<BF>{}, Shape<Int<kM>, Int<kN>>{}));
using MmaS16 = decltype(make_tiled_mma(GMMA::ss_op_selector<BF, BF, float, Shape<Int<kM>, Int<kN>, Int<576>>>()));
using MmaO16 = decltype(make_tiled_mma(GMMA::ss_op_selector<BF, BF, float, Shape<Int<kM>, Int<kHalf>, Int<kN>>,
                                                            GMMA::Major::K, GMMA::Major::MN>()));

struct Smem8 {
  alignas(1024) E4 q[kM * kLat];
  alignas(1024) E4 k[kN * kLat];
  alignas(1024) E4 vt[kLat * kN];
  alignas(1024) E4 p[kM * kN];
};
struct Smem16 {
  alignas(1024) BF q[kM * 576];
  alignas(1024) BF k[kN * 576];
  alignas(1024) BF p[kM * kN];
};

template <class Mma, class TA, class TB, class Frag>
__device__ __forceinline__ void chain(Mma& mma, const TA& a, const TB& b, Frag& acc, bool zero) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) warpgroup_fence_operand(acc(i));
  warpgroup_arrive();
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

__device__ __forceinline__ E4 e4m3_of(uint8_t b) {
  E4 x;
  x.storage = b;
  return x;
}

// Q, K and V^T from row-major bytes (q [64 x 512], k and v [64 tokens x 512]) into their swizzled
// shared-memory layouts, by the warpgroup's 128 threads.
// The fp8 probe's shared tiles as CuTe tensors.
struct Views8 {
  decltype(make_tensor(make_smem_ptr(static_cast<E4*>(nullptr)), LayoutQ8{})) q;
  decltype(make_tensor(make_smem_ptr(static_cast<E4*>(nullptr)), LayoutK8{})) k;
  decltype(make_tensor(make_smem_ptr(static_cast<E4*>(nullptr)), LayoutVt8{})) vt;
  decltype(make_tensor(make_smem_ptr(static_cast<E4*>(nullptr)), LayoutP8{})) p;
};
__device__ __forceinline__ Views8 views8(Smem8& s) {
  return {make_tensor(make_smem_ptr(s.q), LayoutQ8{}), make_tensor(make_smem_ptr(s.k), LayoutK8{}),
          make_tensor(make_smem_ptr(s.vt), LayoutVt8{}), make_tensor(make_smem_ptr(s.p), LayoutP8{})};
}

// Q, K and V^T into their tiles (row-major bytes in), then the fence and barrier before the wgmmas;
// p (nullable): P's bytes too.
__device__ __forceinline__ void load_operands(Smem8& s, const uint8_t* q, const uint8_t* k, const uint8_t* v,
                                              const uint8_t* p, int tid) {
  const Views8 x = views8(s);
  for (int i = tid; i < kM * kLat; i += 128) {
    x.q(i / kLat, i % kLat) = e4m3_of(q[i]);
    x.k(i / kLat, i % kLat) = e4m3_of(k[i]);
    x.vt(i % kLat, i / kLat) = e4m3_of(v[i]);  // V^T: latent column d's 64 tokens contiguous (before the swizzle)
  }
  if (p != nullptr) {
    for (int i = tid; i < kM * kN; i += 128) x.p(i / kN, i % kN) = e4m3_of(p[i]);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

// Inputs as row-major bytes: q [64 x 512], k [64 tokens x 512], v [64 tokens x 512] (the cache's V),
// p [64 x 64]. Outputs: s [64 x 64], o [64 x 512] row-major fp32; cycles[0..1]: fp8 and bf16 per round.
__global__ void __launch_bounds__(128, 1) probe(const uint8_t* q, const uint8_t* k, const uint8_t* v, const uint8_t* p,
                                                float* s_out, float* o_out, long long* cycles, int reps) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem8& s = *reinterpret_cast<Smem8*>(smem_raw);
  const int tid = threadIdx.x;
  load_operands(s, q, k, v, p, tid);
  auto [sQ, sK, sVt, sP] = views8(s);

  MmaS8 mma_s;
  MmaO8 mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
  Tensor tOrP = thr_o.partition_fragment_A(sP);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kHalf>>{});

  chain(mma_s, tSrQ, tSrK, tSrS, true);
  warpgroup_wait<0>();
  Tensor gS = make_tensor(make_gmem_ptr(s_out), make_layout(make_shape(Int<kM>{}, Int<kN>{}), LayoutRight{}));
  Tensor tSgS = thr_s.partition_C(gS);
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); ++i) tSgS(i) = tSrS(i);
  for (int half = 0; half < 2; ++half) {
    Tensor tOrV = thr_o.partition_fragment_B(local_tile(sVt, Shape<Int<kHalf>, Int<kN>>{}, make_coord(half, 0)));
    chain(mma_o, tOrP, tOrV, tOrO, true);
    warpgroup_wait<0>();
    Tensor gO = make_tensor(make_gmem_ptr(o_out + half * kHalf),
                            make_layout(make_shape(Int<kM>{}, Int<kHalf>{}), make_stride(Int<kLat>{}, _1{})));
    Tensor tOgO = thr_o.partition_C(gO);
    CUTE_UNROLL
    for (int i = 0; i < size(tOrO); ++i) tOgO(i) = tOrO(i);
  }

  // Timing: per round, S then both halves of O, as one warpgroup's share of a tile (fp8) ...
  __syncthreads();
  long long t0 = clock64();
  Tensor tOrV0 = thr_o.partition_fragment_B(local_tile(sVt, Shape<Int<kHalf>, Int<kN>>{}, make_coord(0, 0)));
  for (int r = 0; r < reps; ++r) {
    chain(mma_s, tSrQ, tSrK, tSrS, true);
    chain(mma_o, tOrP, tOrV0, tOrO, false);
    warpgroup_wait<0>();
  }
  long long t1 = clock64();
  // ... and the seesaw's bf16 chains: S over 576 columns, one 256-column half of O (operands not checked).
  __syncthreads();
  Smem16& h = *reinterpret_cast<Smem16*>(smem_raw);
  Tensor hQ = make_tensor(make_smem_ptr(h.q), LayoutQ16{});
  Tensor hK = make_tensor(make_smem_ptr(h.k), LayoutK16{});
  Tensor hP = make_tensor(make_smem_ptr(h.p), LayoutP16{});
  Tensor hVt = make_tensor(make_smem_ptr(h.k), LayoutVt16{});
  MmaS16 mma_s16;
  MmaO16 mma_o16;
  auto thr_s16 = mma_s16.get_thread_slice(tid);
  auto thr_o16 = mma_o16.get_thread_slice(tid);
  Tensor tHrQ = thr_s16.partition_fragment_A(hQ);
  Tensor tHrK = thr_s16.partition_fragment_B(hK);
  Tensor tHrP = thr_o16.partition_fragment_A(hP);
  Tensor tHrV = thr_o16.partition_fragment_B(local_tile(hVt, Shape<Int<kHalf>, Int<kN>>{}, make_coord(0, 0)));
  Tensor tHrS = partition_fragment_C(mma_s16, Shape<Int<kM>, Int<kN>>{});
  long long t2 = clock64();
  for (int r = 0; r < reps; ++r) {
    chain(mma_s16, tHrQ, tHrK, tHrS, true);
    chain(mma_o16, tHrP, tHrV, tOrO, false);
    warpgroup_wait<0>();
  }
  long long t3 = clock64();
  if (tid == 0) {
    cycles[0] = (t1 - t0) / reps;
    cycles[1] = (t3 - t2) / reps;
  }
  if (tid == 0 && tHrS(0) == 12345.f && tOrO(0) == 12345.f) cycles[2] = 1;  // keep the timed results alive
}

// Two floats to two e4m3 bytes, lo in the low byte (satfinite: beyond +-448 saturates).
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// One tile, one warpgroup: S = Q8 K8^T, softmax with score scale `scale_log2` (log2 units), P to e4m3
// (kCentre: centred per row), O = P8 V8 (V = the first 512 columns of K's rows, as in MLA), normalised.
// out [64 x 512] fp32, lse [64] (natural log).
template <bool kCentre>
__global__ void __launch_bounds__(128, 1) tile_probe(const uint8_t* q, const uint8_t* k, float scale_log2, float* out,
                                                     float* lse) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem8& s = *reinterpret_cast<Smem8*>(smem_raw);
  float* colsum = reinterpret_cast<float*>(smem_raw + sizeof(Smem8));  // [kLat]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int d = tid; d < kLat; d += 128) {  // the tile's column sums of V, in fp32
    float a = 0.f;
    for (int t = 0; t < kN; ++t) a += float(e4m3_of(k[t * kLat + d]));
    colsum[d] = a;
  }
  load_operands(s, q, k, k, nullptr, tid);  // V is K's latent columns; the barrier also covers colsum
  auto [sQ, sK, sVt, sP] = views8(s);
  MmaS8 mma_s;
  MmaO8 mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
  chain(mma_s, tSrQ, tSrK, tSrS, true);
  warpgroup_wait<0>();
  // Accumulator element i of this thread: row 16 warp + lane / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) +
  // 2 (lane % 4) + (i & 1); a row's 64 columns are spread over the 4 lanes of a quad.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, c[2] = {0.f, 0.f}, amax[2] = {0.f, 0.f}, sc[2];
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); ++i) m[(i >> 1) & 1] = fmaxf(m[(i >> 1) & 1], tSrS(i) * scale_log2);
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffff, m[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffff, m[r], 2));
  }
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); ++i) {
    tSrS(i) = exp2f(tSrS(i) * scale_log2 - m[(i >> 1) & 1]);
    l[(i >> 1) & 1] += tSrS(i);
  }
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    // Centre a flat row only (mean p above 1/4): on a peaked row most p are near 0 already, and the
    // CPU emulation found centring it slightly worse (docs/design.md 3.1).
    c[r] = kCentre && l[r] > 0.25f * float(kN) ? l[r] / float(kN) : 0.f;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); ++i) amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fabsf(tSrS(i) - c[(i >> 1) & 1]));
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffff, amax[r], 1));
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffff, amax[r], 2));
    sc[r] = kCentre ? (amax[r] > 0.f ? exp2f(floorf(log2f(448.f / amax[r]))) : 1.f) : 256.f;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); i += 2) {
    const int r = (i >> 1) & 1, row = 16 * warp + lane / 4 + 8 * r, col = 8 * (i >> 2) + 2 * (lane % 4);
    *reinterpret_cast<uint16_t*>(&sP(row, col)) =
        pack_e4m3x2((tSrS(i) - c[r]) * sc[r], (tSrS(i + 1) - c[r]) * sc[r]);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  Tensor tOrP = thr_o.partition_fragment_A(sP);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kHalf>>{});
  for (int half = 0; half < 2; ++half) {
    Tensor tOrV = thr_o.partition_fragment_B(local_tile(sVt, Shape<Int<kHalf>, Int<kN>>{}, make_coord(half, 0)));
    chain(mma_o, tOrP, tOrV, tOrO, true);
    warpgroup_wait<0>();
    CUTE_UNROLL
    for (int i = 0; i < size(tOrO); ++i) {
      const int r = (i >> 1) & 1, row = 16 * warp + lane / 4 + 8 * r;
      const int col = half * kHalf + 8 * (i >> 2) + 2 * (lane % 4) + (i & 1);
      out[row * kLat + col] = (tOrO(i) / sc[r] + c[r] * colsum[col]) / l[r];
    }
  }
  if (lane % 4 == 0) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) lse[16 * warp + lane / 4 + 8 * r] = (m[r] + log2f(l[r])) * 0.6931471805599453f;
  }
}

static double e4m3(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double x = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -x : x;
}

int main() {
  srand(3);
  auto rnd = [](int n, int max_exp) {  // finite e4m3 bytes with exponent field <= max_exp
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = uint8_t(((rand() % (max_exp + 1)) << 3) | (rand() & 7) | ((rand() & 1) << 7));
    return v;
  };
  std::vector<uint8_t> q = rnd(kM * kLat, 9), k = rnd(kN * kLat, 9), v = rnd(kN * kLat, 9), p = rnd(kM * kN, 7);
  for (auto& b : p) b &= 0x7f;  // P' may be negative after centring; keep both signs in q, k, v and half of p
  for (int i = 0; i < kM * kN; i += 2) p[i] |= 0x80;
  uint8_t *dq, *dk, *dv, *dp;
  float *ds, *dout;
  long long* dc;
  CHECK(cudaMalloc(&dq, q.size()));
  CHECK(cudaMalloc(&dk, k.size()));
  CHECK(cudaMalloc(&dv, v.size()));
  CHECK(cudaMalloc(&dp, p.size()));
  CHECK(cudaMalloc(&ds, kM * kN * 4));
  CHECK(cudaMalloc(&dout, kM * kLat * 4));
  CHECK(cudaMalloc(&dc, 3 * sizeof(long long)));
  CHECK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), k.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), v.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dp, p.data(), p.size(), cudaMemcpyHostToDevice));
  const int smem = int(std::max(sizeof(Smem8), sizeof(Smem16)));
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  probe<<<1, 128, smem>>>(dq, dk, dv, dp, ds, dout, dc, 1000);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> s(kM * kN), o(kM * kLat);
  long long cyc[3];
  CHECK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(cyc, dc, sizeof(cyc), cudaMemcpyDeviceToHost));
  // Worst |got - ref| / sum |products| over an m x n product of a (row stride lda, column stride 1) and
  // b (element (kk, col) at b[kk * bk + col * bn]), summed over kk < K in double.
  auto worst = [](const std::vector<float>& got, int rows, int cols, int K, const uint8_t* a, int lda,
                  const uint8_t* b, int bk, int bn) {
    double w = 0;
    for (int m = 0; m < rows; ++m)
      for (int n = 0; n < cols; ++n) {
        double ref = 0, mag = 0;
        for (int kk = 0; kk < K; ++kk) {
          const double t = e4m3(a[m * lda + kk]) * e4m3(b[kk * bk + n * bn]);
          ref += t;
          mag += std::fabs(t);
        }
        w = std::max(w, std::fabs(got[m * cols + n] - ref) / (mag + 1e-30));
      }
    return w;
  };
  const double worst_s = worst(s, kM, kN, kLat, q.data(), kLat, k.data(), 1, kLat);   // S = Q K^T
  const double worst_o = worst(o, kM, kLat, kN, p.data(), kN, v.data(), kLat, 1);    // O = P V
  const bool ok = worst_s < 1e-3 && worst_o < 1e-3;
  std::printf("S = Q8 K8^T: max |err| / sum |products| = %.2e;  O = P8 V8: %.2e  %s\n", worst_s, worst_o,
              ok ? "checked" : "WRONG");
  std::printf("per round, one warpgroup: fp8 S (64x64x512) + O half (64x256x64) %lld cycles; bf16 S (64x64x576) + "
              "O half (64x256x64) %lld cycles\n", cyc[0], cyc[1]);
  // One tile end to end: q8 ~ e4m3(N(0, 0.5^2)), the cache's bytes ~ e4m3(N(0, 0.2^2)) (real N(0, 0.1^2) at
  // k_scale 0.5), the score scale set for a score std of 0.017 (flat, the benchmark's) or 2 (peaked).
  auto encode = [](double x) {  // nearest finite e4m3
    uint8_t best = 0;
    for (int b = 0; b < 256; ++b)
      if ((b & 0x7f) != 0x7f && std::fabs(e4m3(uint8_t(b)) - x) < std::fabs(e4m3(best) - x)) best = uint8_t(b);
    return best;
  };
  std::vector<uint8_t> tq(kM * kLat), tk(kN * kLat);
  auto normal = [] {
    const double u1 = (rand() + 1.0) / (RAND_MAX + 2.0), u2 = (rand() + 1.0) / (RAND_MAX + 2.0);
    return std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  };
  for (auto& b : tq) b = encode(0.5 * normal());
  for (auto& b : tk) b = encode(0.2 * normal());
  CHECK(cudaMemcpy(dq, tq.data(), tq.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, tk.data(), tk.size(), cudaMemcpyHostToDevice));
  float* dlse;
  CHECK(cudaMalloc(&dlse, kM * 4));
  const int tile_smem = int(sizeof(Smem8)) + kLat * 4;
  CHECK(cudaFuncSetAttribute(tile_probe<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, tile_smem));
  CHECK(cudaFuncSetAttribute(tile_probe<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, tile_smem));
  bool tile_ok = true;
  for (double score_std : {0.017, 2.0}) {
    const double scale = score_std / (0.5 * 0.2 * std::sqrt(double(kLat)));  // natural-log units
    std::vector<double> ref_o(kM * kLat), ref_l(kM);
    double omax = 0;
    for (int mrow = 0; mrow < kM; ++mrow) {
      std::vector<double> sc(kN);
      double mx = -1e300, den = 0;
      for (int t = 0; t < kN; ++t) {
        double a = 0;
        for (int d = 0; d < kLat; ++d) a += e4m3(tq[mrow * kLat + d]) * e4m3(tk[t * kLat + d]);
        sc[t] = a * scale;
        mx = std::max(mx, sc[t]);
      }
      for (int t = 0; t < kN; ++t) den += std::exp(sc[t] - mx);
      ref_l[mrow] = mx + std::log(den);
      for (int d = 0; d < kLat; ++d) {
        double a = 0;
        for (int t = 0; t < kN; ++t) a += std::exp(sc[t] - mx) * e4m3(tk[t * kLat + d]);
        ref_o[mrow * kLat + d] = a / den;
        omax = std::max(omax, std::fabs(a / den));
      }
    }
    for (int centre = 1; centre >= 0; --centre) {
      if (centre) tile_probe<true><<<1, 128, tile_smem>>>(dq, dk, float(scale * 1.4426950408889634), dout, dlse);
      else tile_probe<false><<<1, 128, tile_smem>>>(dq, dk, float(scale * 1.4426950408889634), dout, dlse);
      CHECK(cudaDeviceSynchronize());
      std::vector<float> go(kM * kLat), gl(kM);
      CHECK(cudaMemcpy(go.data(), dout, go.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(gl.data(), dlse, gl.size() * 4, cudaMemcpyDeviceToHost));
      double eo = 0, el = 0;
      for (int i = 0; i < kM * kLat; ++i) eo = std::max(eo, std::fabs(go[i] - ref_o[i]));
      for (int i = 0; i < kM; ++i) el = std::max(el, std::fabs(gl[i] - ref_l[i]));
      tile_ok &= std::isfinite(eo) && eo < 0.1 * omax;
      std::printf("tile, score std %.3f, P %s: max |out err| %.2e (max |out| %.2e), max |lse err| %.2e\n", score_std,
                  centre ? "centred" : "plain x 2^8", eo, omax, el);
    }
  }
  return ok && tile_ok ? 0 : 1;
}
