// Host-only check (no GPU needed) of the transposed path's index math against CuTe's layouts:
//   - swizzled_offset(row, col, kRows), which the producer (Q) and consume_st (P^T stores) use, against
//     StLayouts::SmemLayoutQ / SmemLayoutPt addressed through a 1024-byte aligned smem_ptr (the swizzle
//     acts on the address, so the layouts are evaluated through a tensor, not called directly);
//   - the accumulator mapping consumer_st.cuh documents (token / latent row on M, query row on N) against
//     partition_C of StLayouts::TiledMmaS (64 x kRows) and TiledMmaO (512 x kRows);
//   - V^T (SmemLayoutVt) as the transpose of the KV tile (SmemLayoutKV).
// Build and run:
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Itemplates -I$(python3 -c "import cutlass_library,os;\
//     print(os.path.dirname(cutlass_library.__file__))")/source/include tests/design/st_layout_check.cu -o /tmp/st_check && /tmp/st_check
#include <cstdio>

#include "mla/layouts.cuh"

using namespace cute;


alignas(4096) static char g_base[1 << 17];

template <class Layout>
int check_smem(const char* name, Layout layout, int rows, int cols) {
  auto t = make_tensor(make_smem_ptr(reinterpret_cast<cutlass::bfloat16_t*>(g_base)), layout);
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      bad += uint32_t(reinterpret_cast<char*>(&t(r, c)) - g_base) != mla::swizzled_offset(r, c, rows);
  printf("%-12s %d mismatches\n", name, bad);
  return bad;
}

template <int R>
int check_rows() {
  using E = cutlass::bfloat16_t;
  using LS = mla::StLayouts<E, R>;
  int bad = check_smem(R == 16 ? "Q (16 rows)" : "Q (8 rows)", typename LS::SmemLayoutQ{}, R, mla::kHeadDimK);
  bad += check_smem(R == 16 ? "P^T (16)" : "P^T (8)", typename LS::SmemLayoutPt{}, R, mla::kBlockN);
  typename LS::TiledMmaS mma_s;
  typename LS::TiledMmaO mma_o;
  int bad_s = 0, bad_o = 0;
  for (int tid = 0; tid < 128; ++tid) {
    const int warp = tid / 32, lane = tid % 32;
    auto cs = mma_s.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<_64, Int<R>>{}));
    for (int e = 0; e < size(cs); ++e) {
      const int tok = 16 * warp + lane / 4 + 8 * ((e >> 1) & 1), n = (e >> 2) * 8 + 2 * (lane % 4) + (e & 1);
      bad_s += get<0>(cs(e)) != tok || get<1>(cs(e)) != n;
    }
    auto co = mma_o.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<_512, Int<R>>{}));
    for (int m = 0; m < size<1>(co); ++m)
      for (int e = 0; e < size<0>(co); ++e) {
        const int d = 64 * m + 16 * warp + lane / 4 + 8 * ((e >> 1) & 1), n = (e >> 2) * 8 + 2 * (lane % 4) + (e & 1);
        bad_o += get<0>(co(e, m, 0)) != d || get<1>(co(e, m, 0)) != n;
      }
  }
  printf("rows %2d: S^T fragment %d mismatches, O^T fragment %d mismatches\n", R, bad_s, bad_o);
  return bad + bad_s + bad_o;
}

int main() {
  using E = cutlass::bfloat16_t;
  using L = mla::KernelLayouts<E>;
  int bad = check_smem("Q (64 rows)", L::SmemLayoutQ{}, mla::kBlockM, mla::kHeadDimK);  // the reference path
  bad += check_rows<16>() + check_rows<8>();
  auto vt = make_tensor(make_smem_ptr(reinterpret_cast<E*>(g_base)), L::SmemLayoutVt{});
  auto kv = make_tensor(make_smem_ptr(reinterpret_cast<E*>(g_base)), L::SmemLayoutKV{});
  int bad_v = 0;
  for (int d = 0; d < mla::kHeadDimV; ++d)
    for (int t = 0; t < mla::kBlockN; ++t) bad_v += &vt(d, t) != &kv(t, d);
  printf("V^T vs KV    %d mismatches\n", bad_v);
  bad += bad_v;
  printf(bad == 0 ? "OK\n" : "FAILED\n");
  return bad != 0;
}
