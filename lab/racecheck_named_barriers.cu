// What compute-sanitizer's racecheck models: one warpgroup writes shared memory, another reads it after a
// barrier, in a CTA of 384 threads shaped like the decode kernel's (a 128-thread producer warpgroup, two
// 128-thread math warpgroups). The decode kernel orders its math warpgroups' hand-overs with named
// barriers over the 256 math threads only (bar.sync id, 256, and bar.arrive / bar.sync pairs; arch.cuh),
// which PTX defines to order the shared-memory accesses of the participating threads. Run each mode
// under `compute-sanitizer --tool racecheck`: the result is checked in every mode, and racecheck's
// report says which barriers it understands.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/rnb lab/racecheck_named_barriers.cu
//   for m in $(seq 0 33); do compute-sanitizer --tool racecheck /tmp/rnb $m; done
//
// modes: 0 the producer exits, then bar.sync 1, 256 over the math threads (merge_st, rows_64's kBarEnd);
//        1 the producer exits, bar.arrive 2, 256 by the writers and bar.sync 2, 256 by the readers (the
//          seesaw's kBarMaxA / kBarPA / kBarMaxPB);
//        2 the producer stays, __syncthreads over all 384 (the control);
//        3 the producer stays and idles at bar.sync 1, 384 with the others;
//        4 as 0, but first warpgroup 0 alone meets twice at its own warpgroup barrier (bar.sync id, 128)
//          whose id is in a register, as consume_st's and the seesaw's per-warpgroup barriers are
//          (kBarStWg + wg, kBarOwnP + wg): a CTA with one tile runs them in warpgroup 0 only;
//        5 as 4 with the id an immediate;
//        6 as 0, but the producer warpgroup is still running (it sleeps, then exits) while the math
//          threads meet at bar.sync 1, 256, as the decode kernel's producer is while it loads tiles;
//        7 as 6, and the producer warpgroup also meets at its own barrier (bar.sync 3, 128);
//        8 as 0, with the kernel's register hand-over: the producer warpgroup gives registers back
//          (setmaxnreg.dec 40) before it exits, the math warpgroups take them (setmaxnreg.inc 232);
//        9 as 8, and the math threads first wait on an mbarrier that the producer arrives on;
//       10 as 0 in 1024 CTAs, one per SM at a time (each asks for 200 KB of shared memory), so later
//          CTAs reuse the shared memory of earlier ones, as a decode grid larger than the SM count does;
//       11 as 10, and CTA b first meets b % 3 extra times at bar.sync 1, 256 (CTAs of one grid cross
//          their barriers a different number of times, as decode CTAs with 0, 1 or 2 tiles do).
//       12 the seesaw's loop (consume_two_stage's row_max hand-over): for 8 tiles, warpgroup 0 writes A
//          and bar.arrive 1, 256; warpgroup 1 bar.sync 1, 256, reads A, writes B and bar.arrive 3, 256;
//          warpgroup 0 bar.sync 3, 256 and reads B. Every access is ordered by one barrier generation;
//       13 as 12 in 1024 CTAs (200 KB of shared memory each) with 4 + b % 3 tiles in CTA b;
//       14 as 12 with bar.sync on both sides (the control);
//       15 the transposed fp8 path's shape: 512 threads, three math warpgroups; warpgroup w first meets
//          2 - w times at its own barrier bar.sync 9 + w, 128 with the id in a register (consume_st's
//          kBarStWg + wg: warpgroups own different tile counts), then warpgroup 0 writes, all math
//          threads bar.sync 12, 384 (merge_st's kBarStMerge) and warpgroup 2 reads;
//       16 as 15 with every warpgroup meeting its barrier twice (equal tile counts);
//       17 as 15 in 1024 CTAs (200 KB of shared memory each, one per SM at a time).
//       18 the 16-bit transposed path's and the 64-row path's shape: 384 threads, two math warpgroups;
//          warpgroup 0 first meets once at its own barrier bar.sync 4, 128 (id in a register; the
//          seesaw's kBarOwnP + wg with an odd tile count, consume_st's kBarStWg + wg), warpgroup 1
//          not; then warpgroup 0 writes, bar.sync 12, 256 by both, warpgroup 1 reads;
//       19 as 18 with both warpgroups meeting their barrier once (the control);
//       20 the fp8 64-row P store against the producer's next cp.async into the same bytes:
//          warpgroup 0 stores, fence.proxy.async, bar.sync 4, 128 (id in a register), lane 0 of each
//          warp arrives on an mbarrier (release); a producer warp waits on it (acquire), cp.asyncs the
//          same bytes and signals a second mbarrier on their completion; warpgroup 1 waits on that and
//          reads. Warpgroup 0 first meets its barrier once more than warpgroup 1 its own;
//       21 as 20 with equal crossings (the control).
//       22 the fp8 fast kernel's p_full / row_alpha hand-over: 8 rounds over two buffers; warpgroup 0
//          waits on the buffer's empty mbarrier (from round 2), writes it and every thread arrives on
//          its full mbarrier (count 128); warpgroup 1 waits on full, reads, and every thread arrives on
//          empty (count 128). Every access is ordered by one mbarrier phase;
//       23 as 22 with bar.sync 1, 256 after the writes and bar.sync 2, 256 after the reads (the control);
//       24 as 22, but the writer learns that a buffer is free through the producer, as the fast kernel's
//          softmax warpgroup does (row_alpha): a producer warp waits on empty, cp.asyncs 16 bytes
//          elsewhere and signals a relay mbarrier on their completion (cp.async.mbarrier.arrive, 32),
//          which warpgroup 0 waits on before it writes again;
//       25 as 24 with the fast kernel's TMA relay: the producer warp waits on empty, its lane 0 announces
//          16 bytes (mbarrier.arrive.expect_tx), copies them with cp.async.bulk (complete_tx) and arrives
//          for the other 31 lanes (mbarrier.arrive with a count).
//       26 as 25, but lane 0 arrives for the other 31 lanes before it issues the copy, so the relay's
//          phase completes on the copy's complete_tx, never on a thread's arrival (in the fast kernel
//          a 40 KiB tile's TMA usually lands after the producer's last arrival);
//       27 as 26, and warpgroup 0 also waits on the empty mbarrier itself before it writes again;
//       28 as 25 with the fast kernel's real copy: five tensor-map boxes (cp.async.bulk.tensor, 128 bytes x
//          64 rows each, 40 KiB announced), then the arrival for the other 31 lanes;
//       29 as 28, and warpgroup 0 also waits on the empty mbarrier itself before it writes again;
//       30 as 22, but warpgroup 1 releases a buffer as the fast kernel's P V warps release a stage: lane 0
//          of each warp arrives on empty (count 4) after the warp's reads;
//       31 as 30 with __syncwarp() before lane 0's arrival;
//       32 as 30 with a per-warp named barrier (bar.sync 5, 32) before lane 0's arrival;
//       33 as 30 with the warpgroup's named barrier (bar.sync 6, 128) before lane 0's arrival.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdlib>

