// What bounds an epilogue's stores on the H200: instructions, 32-byte sectors or bytes? (a probe, not
// the product; lab log v3.14, docs/archive: the epilogue's store phase is 1.4-3 us on every kernel path).
//
//   nvcc -O3 -arch=sm_90a -o /tmp/store_probe lab/store_probe.cu && /tmp/store_probe
//
// Each CTA (256 threads, one per SM: it asks for 200 KiB of shared memory it does not use) stores one
// decode CTA's epilogue worth of data in one of the kernel's patterns, into its own region:
//   acc_f32    : store_rows' split pieces: per warp instruction 8 rows x 32 bytes (a float2 per lane,
//                lane / 4 = row, lane % 4 = 8-byte column), 64 float2 per thread: 128 KiB
//   rows_f32   : the same 128 KiB as whole rows: 512 contiguous bytes per warp instruction (float4)
//   acc_16     : the same layout in 16-bit: 8 rows x 16 bytes per instruction (4 bytes a lane), 64 KiB
//   rows_16    : 64 KiB as whole rows, 512 bytes per instruction (a 16-byte store a lane)
//   acc16_pair : acc_16's layout with column groups j, j + 1 paired (kernel.cuh store_16_pairs): lanes
//                q and q ^ 1 swap one 4-byte value, then each lane stores 8 bytes, so a warp
//                instruction writes 8 rows x 32 contiguous bytes (full sectors); 32 stores a thread
//   st_f32     : store_rows_st's pieces: 16 rows of 2 KiB, two float4 per lane and row: 32 KiB
//   bulk_f32   : 128 KiB staged in shared memory (written before the clock starts), stored by bulk
//                async copies (cp.async.bulk.global.shared::cta), one 1 KiB row per thread of 128,
//                timed to their issue and cp.async.bulk.wait_group.read (FlashMLA's split epilogue)
// For CTAs = 1, 16 and 132 it prints, per pattern, the median CTA's time from its first store to its
// last issued store (thread 0's %globaltimer around the stores and a __syncthreads), and the kernel's
// time with cudaEvents (which includes draining the stores), each the median of 20 launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_check.h"

constexpr int kThreads = 256;
constexpr int64_t kRegion = 256 << 10;  // bytes per CTA

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

enum Pattern { kAccF32, kRowsF32, kAcc16, kRows16, kStF32, kBulkF32, kAcc16Pair, kPatterns };
const char* kNames[kPatterns] = {"acc_f32", "rows_f32", "acc_16", "rows_16", "st_f32", "bulk_f32", "acc16_pair"};
const int kBytes[kPatterns] = {128 << 10, 128 << 10, 64 << 10, 64 << 10, 32 << 10, 128 << 10, 64 << 10};

