// Configuration of the MLA decode kernels: fixed dimensions, tile sizes, register budgets, the
// tuning policy, and the path traits that say which kernels a variant (Cache, NUM_HEADS, PAGE_SIZE,
// SPLIT) runs. docs/design.md explains each path and the measurements behind every value here;
// tuning a value is an edit of this file.
//
// The path traits are the C++ half of one fact: codegen (codegen/variant.py, PathFacts) computes the
// same facts per variant, renders them into the variant's translation unit, where launch.cuh
// static_asserts them against VariantTraits below, and writes them into the build's manifest.json,
// which the Python runtime reads. Change a rule here and there together; the build fails otherwise.
#pragma once
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

namespace mla {

// ---------------------------------------------------------------------------------------------
// Dimensions of a DeepSeek MLA cache row.

constexpr int kKvLoraRank = 512;                   // latent width; V is the first kKvLoraRank values of a row
constexpr int kRopeDim = 64;                       // qk_rope_head_dim
constexpr int kHeadDimK = kKvLoraRank + kRopeDim;  // 576 values per cached token
constexpr int kHeadDimV = kKvLoraRank;             // 512

// ---------------------------------------------------------------------------------------------
// Tiles and rings.

constexpr int kBlockM = 64;            // query rows (q_len x num_heads, padded) per CTA of the 64-row path
constexpr int kBlockN = 64;            // KV tokens per tile; splits and schedules cut keys in these units
constexpr int kStages = 2;             // tiles resident in the 16-bit shared-memory ring
constexpr int kStagesStFp8 = 4;        // raw e4m3 stages of the transposed fp8 ring (tile t in stage t % 4)
constexpr int kStagesStFp8Rows32 = 3;  // ... at 32 rows per CTA, where the 66 KiB merge buffer must fit beside it
constexpr int kShortTileN = 32;        // KV tokens per tile of the fp8 short-split kernel
constexpr int kShortStages = 4;        // its fp16 stages (the same 144 KiB as two stages of 64 tokens)
constexpr int kSubTileCols = 64;       // a tile lands in 64-column sub-tiles (one swizzle atom wide)
constexpr int kSubTiles = kHeadDimK / kSubTileCols;  // 9: 8 of the latent part (K and V), 1 RoPE (K only)
constexpr int kNumWarpgroups = 2;      // math warpgroups of the 64-row and 16-bit transposed paths
constexpr int kStMathWgsFp8 = 3;       // math warpgroups of the transposed fp8 path at 8 or 16 rows
constexpr int kProducerThreads = 128;  // the producer warpgroup

constexpr int kChunkElems = 8;                          // 16-byte copy chunk, in 16-bit elements
constexpr int kChunksPerRow = kHeadDimK / kChunkElems;  // 72
constexpr int kThreadsPerRow = 8;                       // producer threads that copy one 1152-byte Q row together

// ---------------------------------------------------------------------------------------------
// setmaxnreg budgets (producer / math warpgroups). __launch_bounds__(threads, 1) gives each thread
// 65536 / threads rounded down to a multiple of 8, and a warpgroup's setmaxnreg.inc waits until the
// pool has what it asks for, so a larger sum would hang every CTA (regs_fit below).

#if defined(MLA_TRACE) && MLA_TRACE
// A trace build (trace.cuh) also stamps from the producer, whose page-1 gathers fill 40 registers.
constexpr int kProducerRegs = 48;  // 64-row path, 16-bit caches
constexpr int kMathRegs = 224;
#else
constexpr int kProducerRegs = 40;  // 64-row path, 16-bit caches
constexpr int kMathRegs = 232;
#endif
constexpr int kProducerRegsFp8 = 80;  // 64-row path, fp8 (copy + widening warps)
constexpr int kMathRegsFp8 = 208;
constexpr int kProducerRegsSt = 56;  // transposed path, two math warpgroups
constexpr int kMathRegsSt = 224;
constexpr int kProducerRegsSt32Fp8 = 40;  // transposed fp8 path at 32 rows (O^T alone is 128 registers)
constexpr int kMathRegsSt32Fp8 = 232;
constexpr int kProducerRegsSt3 = 56;  // transposed fp8 path with three math warpgroups (512 threads)
constexpr int kMathRegsSt3 = (65536 - kProducerRegsSt3 * kProducerThreads) / (3 * 128) / 8 * 8;  // 152

constexpr bool regs_fit(int producer_regs, int math_regs, int math_wgs) {
  return producer_regs * kProducerThreads + math_regs * 128 * math_wgs <=
         65536 / (kProducerThreads + 128 * math_wgs) / 8 * 8 * (kProducerThreads + 128 * math_wgs);
}
static_assert(regs_fit(kProducerRegs, kMathRegs, kNumWarpgroups), "register file");
static_assert(regs_fit(kProducerRegsSt, kMathRegsSt, kNumWarpgroups), "register file");
static_assert(regs_fit(kProducerRegsFp8, kMathRegsFp8, kNumWarpgroups), "register file");

// ---------------------------------------------------------------------------------------------
// Policy: values chosen by measurement (docs/design.md).

// 17..32-head 16-bit variants run their 64-row kernel instead of the transposed one on launches whose
// splits all hold fewer keys than this.
constexpr int kSt32MinKeys = 1024;
// fp8 split variants of the 64-row path run their short-split kernel on launches whose splits all hold
// at most this many keys (a multiple of kBlockN).
constexpr int kFp8ShortSplitKeys = 128;
static_assert(kFp8ShortSplitKeys > 0 && kFp8ShortSplitKeys % kBlockN == 0, "splits are whole 64-key tiles");
// Split calls keep their partial outputs in the output's 16-bit type from this many heads up, fp32 below.
constexpr int kPartial16MinHeads = 64;
// The balanced schedule keeps its balanced cut only when priced below this times the uniform-equivalent
// cut; a piece of a request that several CTAs share costs kPieceCost tiles (schedule.cuh).
constexpr float kBalancedMargin = 0.85f;
constexpr float kPieceCost = 0.07f;

// ---------------------------------------------------------------------------------------------
// What a cache dtype computes in. bf16 and fp16 caches run the tensor cores in their own type. An fp8
// e4m3 cache is widened to fp16 (exact: every e4m3 value is an fp16 value); q (bf16) is converted to
// fp16 times kFp8QPrescale (exact unless |q| < 2^-6, where fp16 subnormals keep fewer bits; the factor
// keeps |q| up to 2^24 finite) and out is bf16.
template <class Cache>
struct CacheTypes {
  using Mma = Cache;
  using Q = Cache;
  using Out = Cache;
  static constexpr bool kFp8 = false;
  static constexpr bool kFast = false;
};
template <>
struct CacheTypes<cutlass::float_e4m3_t> {
  using Mma = cutlass::half_t;
  using Q = cutlass::bfloat16_t;
  using Out = cutlass::bfloat16_t;
  static constexpr bool kFp8 = true;
  static constexpr bool kFast = false;
};
// The fast mode of an fp8 e4m3 cache (variants.yaml dtype fp8_e4m3_fast): the same cache bytes, with
// fp8 tensor-core math on them (fp8_fast.cuh: q rounded to e4m3 per row, P to e4m3); q and out bf16.
// A tag: the cache's element type is still cutlass::float_e4m3_t.
struct Fp8FastCache {};
template <>
struct CacheTypes<Fp8FastCache> {
  using Mma = cutlass::float_e4m3_t;
  using Q = cutlass::bfloat16_t;
  using Out = cutlass::bfloat16_t;
  static constexpr bool kFp8 = true;
  static constexpr bool kFast = true;
};
constexpr float kFp8QPrescale = 1.f / 256.f;

// ---------------------------------------------------------------------------------------------
// Path traits.

// Variants of at most 32 heads run the transposed path (consumer_st.cuh): S^T = K Q^T with the tile's
// tokens on wgmma M and 8 (up to 8 heads), 16 (9..16) or 32 (17..32) query rows per CTA on N. The
// others run the 64-row path (consumer_rows64.cuh). Rows are (qi, h) pairs, row = qi * NUM_HEADS + h.
template <int NUM_HEADS, bool kFp8>
constexpr bool kUseSt = NUM_HEADS <= 32;
template <int NUM_HEADS, bool kFp8>
constexpr int kRowBlock = kUseSt<NUM_HEADS, kFp8> ? (NUM_HEADS <= 8 ? 8 : NUM_HEADS <= 16 ? 16 : 32) : kBlockM;
// A request's q_len x NUM_HEADS rows share one read of its keys when one CTA holds them: a transposed
// variant also has kernels of twice and four times its row block, up to kStMaxRows, and a 16-bit one
// the 64-row kernel (its second unit, SecondKernel::kRows64) above that; a launch takes the smallest
// that holds q_len x NUM_HEADS rows (rows_for), at most kMaxRowBlock. The 64-row path has one row block.
constexpr int kStMaxRows = 32;
template <int NUM_HEADS, bool kFp8>
constexpr int kMaxRowBlock = kUseSt<NUM_HEADS, kFp8> && kFp8 ? kStMaxRows : kBlockM;
// The rows per CTA of a launch with q_rows = q_len x NUM_HEADS rows per request, for a variant whose own
// row block is own_rows and largest max_rows (codegen/variant.py PathFacts.rows_for).
constexpr int rows_for(int q_rows, int own_rows, int max_rows) {
  int rows = own_rows;
  while (rows < q_rows && rows < max_rows) rows *= 2;
  return rows;
}

// Whether a kernel of ROWS rows per CTA loads full KV tiles with TMA: the 64-row path with pages of
// whole 64-token tiles (every split starts at a multiple of kBlockN, so a tile is 64 tokens of one page).
template <class Cache, int PAGE_SIZE, int ROWS>
constexpr bool kTmaPages = PAGE_SIZE % kBlockN == 0 && ROWS == kBlockM;

// Whether split calls keep 16-bit partial outputs (kPartial16MinHeads).
template <int NUM_HEADS>
constexpr bool kPartial16 = NUM_HEADS >= kPartial16MinHeads;

// Variants that can run a balanced schedule (schedule.cuh): the 64-row path of 16-bit caches.
template <class Cache, int NUM_HEADS>
constexpr bool kSchedulable = !kUseSt<NUM_HEADS, CacheTypes<Cache>::kFp8> && !CacheTypes<Cache>::kFp8;

// A variant's second kernel, compiled in its second translation unit (second_kernel.cuh) and launched
// instead of its own when every split of the launch holds at most kSecondMaxSplitKeys keys:
// - kShortSplit: fp8 split variants of the 64-row path, exact and fast alike: the exact kernel with
//   32-token tiles in four stages (kFp8ShortSplitKeys);
// - kRows64: transposed 16-bit variants, the 64-row kernel beside their transposed ones. It runs for
//   requests of more than kStMaxRows rows (rows_for) and, at 17..32 heads, for splits of fewer than
//   kSt32MinKeys keys.
enum class SecondKernel : int { kNone = 0, kShortSplit = 1, kRows64 = 2 };

// A fast-mode variant (CacheTypes::kFast) runs the fp8 fast kernel: 64 rows per CTA (rows of missing
// heads masked), TMA on pages that are multiples of 64 (tma_map.cuh's fast map); a split one also runs a balanced schedule (fp8_fast.cuh SCHED) and,
// on splits of at most kFp8ShortSplitKeys keys, the exact fp8 short-split kernel as its second kernel
// (second_kernel.cuh), which is faster on splits that short.
template <class Cache, int NUM_HEADS, int PAGE_SIZE, bool SPLIT>
struct VariantTraits {
  static constexpr bool kFp8 = CacheTypes<Cache>::kFp8;
  static constexpr bool kFast = CacheTypes<Cache>::kFast;
  static constexpr int kRows = kFast ? kBlockM : kRowBlock<NUM_HEADS, kFp8>;
  static constexpr int kMaxRows = kFast ? kBlockM : kMaxRowBlock<NUM_HEADS, kFp8>;
  static constexpr SecondKernel kSecond = kFast                                        ? (SPLIT ? SecondKernel::kShortSplit : SecondKernel::kNone)
                                          : kUseSt<NUM_HEADS, kFp8> && !kFp8           ? SecondKernel::kRows64
                                          : !kUseSt<NUM_HEADS, kFp8> && kFp8 && SPLIT ? SecondKernel::kShortSplit
                                                                                       : SecondKernel::kNone;
  // 0: the second kernel never runs for short splits (it may still run for wide requests).
  static constexpr int kSecondMaxSplitKeys = kSecond == SecondKernel::kShortSplit     ? kFp8ShortSplitKeys
                                             : kSecond == SecondKernel::kRows64 && kRows == 32
                                                 ? kSt32MinKeys - kBlockN
                                                 : 0;
  static constexpr bool kTma = kTmaPages<Cache, PAGE_SIZE, kRows>;
  // The short-split kernel gathers with cp.async only; the 64-row second kernel is the 64-row path.
  static constexpr bool kSecondTma = kSecond == SecondKernel::kRows64 && kTmaPages<Cache, PAGE_SIZE, kBlockM>;
  static constexpr bool kBalanced = SPLIT && (kFast || kSchedulable<Cache, NUM_HEADS> || kUseSt<NUM_HEADS, kFp8>);
  // The scheduled transposed kernels run one CTA per entry of the schedule's segment table; the 64-row
  // and fast kernels one CTA per run of segments (schedule.cuh).
  static constexpr bool kSegmentCtas = SPLIT && !kFast && kUseSt<NUM_HEADS, kFp8>;
};

// The facts codegen renders for one variant (codegen/variant.py PathFacts, in this order).
template <int ROWS, SecondKernel SECOND, int SECOND_MAX_SPLIT_KEYS, bool TMA, bool SECOND_TMA, bool BALANCED,
          int TILE_KEYS, int SECOND_ROWS, int MAX_ROWS, bool SEGMENT_CTAS>
struct PathFacts {
  static constexpr int kRows = ROWS;
  static constexpr SecondKernel kSecond = SECOND;
  static constexpr int kSecondMaxSplitKeys = SECOND_MAX_SPLIT_KEYS;
  static constexpr bool kTma = TMA;
  static constexpr bool kSecondTma = SECOND_TMA;
  static constexpr bool kBalanced = BALANCED;
  static constexpr int kTileKeys = TILE_KEYS;
  static constexpr int kSecondRows = SECOND_ROWS;
  static constexpr int kMaxRows = MAX_ROWS;
  static constexpr bool kSegmentCtas = SEGMENT_CTAS;
};

// Fails the build, naming the field, where codegen's facts (Facts) and these traits disagree: a rule
// changed on one side only. Both second kernels have kBlockM rows per CTA.
template <class Facts, class Traits>
constexpr bool facts_match() {
  static_assert(Facts::kRows == Traits::kRows, "path facts: rows_per_cta differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kSecond == Traits::kSecond, "path facts: second_kernel differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kSecondMaxSplitKeys == Traits::kSecondMaxSplitKeys,
                "path facts: second_max_split_keys differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kTma == Traits::kTma, "path facts: tma differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kSecondTma == Traits::kSecondTma, "path facts: second_tma differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kBalanced == Traits::kBalanced,
                "path facts: balanced_schedule differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kTileKeys == kBlockN, "path facts: tile_keys differs from config.cuh kBlockN");
  static_assert(Facts::kSecondRows == kBlockM, "path facts: second_rows_per_cta differs from config.cuh kBlockM");
  static_assert(Facts::kMaxRows == Traits::kMaxRows, "path facts: max_rows_per_cta differs between codegen/variant.py and config.cuh");
  static_assert(Facts::kSegmentCtas == Traits::kSegmentCtas, "path facts: segment_ctas differs between codegen/variant.py and config.cuh");
  return true;
}

static_assert(kHeadDimK % 64 == 0, "576 must tile into 64-column swizzle atoms");
static_assert(kSubTiles * kSubTileCols == kHeadDimK && kKvLoraRank == 4 * kNumWarpgroups * kSubTileCols,
              "each math warpgroup reads V from 4 latent sub-tiles");

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace mla