__global__ void __launch_bounds__(384, 1) hand_over(int* out, int mode, int wg_bar) {
  __shared__ int buf[128];
  __shared__ unsigned long long full;
  const int t = threadIdx.x;
  if (mode >= 8) {
    if (t == 0) asm volatile("mbarrier.init.shared.b64 [%0], 128;\n" ::"r"((unsigned)__cvta_generic_to_shared(&full)));
    __syncthreads();
    if (t < 128) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (mode == 9) {
        unsigned long long state;
        asm volatile("mbarrier.arrive.shared.b64 %0, [%1];\n" : "=l"(state) : "r"((unsigned)__cvta_generic_to_shared(&full)) : "memory");
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    if (mode == 9) {
      asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], 0;\n @!p bra W;\n}\n"
                   ::"r"((unsigned)__cvta_generic_to_shared(&full)) : "memory");
    }
  }
  if (t < 128 && (mode == 6 || mode == 7)) {       // a producer warpgroup still at work
    for (int i = 0; i < 200; ++i) {
      __nanosleep(1000);
      if (mode == 7) asm volatile("bar.sync 3, 128;\n" ::: "memory");
    }
    return;
  }
  if (t < 128 && mode != 2 && mode != 3) return;  // a producer warpgroup that is done
  const int m = t - 128;                            // math thread (negative: the staying producer)
  if (mode == 11 && m >= 0) {
    for (int i = 0; i < int(blockIdx.x % 3); ++i) asm volatile("bar.sync 1, 256;\n" ::: "memory");
  }
  if (m >= 0 && m < 128) buf[m] = 3 * m + 1 + int(blockIdx.x);  // math warpgroup 0 writes
  if ((mode == 4 || mode == 5) && m >= 0 && m < 128) {
    for (int i = 0; i < 2; ++i) {
      if (mode == 4) {
        asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");
      } else {
        asm volatile("bar.sync 9, 128;\n" ::: "memory");
      }
    }
  }
  if (mode == 0 || mode >= 4) {  // 4-11
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
  } else if (mode == 1) {
    if (m < 128) {
      asm volatile("bar.arrive 2, 256;\n" ::: "memory");
    } else {
      asm volatile("bar.sync 2, 256;\n" ::: "memory");
    }
  } else if (mode == 2) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 1, 384;\n" ::: "memory");
  }
  if (m >= 128) out[blockIdx.x * 128 + m - 128] = buf[m - 128] - int(blockIdx.x);  // warpgroup 1 reads
}

