// wgmma batches and slot releases that both math paths issue: S over the nine sub-tiles of a KV tile
// as each lands, P V, and the math warps' arrivals on a slot's empty barrier. A slot's full-barrier
// wait is all a reader needs: TMA slots and fp8 slots widened by the producer are fenced on the
// writer's side, and cp.async-filled slots are read after the mbarrier wait with no proxy fence, as
// CUTLASS's SM90 cp.async + GMMA mainloops do.
#pragma once
#include <cuda_runtime.h>

#include "arch.cuh"
#include "config.cuh"
#include "layouts.cuh"

namespace mla {

using namespace cute;

// Keeps the compiler from moving register accesses of a wgmma fragment across the async boundary.
template <class Frag>
__device__ __forceinline__ void fence_fragment(Frag& frag) {
  CUTE_UNROLL
  for (int i = 0; i < size(frag); ++i) warpgroup_fence_operand(frag(i));
}

// S = Q K^T over all 576 columns, each 64-column k-slice issued as soon as its slot has landed.
template <class TiledMma, class FragQ, class FragK, class FragS>
__device__ __forceinline__ void issue_s(TiledMma& mma, const FragQ& tSrQ, const FragK& tSrK, FragS& tSrS,
                                        uint64_t* full, int parity) {
  constexpr int kKStepsPerSubTile = kSubTileCols / 16;
  fence_fragment(tSrS);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int c = 0; c < kSubTiles; ++c) {
    wait_barrier(&full[c], parity);
    CUTE_UNROLL
    for (int k = c * kKStepsPerSubTile; k < (c + 1) * kKStepsPerSubTile; ++k) {
      cute::gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_commit_batch();
}

// O (+)= P V for this warpgroup's 256 columns of V, P and V read from shared memory.
template <class TiledMma, class FragP, class FragV, class FragO>
__device__ __forceinline__ void issue_pv(TiledMma& mma, const FragP& tOrP, const FragV& tOrV, FragO& tOrO) {
  fence_fragment(tOrO);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tOrP); ++k) cute::gemm(mma, tOrP(_, _, k), tOrV(_, _, k), tOrO);
  warpgroup_commit_batch();
}

// One arrival of this warp on each of `count` empty barriers starting at `first`.
__device__ __forceinline__ void release(uint64_t* first, int count, int lane) {
  if (lane == 0) {
    for (int j = 0; j < count; ++j) arrive_barrier(first + j);
  }
}

}  // namespace mla
