// What an fp8 tensor-core mode's shared-memory work costs per 64-token tile, against the exact mode's
// widening (a probe, not the product; docs/design.md 3.1 has the error model it serves).
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/fp8_fast_probe lab/fp8_fast_probe.cu && /tmp/fp8_fast_probe
//
// The fp8 wgmma takes both operands K-major: S = Q K^T reads the cache's raw latent bytes as they land
// (576 bytes per token, the reduction dimension contiguous), but O = P V reduces over tokens, so V must
// be stored transposed (V^T: 64 token bytes per latent column). With P centred per row (design.md 3.1),
// the tile's column sums of V are needed too, and the 64 RoPE columns are widened to 16 bits. One CTA
// per SM (it asks for 200 KiB of shared memory) keeps a 64 x 576-byte raw tile in each of two stages and
// runs the work of one mode on it, tile after tile, with `threads` threads meeting at a barrier after
// each tile (as the producer's converting warps do); the other threads of the 128 idle.
//   widen     : the exact mode: all 576 columns e4m3 -> fp16 (36 KiB read, 72 KiB written)
//   rope      : only the 64 RoPE columns -> fp16 (4 KiB read, 8 KiB written)
//   vt        : the 512 latent columns transposed to V^T in 16 x 16-byte blocks (byte permutes), plus rope
//   vt_colsum : vt, and each latent column's sum over the tile's 64 tokens in fp32 (fp16 pairs of 16)
// It prints each mode's median cycles per tile over the CTAs at 64 and 128 threads (clock64 of thread 0
// around the loop), and checks CTA 0's V^T, column sums and widened values against the CPU.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_check.h"

constexpr int kTokens = 64, kRow = 576, kLat = 512, kRope = 64;
constexpr int kRaw = kTokens * kRow;          // 36 KiB a stage
constexpr int kWide = kRaw * 2;               // 72 KiB (widen)
constexpr int kVt = kLat * kTokens;           // 32 KiB
constexpr int kRope16 = kTokens * kRope * 2;  // 8 KiB
enum Mode { kWiden = 0, kRopeOnly = 1, kVtMode = 2, kVtColsum = 3 };
const char* kNames[] = {"widen", "rope", "vt", "vt_colsum"};

__device__ __forceinline__ uint2 widen4(uint32_t w) {  // 4 e4m3 -> 4 fp16
  uint2 r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(r.x), "=r"(r.y) : "r"(w));
  return r;
}

__device__ __forceinline__ void widen_range(const uint8_t* raw, uint8_t* out, int col0, int cols, int tid, int threads) {
  const int chunks_per_row = cols / 16;
  for (int i = tid; i < kTokens * chunks_per_row; i += threads) {
    const int t = i / chunks_per_row, c = col0 + (i % chunks_per_row) * 16;
    const uint4 v = *reinterpret_cast<const uint4*>(raw + t * kRow + c);
    const uint2 a = widen4(v.x), b = widen4(v.y), d = widen4(v.z), e = widen4(v.w);
    uint4* dst = reinterpret_cast<uint4*>(out + (t * cols + (c - col0)) * 2);
    dst[0] = make_uint4(a.x, a.y, b.x, b.y);
    dst[1] = make_uint4(d.x, d.y, e.x, e.y);
  }
}

// Rows a, b, c, d (4 bytes each, one word of 4 tokens' rows): out[j] = byte j of a, b, c, d.
__device__ __forceinline__ void transpose4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&o)[4]) {
  const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(c, d, 0x5140);
  const uint32_t t2 = __byte_perm(a, b, 0x7362), t3 = __byte_perm(c, d, 0x7362);
  o[0] = __byte_perm(t0, t1, 0x5410);
  o[1] = __byte_perm(t0, t1, 0x7632);
  o[2] = __byte_perm(t2, t3, 0x5410);
  o[3] = __byte_perm(t2, t3, 0x7632);
}

// V^T of the 512 latent columns; with kColsum, colsum[d] = sum over the tile's tokens of column d.
template <bool kColsum>
__device__ __forceinline__ void transpose_vt(const uint8_t* raw, uint8_t* vt, float* colsum, int tid, int threads) {
  // 128 blocks of 16 tokens x 16 latent columns; a thread takes latent block lb and token blocks tb0..
  const int per_lb = threads / 32;  // threads per latent block (2 at 64 threads, 4 at 128)
  const int lb = tid / per_lb, part = tid % per_lb, tbs = 4 / per_lb;
  float sum[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) sum[j] = 0.f;
#pragma unroll
  for (int k = 0; k < tbs; ++k) {
    const int tb = part * tbs + k;
    uint4 rows[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) rows[r] = *reinterpret_cast<const uint4*>(raw + (tb * 16 + r) * kRow + lb * 16);
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // latent columns 4w..4w+3 of the block
      uint32_t col[4][4];          // col[j][g]: latent 4w + j, tokens 4g..4g+3
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const uint32_t* r0 = reinterpret_cast<const uint32_t*>(&rows[4 * g]);
        const uint32_t* r1 = reinterpret_cast<const uint32_t*>(&rows[4 * g + 1]);
        const uint32_t* r2 = reinterpret_cast<const uint32_t*>(&rows[4 * g + 2]);
        const uint32_t* r3 = reinterpret_cast<const uint32_t*>(&rows[4 * g + 3]);
        uint32_t o[4];
        transpose4(r0[w], r1[w], r2[w], r3[w], o);
#pragma unroll
        for (int j = 0; j < 4; ++j) col[j][g] = o[j];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int d = lb * 16 + 4 * w + j;
        *reinterpret_cast<uint4*>(vt + d * kTokens + tb * 16) = make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
        if constexpr (kColsum) {
          __half2 h = __float2half2_rn(0.f);
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            const uint2 x = widen4(col[j][g]);
            h = __hadd2(h, __hadd2(*reinterpret_cast<const __half2*>(&x.x), *reinterpret_cast<const __half2*>(&x.y)));
          }
          sum[4 * w + j] += __low2float(h) + __high2float(h);
        }
      }
    }
  }
  if constexpr (kColsum) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      for (int m = 1; m < per_lb; m *= 2) sum[j] += __shfl_xor_sync(0xffffffff, sum[j], m);
      if (part == 0) colsum[lb * 16 + j] = sum[j];
    }
  }
}

