// What the lab's standalone probes (lab/*.cu) share: CHECK(call) exits with the CUDA error's name.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));               \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)
