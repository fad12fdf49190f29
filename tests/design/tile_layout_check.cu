// Host-only check (no GPU needed) of the 64-row path's index math against CuTe's layouts, for both tile
// widths (KernelLayouts<Element, kTileN>: 64 tokens, and 32 in the fp8 short-split kernel):
//   - swizzled_offset(row, col, kTileN), which the fp8 widening stores use, against SmemLayoutKV;
//   - p_offset<kTileN>(row, col), which exp_store_p's P stores use, against SmemLayoutP (the 128-byte
//     swizzle at 64 tokens, the 64-byte one at 32);
//   - V^T (SmemLayoutVt) as the transpose of the KV tile (SmemLayoutKV): one copy serves K and V;
//   - the accumulator mapping that scale_mask_rowmax and exp_store_p assume (element i of a thread:
//     row row0 + 8 ((i >> 1) & 1), column (i >> 2) 8 + 2 (lane % 4) + (i & 1)) against partition_C
//     of TiledMmaS (64 x kTileN).
// The layouts are evaluated through tensors on a 4096-byte aligned buffer (the swizzle acts on the
// address). Build and run (tests/test_design_checks.py does):
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Itemplates -I<cutlass include> \
//     tests/design/tile_layout_check.cu -o /tmp/tile_check && /tmp/tile_check
#include <cstdio>

#include "mla/layouts.cuh"

using namespace cute;

alignas(4096) static char g_base[1 << 17];

template <int kTileN>
int check_tile() {
  using E = cutlass::half_t;
  using L = mla::KernelLayouts<E, kTileN>;
  auto at = [](auto& t, int r, int c) { return uint32_t(reinterpret_cast<char*>(&t(r, c)) - g_base); };
  auto kv = make_tensor(make_smem_ptr(reinterpret_cast<E*>(g_base)), typename L::SmemLayoutKV{});
  auto p = make_tensor(make_smem_ptr(reinterpret_cast<E*>(g_base)), typename L::SmemLayoutP{});
  auto vt = make_tensor(make_smem_ptr(reinterpret_cast<E*>(g_base)), typename L::SmemLayoutVt{});
  int bad_kv = 0, bad_p = 0, bad_v = 0, bad_s = 0;
  for (int t = 0; t < kTileN; ++t)
    for (int c = 0; c < mla::kSubTileCols; ++c)  // one slot (the widening writes slot by slot)
      bad_kv += at(kv, t, c) != mla::swizzled_offset(t, c, kTileN);
  for (int t = 0; t < kTileN; ++t)  // slot c starts at c x kTileN x 128 bytes
    for (int c = 0; c < mla::kHeadDimK; ++c)
      bad_kv += at(kv, t, c) != uint32_t(c / 64) * kTileN * 128u + mla::swizzled_offset(t, c % 64, kTileN);
  for (int r = 0; r < mla::kBlockM; ++r)
    for (int c = 0; c < kTileN; ++c) bad_p += at(p, r, c) != mla::p_offset<kTileN>(r, c);
  bad_p += int(cosize(typename L::SmemLayoutP{}) * sizeof(E)) > kTileN * mla::kSubTileCols * int(sizeof(E));
  for (int d = 0; d < mla::kHeadDimV; ++d)
    for (int t = 0; t < kTileN; ++t) bad_v += &vt(d, t) != &kv(t, d);
  typename L::TiledMmaS mma_s;
  for (int tid = 0; tid < 128; ++tid) {
    const int lane = tid % 32, row0 = (tid / 32) * 16 + lane / 4;
    auto cs = mma_s.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<mla::kBlockM>, Int<kTileN>>{}));
    bad_s += size(cs) != mla::kBlockM * kTileN / 128;
    for (int i = 0; i < size(cs); ++i) {
      const int row = row0 + 8 * ((i >> 1) & 1), col = (i >> 2) * 8 + 2 * (lane % 4) + (i & 1);
      bad_s += get<0>(cs(i)) != row || get<1>(cs(i)) != col;
    }
  }
  printf("tile %2d: KV %d, P %d, V^T %d, S fragment %d mismatches\n", kTileN, bad_kv, bad_p, bad_v, bad_s);
  return bad_kv + bad_p + bad_v + bad_s;
}

int main() {
  const int bad = check_tile<64>() + check_tile<32>();
  printf(bad == 0 ? "OK\n" : "FAILED\n");
  return bad != 0;
}