// Modes 12-14: out[cta * 128 + m] counts the wrong values math thread m read (0 when ordered), plus 3m + 1.
__global__ void __launch_bounds__(384, 1) seesaw(int* out, int mode) {
  __shared__ int a[128], b[128];
  const int m = int(threadIdx.x) - 128;
  if (m < 0) return;  // the producer warpgroup is done
  const int tiles = mode == 13 ? 4 + int(blockIdx.x % 3) : 8;
  const int k = m % 128;
  int wrong = 0;
  for (int i = 0; i < tiles; ++i) {
    if (m < 128) {
      a[k] = 7 * i + k;
      if (mode == 14) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      }
      wrong += b[k] != 5 * i + k;
    } else {
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
      wrong += a[k] != 7 * i + k;
      b[k] = 5 * i + k;
      if (mode == 14) {
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      }
    }
  }
  __shared__ int wrong1[128];
  if (m >= 128) wrong1[k] = wrong;
  asm volatile("bar.sync 2, 256;\n" ::: "memory");
  if (m < 128) out[blockIdx.x * 128 + k] = 3 * k + 1 + wrong + wrong1[k];
}

// Modes 15-16: out[m] = what math thread m of warpgroup 2 read (3m + 1 when ordered).
__global__ void __launch_bounds__(512, 1) three_warpgroups(int* out, int mode) {
  __shared__ int buf[128];
  const int m = int(threadIdx.x) - 128;
  if (m < 0) return;  // the producer warpgroup is done
  const int wg = m / 128, k = m % 128;
  const int meets = mode == 16 ? 2 : 2 - wg;  // 15, 17: 2, 1, 0
  const int id = 9 + wg;  // in a register: the warpgroup's own barrier
  for (int i = 0; i < meets; ++i) asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
  if (wg == 0) buf[k] = 3 * k + 1 + int(blockIdx.x);
  asm volatile("bar.sync 12, 384;\n" ::: "memory");
  if (wg == 2) out[blockIdx.x * 128 + k] = buf[k] - int(blockIdx.x);
}

// Modes 18-19: out[m] = what math thread m of warpgroup 1 read (3m + 1 when ordered).
__global__ void __launch_bounds__(384, 1) two_warpgroups(int* out, int extra) {
  __shared__ int buf[128];
  const int m = int(threadIdx.x) - 128;
  if (m < 0) return;  // the producer warpgroup is done
  const int wg = m / 128, k = m % 128;
  const int id = 4 + wg;  // in a register: the warpgroup's own barrier
  const int meets = wg == 0 ? 1 : 1 - extra;
  for (int i = 0; i < meets; ++i) asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
  if (wg == 0) buf[k] = 3 * k + 1;
  asm volatile("bar.sync 12, 256;\n" ::: "memory");
  if (wg == 1) out[k] = buf[k];
}