template <int P>
__global__ void __launch_bounds__(kThreads, 1) store_kernel(char* out, uint64_t* stamps, float seed) {
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, warp = (tid % 128) / 32;
  char* base = out + int64_t(blockIdx.x) * kRegion;
  const float v = seed + tid;  // values the compiler cannot fold
  extern __shared__ __align__(128) char smem[];
  if constexpr (P == kBulkF32) {  // the staged block, written before the clock starts
    for (int i = tid; i < (128 << 10) / 16; i += kThreads) reinterpret_cast<float4*>(smem)[i] = make_float4(v, v, v, i);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> the bulk copies' reads
  }
  __syncthreads();
  const uint64_t t0 = now_ns();
  if constexpr (P == kAccF32 || P == kAcc16) {
    // A warpgroup's 64 x 256 block; row r of the piece at r * row_bytes, warpgroup wg at half a row.
    constexpr int kElem = P == kAccF32 ? 4 : 2;
    constexpr int kRowBytes = 512 * kElem;
    const int row0 = 16 * warp + lane / 4, q = lane % 4;
    char* dst = base + row0 * kRowBytes + wg * (kRowBytes / 2) + 2 * q * kElem;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        char* p = dst + r * 8 * kRowBytes + 8 * j * kElem;
        if constexpr (P == kAccF32) {
          *reinterpret_cast<float2*>(p) = make_float2(v + j, v - j);
        } else {
          *reinterpret_cast<uint32_t*>(p) = __float_as_uint(v + j);
        }
      }
    }
  } else if constexpr (P == kAcc16Pair) {
    constexpr int kRowBytes = 512 * 2;
    const int row0 = 16 * warp + lane / 4, q = lane % 4;
    const bool odd = q & 1;
    // Lane q stores bytes 8 (q >> 1) .. + 7 of column group j + (q & 1) of the pair (j, j + 1).
    char* dst = base + row0 * kRowBytes + wg * (kRowBytes / 2) + 16 * int(odd) + 8 * (q >> 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 32; j += 2) {
        const uint32_t v0 = __float_as_uint(v + j), v1 = __float_as_uint(v - j);
        const uint32_t recv = __shfl_xor_sync(0xffffffff, odd ? v0 : v1, 1);
        *reinterpret_cast<uint2*>(dst + r * 8 * kRowBytes + 16 * j) = odd ? make_uint2(recv, v1) : make_uint2(v0, recv);
      }
    }
  } else if constexpr (P == kRowsF32 || P == kRows16) {
    constexpr int kRounds = (P == kRowsF32 ? (128 << 10) : (64 << 10)) / (kThreads * 16);
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      *reinterpret_cast<float4*>(base + i * kThreads * 16 + tid * 16) = make_float4(v + i, v - i, v, -v);
    }
  } else if constexpr (P == kBulkF32) {
    if (tid < 128) {  // row tid: 1 KiB from smem to its own global row
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem + tid * 1024));
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 1024;\n" ::"l"(base + tid * 1024), "r"(src)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
  } else {  // kStF32: 16 rows of 512 fp32, 64 threads a row (8 values each), 4 rows per pass
    const int d0 = (tid % 64) * 8;
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
      const int n = pass * 4 + tid / 64;
      float4* p = reinterpret_cast<float4*>(base + n * 2048 + d0 * 4);
      p[0] = make_float4(v + pass, v, v, v);
      p[1] = make_float4(v - pass, v, v, v);
    }
  }
  __syncthreads();
  const uint64_t t1 = now_ns();
  if (tid == 0) stamps[blockIdx.x] = t1 - t0;
}

template <int P>
void run(char* out, uint64_t* stamps, int ctas, float* issue_us, float* kernel_us) {
  CHECK(cudaFuncSetAttribute(store_kernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> issue, kern;
  std::vector<uint64_t> host(ctas);
  for (int rep = 0; rep < 23; ++rep) {
    CHECK(cudaEventRecord(a));
    store_kernel<P><<<ctas, kThreads, 200 << 10>>>(out, stamps, float(rep));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    if (rep < 3) continue;  // warm-up
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    kern.push_back(ms * 1e3f);
    CHECK(cudaMemcpy(host.data(), stamps, ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    std::sort(host.begin(), host.end());
    issue.push_back(host[ctas / 2] / 1e3f);
  }
  std::sort(issue.begin(), issue.end());
  std::sort(kern.begin(), kern.end());
  *issue_us = issue[issue.size() / 2];
  *kernel_us = kern[kern.size() / 2];
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char* out;
  uint64_t* stamps;
  CHECK(cudaMalloc(&out, kRegion * sms));
  CHECK(cudaMalloc(&stamps, sms * sizeof(uint64_t)));
  std::printf("pattern   bytes/CTA  CTAs  issue us  kernel us  (medians of 20 launches)\n");
  for (int ctas : {1, 16, sms}) {
    for (int p = 0; p < kPatterns; ++p) {
      float issue = 0, kern = 0;
      switch (p) {
        case kAccF32: run<kAccF32>(out, stamps, ctas, &issue, &kern); break;
        case kRowsF32: run<kRowsF32>(out, stamps, ctas, &issue, &kern); break;
        case kAcc16: run<kAcc16>(out, stamps, ctas, &issue, &kern); break;
        case kRows16: run<kRows16>(out, stamps, ctas, &issue, &kern); break;
        case kStF32: run<kStF32>(out, stamps, ctas, &issue, &kern); break;
        case kBulkF32: run<kBulkF32>(out, stamps, ctas, &issue, &kern); break;
        default: run<kAcc16Pair>(out, stamps, ctas, &issue, &kern); break;
      }
      std::printf("%-9s %9d %5d %9.2f %10.2f\n", kNames[p], kBytes[p], ctas, issue, kern);
    }
  }
  CHECK(cudaFree(out));
  CHECK(cudaFree(stamps));
  return 0;
}