__global__ void __launch_bounds__(128, 1) probe(const uint8_t* tile, int mode, int threads, int iters,
                                                long long* cycles, uint8_t* check) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* raw = smem;                     // 2 stages
  uint8_t* out = smem + 2 * kRaw;          // widen: 72 KiB; vt: V^T, then rope16, then colsum
  uint8_t* vt = out;
  uint8_t* rope16 = out + kVt;
  float* colsum = reinterpret_cast<float*>(out + kVt + kRope16);
  const int tid = threadIdx.x;
  for (int i = tid; i < kRaw / 16; i += blockDim.x) {
    const uint4 v = reinterpret_cast<const uint4*>(tile)[i];
    reinterpret_cast<uint4*>(raw)[i] = v;
    reinterpret_cast<uint4*>(raw + kRaw)[i] = v;
  }
  __syncthreads();
  if (tid >= threads) return;
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    const uint8_t* r = raw + (it & 1) * kRaw;
    if (mode == kWiden) {
      widen_range(r, out, 0, kRow, tid, threads);
    } else {
      widen_range(r, rope16, kLat, kRope, tid, threads);
      if (mode == kVtMode) transpose_vt<false>(r, vt, colsum, tid, threads);
      if (mode == kVtColsum) transpose_vt<true>(r, vt, colsum, tid, threads);
    }
    asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
  }
  const long long t1 = clock64();
  if (tid == 0) cycles[blockIdx.x] = (t1 - t0) / iters;
  if (blockIdx.x == 0) {
    const int bytes = mode == kWiden ? kWide : kVt + kRope16 + kLat * 4;
    for (int i = tid; i < bytes / 16; i += threads) reinterpret_cast<uint4*>(check)[i] = reinterpret_cast<const uint4*>(out)[i];
  }
}

static float e4m3_to_float(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const float v = e == 0 ? std::ldexp(float(m) / 8.f, -6) : std::ldexp(1.f + float(m) / 8.f, e - 7);
  return s ? -v : v;
}

static float half_bits_to_float(uint16_t h) {
  __half x;
  std::memcpy(&x, &h, 2);
  return __half2float(x);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<uint8_t> tile(kRaw);
  srand(1);
  for (auto& b : tile) b = uint8_t((rand() % 0x7f) | ((rand() & 1) << 7));  // finite e4m3 (0x7f / 0xff are NaN)
  uint8_t *d_tile, *d_check;
  long long* d_cycles;
  CHECK(cudaMalloc(&d_tile, kRaw));
  CHECK(cudaMalloc(&d_check, kWide));
  CHECK(cudaMalloc(&d_cycles, sms * sizeof(long long)));
  CHECK(cudaMemcpy(d_tile, tile.data(), kRaw, cudaMemcpyHostToDevice));
  const int smem = 200 * 1024;
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::printf("cycles per 64-token tile (median CTA of %d, one per SM; the exact kernel's tile takes about 3000-3500)\n", sms);
  for (int mode = 0; mode < 4; ++mode) {
    for (int threads : {64, 128}) {
      probe<<<sms, 128, smem>>>(d_tile, mode, threads, 2000, d_cycles, d_check);
      CHECK(cudaDeviceSynchronize());
      std::vector<long long> cyc(sms);
      CHECK(cudaMemcpy(cyc.data(), d_cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
      std::nth_element(cyc.begin(), cyc.begin() + sms / 2, cyc.end());
      std::vector<uint8_t> got(kWide);
      CHECK(cudaMemcpy(got.data(), d_check, kWide, cudaMemcpyDeviceToHost));
      int bad = 0;
      if (mode == kWiden) {
        for (int i = 0; i < kRaw; ++i) {
          const uint16_t h = uint16_t(got[2 * i] | (got[2 * i + 1] << 8));
          bad += half_bits_to_float(h) != e4m3_to_float(tile[i]);
        }
      } else {
        for (int t = 0; t < kTokens; ++t)
          for (int c = 0; c < kRope; ++c) {
            const int o = kVt + (t * kRope + c) * 2;
            bad += half_bits_to_float(uint16_t(got[o] | (got[o + 1] << 8))) != e4m3_to_float(tile[t * kRow + kLat + c]);
          }
        if (mode >= kVtMode)
          for (int d = 0; d < kLat; ++d)
            for (int t = 0; t < kTokens; ++t) bad += got[d * kTokens + t] != tile[t * kRow + d];
        if (mode == kVtColsum)
          for (int d = 0; d < kLat; ++d) {
            double s = 0;
            for (int t = 0; t < kTokens; ++t) s += e4m3_to_float(tile[t * kRow + d]);
            float g;
            std::memcpy(&g, &got[kVt + kRope16 + 4 * d], 4);
            bad += std::fabs(g - s) > 1e-3 * (1 + std::fabs(s)) * 64;
          }
      }
      std::printf("%-10s %3d threads: %6lld cycles/tile  %s\n", kNames[mode], threads, cyc[sms / 2],
                  bad ? "WRONG" : "checked");
    }
  }
  return 0;
}