// Modes 20-21: out[m] = the first word math thread m of warpgroup 1 read (3m + 1 when ordered: the
// copied value, not warpgroup 0's store).
__global__ void __launch_bounds__(384, 1) store_then_copy(int* out, const int4* src, int extra) {
  __shared__ int4 buf[128];
  __shared__ unsigned long long empty, full;
  const int t = int(threadIdx.x);
  const unsigned e = unsigned(__cvta_generic_to_shared(&empty)), f = unsigned(__cvta_generic_to_shared(&full));
  if (t == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], 4;\n" ::"r"(e));   // lane 0 of warpgroup 0's 4 warps
    asm volatile("mbarrier.init.shared.b64 [%0], 32;\n" ::"r"(f));  // the copy warp's 32 cp.async arrivals
  }
  __syncthreads();
  if (t < 32) {  // the producer's copy warp
    asm volatile("{\n .reg .pred p;\n W0: mbarrier.try_wait.parity.shared.b64 p, [%0], 0;\n @!p bra W0;\n}\n" ::"r"(e)
                 : "memory");
    for (int j = 0; j < 4; ++j) {
      const int i = t + 32 * j;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(unsigned(__cvta_generic_to_shared(&buf[i]))),
                   "l"(src + i) : "memory");
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(f) : "memory");
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  if (t < 128) return;  // the rest of the producer warpgroup is done
  const int m = t - 128, wg = m / 128, k = m % 128;
  const int id = 4 + wg;  // in a register: kBarOwnP + wg
  if (wg == 0) {
    for (int i = 0; i < extra; ++i) asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
    buf[k] = make_int4(-1, -2, -3, -4 - k);  // "P"
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
  if (wg == 0 && k % 32 == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(e) : "memory");
  asm volatile("{\n .reg .pred p;\n W1: mbarrier.try_wait.parity.shared.b64 p, [%0], 0;\n @!p bra W1;\n}\n" ::"r"(f)
               : "memory");
  if (wg == 1) out[k] = buf[k].x;
}

