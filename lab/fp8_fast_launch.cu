// Launchers of the fp8 fast-mode kernel (templates/mla/fp8_fast.cuh) for lab/fp8_fast_check.py, before
// the kernel has a dtype in variants.yaml: one extern "C" function per (num_heads, page_size), taking
// the library's packed MlaDecodeArgs (abi.h). num_kv_splits > 1: the pieces go to the workspace and the
// library's combine merges them (launch.cuh launch_combine, as a variant's launcher picks it).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -shared \
//     -Xcompiler -fPIC -I templates/mla -I <cutlass include> -o fp8_fast.so lab/fp8_fast_launch.cu
#include "launch.cuh"  // first, as the variants include it (tma_map.cuh's driver typedefs)
#include "fp8_fast.cuh"

template <int H, int P>
static int launch(const MlaDecodeArgs* a) {
  mla::DecodeParams p{};
  p.a = *a;
  p.num_m_blocks = (H * a->q_len + mla::kBlockM - 1) / mla::kBlockM;
  p.scale_log2 = a->softmax_scale * 1.4426950408889634f;
  p.use_tma = 0;
  auto kernel = mla::fast::mla_decode_fp8_fast_kernel<H, P, true>;
  constexpr int kSmemBytes = int(sizeof(mla::fast::Storage)) + 1024;  // as launch.cuh launch_decode_kernel
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return int(err);
  if (a->batch == 0) return 0;
  const cudaStream_t stream = static_cast<cudaStream_t>(a->stream);
  kernel<<<dim3(p.num_m_blocks * a->batch, a->num_kv_splits), mla::fast::Storage::kThreads, kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || a->num_kv_splits == 1) return int(err);
  using B = cutlass::bfloat16_t;
  return int(mla::launch_combine<B, B>(*a, stream, int64_t(a->batch) * a->q_len * a->num_heads, /*scheduled=*/false,
                                       a->num_kv_splits >= mla::kCombineWideMinSplits));
}

extern "C" int fast_h128_p64(const MlaDecodeArgs* a) { return launch<128, 64>(a); }
extern "C" int fast_h128_p1(const MlaDecodeArgs* a) { return launch<128, 1>(a); }
extern "C" int fast_h64_p64(const MlaDecodeArgs* a) { return launch<64, 64>(a); }
