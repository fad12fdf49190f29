// Library-wide exports shared by every variant: the ABI version and CUDA error strings.
#include <cuda_runtime.h>

#include "abi.h"

extern "C" int mla_variants_abi_version() { return MLA_ABI_VERSION; }

extern "C" const char* mla_variants_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
