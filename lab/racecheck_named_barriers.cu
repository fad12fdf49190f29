// What compute-sanitizer's racecheck models: one warpgroup writes shared memory, another reads it after a
// barrier, in a CTA of 384 threads shaped like the decode kernel's (a 128-thread producer warpgroup, two
// 128-thread math warpgroups). The decode kernel orders its math warpgroups' hand-overs with named
// barriers over the 256 math threads only (bar.sync id, 256, and bar.arrive / bar.sync pairs; arch.cuh),
// which PTX defines to order the shared-memory accesses of the participating threads. Run each mode
// under `compute-sanitizer --tool racecheck`: the result is checked in every mode, and racecheck's
// report says which barriers it understands.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/rnb lab/racecheck_named_barriers.cu
//   for m in 0 1 2 3 4 5; do compute-sanitizer --tool racecheck /tmp/rnb $m; done
//
// modes: 0 the producer exits, then bar.sync 1, 256 over the math threads (merge_st, rows_64's kBarEnd);
//        1 the producer exits, bar.arrive 2, 256 by the writers and bar.sync 2, 256 by the readers (the
//          seesaw's kBarMaxA / kBarPA / kBarMaxPB);
//        2 the producer stays, __syncthreads over all 384 (the control);
//        3 the producer stays and idles at bar.sync 1, 384 with the others;
//        4 as 0, but first warpgroup 0 alone meets twice at its own warpgroup barrier (bar.sync id, 128)
//          whose id is in a register, as consume_st's and the seesaw's per-warpgroup barriers are
//          (kBarStWg + wg, kBarOwnP + wg): a CTA with one tile runs them in warpgroup 0 only;
//        5 as 4 with the id an immediate.
#include <cstdio>
#include <cstdlib>

__global__ void __launch_bounds__(384, 1) hand_over(int* out, int mode, int wg_bar) {
  __shared__ int buf[128];
  const int t = threadIdx.x;
  if (t < 128 && mode != 2 && mode != 3) return;  // a producer warpgroup that is done
  const int m = t - 128;                            // math thread (negative: the staying producer)
  if (m >= 0 && m < 128) buf[m] = 3 * m + 1;        // math warpgroup 0 writes
  if ((mode == 4 || mode == 5) && m >= 0 && m < 128) {
    for (int i = 0; i < 2; ++i) {
      if (mode == 4) {
        asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");
      } else {
        asm volatile("bar.sync 9, 128;\n" ::: "memory");
      }
    }
  }
  if (mode == 0 || mode == 4 || mode == 5) {
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
  if (m >= 128) out[m - 128] = buf[m - 128];  // math warpgroup 1 reads what warpgroup 0 wrote
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int* out = nullptr;
  cudaMalloc(&out, 128 * sizeof(int));
  hand_over<<<1, 384>>>(out, mode, 9);
  int host[128];
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  const cudaError_t err = cudaDeviceSynchronize();
  int bad = err != cudaSuccess;
  for (int i = 0; i < 128; ++i) bad += host[i] != 3 * i + 1;
  std::printf("mode %d: %s\n", mode, bad ? "WRONG" : "ordered");
  cudaFree(out);
  return bad ? 1 : 0;
}