// Modes 22-23: out[m] = 3m + 1 when every round's read saw that round's write.
__device__ __forceinline__ void mb_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(bar),
               "r"(parity) : "memory");
}
__global__ void __launch_bounds__(384, 1) mbarrier_ring(int* out, const int4* src, int control, int relay,
                                                        const __grid_constant__ CUtensorMap map, int lane0) {
  extern __shared__ __align__(1024) unsigned char tile[];  // modes 28-29: the tensor copies' 40 KiB
  __shared__ int buf[2][128];
  __shared__ int4 dummy[32];
  __shared__ unsigned long long full[2], empty[2], relayed[2];
  const int t = int(threadIdx.x);
  unsigned f[2], e[2], y[2];
  for (int i = 0; i < 2; ++i) {
    f[i] = unsigned(__cvta_generic_to_shared(&full[i]));
    e[i] = unsigned(__cvta_generic_to_shared(&empty[i]));
    y[i] = unsigned(__cvta_generic_to_shared(&relayed[i]));
  }
  if (t == 0) {
    for (int i = 0; i < 2; ++i) {
      asm volatile("mbarrier.init.shared.b64 [%0], 128;\n" ::"r"(f[i]));
      asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(e[i]), "r"(lane0 ? 4 : 128));
      asm volatile("mbarrier.init.shared.b64 [%0], 32;\n" ::"r"(y[i]));
    }
  }
  __syncthreads();
  if (relay && t < 32) {  // the producer's relay warp
    for (int r = 2; r < 8; ++r) {
      const int b = r % 2;
      mb_wait(e[b], (unsigned(r / 2) & 1u) ^ 1u);
      if (relay == 1) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(unsigned(__cvta_generic_to_shared(&dummy[t]))),
                     "l"(src + t) : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(y[b]) : "memory");
      } else if (relay >= 5 && t == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 40960;\n" ::"r"(y[b]) : "memory");
        for (int c = 0; c < 5; ++c) {
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
              ::"r"(unsigned(__cvta_generic_to_shared(tile + c * 8192))), "l"(reinterpret_cast<uint64_t>(&map)),
              "r"(y[b]), "r"(c * 128), "r"(0) : "memory");
        }
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], 31;\n" ::"r"(y[b]) : "memory");
      } else if (t == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16;\n" ::"r"(y[b]) : "memory");
        if (relay >= 3) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], 31;\n" ::"r"(y[b]) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 16, [%2];\n"
                     ::"r"(unsigned(__cvta_generic_to_shared(&dummy[r]))), "l"(src + r), "r"(y[b]) : "memory");
        if (relay == 2) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], 31;\n" ::"r"(y[b]) : "memory");
      }
      __syncwarp();
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  if (t < 128) return;  // the rest of the producer warpgroup is done
  const int m = t - 128, wg = m / 128, k = m % 128;
  bool ok = true;
  for (int r = 0; r < 8; ++r) {
    const int b = r % 2;
    const unsigned parity = unsigned(r / 2) & 1u;
    const int value = 3 * k + 1 + 1000 * (7 - r);
    if (wg == 0) {
      if (!control && r >= 2) mb_wait(relay ? y[b] : e[b], parity ^ 1u);
      if ((relay == 4 || relay == 6) && r >= 2) mb_wait(e[b], parity ^ 1u);
      buf[b][k] = value;
      if (control) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(f[b]) : "memory");
      }
    } else {
      if (control) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
      } else {
        mb_wait(f[b], parity);
      }
      ok = ok && buf[b][k] == value;
      if (control) {
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        if (lane0 == 2) __syncwarp();
        if (lane0 == 3) asm volatile("bar.sync 5, 32;\n" ::: "memory");
        if (lane0 == 4) asm volatile("bar.sync 6, 128;\n" ::: "memory");
        if (!lane0 || k % 32 == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(e[b]) : "memory");
      }
    }
  }
  if (wg == 1) out[k] = ok ? 3 * k + 1 : -1;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  const int ctas = mode == 10 || mode == 11 || mode == 13 || mode == 17 ? 1024 : 1;
  const int smem = ctas > 1 ? 200 * 1024 : 0;
  int* out = nullptr;
  cudaMalloc(&out, ctas * 128 * sizeof(int));
  cudaMemset(out, 0, ctas * 128 * sizeof(int));
  if (mode >= 20) {
    int4 host4[128];
    int4* src = nullptr;
    for (int i = 0; i < 128; ++i) host4[i] = make_int4(3 * i + 1, 2 * i, 3 * i, 4 * i);
    cudaMalloc(&src, sizeof host4);
    cudaMemcpy(src, host4, sizeof host4, cudaMemcpyHostToDevice);
    if (mode >= 22) {
      // Modes 28-29: a map over 64 rows of 640 bytes (box 128 bytes x 64 rows, no swizzle).
      CUtensorMap map{};
      unsigned char* rows = nullptr;
      cudaMalloc(&rows, 64 * 640);
      cudaMemset(rows, 7, 64 * 640);
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found;
      cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
      const cuuint64_t dims[2] = {640, 64}, strides[1] = {640};
      const cuuint32_t box[2] = {128, 64}, elem[2] = {1, 1};
      if (reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
              &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, rows, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::printf("mode %d: tensor map not encoded\n", mode);
        return 1;
      }
      mbarrier_ring<<<1, 384, 40960>>>(out, src, mode == 23 ? 1 : 0, mode >= 24 && mode <= 29 ? mode - 23 : 0, map,
                                       mode >= 30 ? mode - 29 : 0);
    } else {
      store_then_copy<<<1, 384>>>(out, src, mode == 20 ? 1 : 0);
    }
  } else if (mode >= 18) {
    two_warpgroups<<<1, 384>>>(out, mode == 18 ? 1 : 0);
  } else if (mode >= 15) {
    cudaFuncSetAttribute(three_warpgroups, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    three_warpgroups<<<ctas, 512, smem>>>(out, mode);
  } else if (mode >= 12) {
    cudaFuncSetAttribute(seesaw, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    seesaw<<<ctas, 384, smem>>>(out, mode);
  } else {
    cudaFuncSetAttribute(hand_over, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    hand_over<<<ctas, 384, smem>>>(out, mode, 9);
  }
  static int host[1024 * 128];
  cudaMemcpy(host, out, ctas * 128 * sizeof(int), cudaMemcpyDeviceToHost);
  const cudaError_t err = cudaDeviceSynchronize();
  int bad = err != cudaSuccess;
  for (int i = 0; i < ctas * 128; ++i) bad += host[i] != 3 * (i % 128) + 1;
  std::printf("mode %d: %s\n", mode, bad ? "WRONG" : "ordered");
  cudaFree(out);
  return bad ? 1 : 0;
}
