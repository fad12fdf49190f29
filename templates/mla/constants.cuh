// Fixed dimensions and tile sizes of the MLA decode kernel (see kernel.cuh for how they are used).
#pragma once

namespace mla {

constexpr int kKvLoraRank = 512;      // latent width; V is the first kKvLoraRank values of a row
constexpr int kRopeDim = 64;          // qk_rope_head_dim
constexpr int kHeadDimK = kKvLoraRank + kRopeDim;  // 576 values per cached token
constexpr int kHeadDimV = kKvLoraRank;             // 512

constexpr int kBlockM = 64;           // query rows (q_len x num_heads, padded) per CTA
constexpr int kBlockN = 64;           // KV tokens per pipeline stage
constexpr int kStages = 2;            // shared-memory ring depth for KV tiles
constexpr int kNumWarpgroups = 2;     // both compute: each owns half the tokens of S and half of O
constexpr int kNumThreads = 128 * kNumWarpgroups;

constexpr int kChunkElems = 8;        // 16-byte copy chunk, in 16-bit elements
constexpr int kChunksPerRow = kHeadDimK / kChunkElems;  // 72
constexpr int kThreadsPerRow = 8;     // threads that copy one 1152-byte token row together

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kHeadDimK % 64 == 0, "576 must tile into 64-column swizzle atoms");
static_assert(kBlockN == 32 * kNumWarpgroups, "each warpgroup owns 32 tokens of S");

}  // namespace mla
