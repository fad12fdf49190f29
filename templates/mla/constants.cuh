// Fixed dimensions and tile sizes of the MLA decode kernel (see kernel.cuh for how they are used).
#pragma once

// MLA_TMA (default 1): bf16/fp16 variants with a page size that is a multiple of kBlockN load every
// full KV tile (all 64 tokens below the split's end) with TMA tensor copies, one 8 KiB box per
// sub-tile; -DMLA_TMA=0 compiles the cp.async gather back in for every tile (see producer.cuh).
#ifndef MLA_TMA
#define MLA_TMA 1
#endif

// MLA_ST (default 1): variants with at most 16 heads (and, with MLA_ST32 below, those of 17..32) run
// the transposed consumer (consumer_st.cuh; fp8 caches consumer_st_regs.cuh):
// S^T = K Q^T with the KV tile's 64 tokens on wgmma M and a CTA's 8, 16 or 32 query rows on N, so a
// 16-head, q_len-1 CTA no longer pays for a 64-row block of which 48 rows are padding.
// -DMLA_ST=0 compiles the 64-row "seesaw" path (consumer.cuh) back in for every variant (A/B).
#ifndef MLA_ST
#define MLA_ST 1
#endif

// MLA_ST32 (default 1; 0 for an A/B): variants of 17..32 heads run the transposed consumer too, with
// 32 query rows per CTA (wgmma n32), instead of the 64-row path with 32 rows of padding (fp8 caches:
// the register path with two math warpgroups and three raw stages, SharedStorageStFp8; with 0 their
// launches take the 64-row kernel again, which the Python split heuristic does not follow).
// At 32 heads the 64-row kernel streamed the cache at 3.0-4.2 TB/s where the 16-head transposed one
// reached 3.3-4.55 (docs/bench/v3.22.json); the transposed S^T and O^T wgmmas of 32 rows read the same
// A operand (the KV tile) as those of 16 and half the tensor work of the padded 64-row ones.
// The merge buffer of 32 rows (66 KiB) shares the idle KV ring (SharedStorageSt::kOxInRing).
#ifndef MLA_ST32
#define MLA_ST32 1
#endif
// MLA_ST32_MIN_KEYS (default 1024; 0: always the transposed kernel): such a variant also compiles the
// 64-row kernel (rows64.cuh, a second unit), and a launch whose splits can hold fewer keys than this
// (short_split_keys in launch.cuh) runs that one instead. Measured (docs/perf-notes.md v3.23, 48 bf16
// anchors at 32 heads): the transposed kernel is 2-9% faster from 1024 keys per CTA up (batch 128, and
// splits of 1024+), the 64-row one 3-8% faster below (batch 1-32 splits of 64-256 keys: its two
// warpgroups share every tile, the transposed ones take alternate tiles and merge 64 KiB of O^T at
// the end, and pages 64 / 128 load by TMA there).
#ifndef MLA_ST32_MIN_KEYS
#define MLA_ST32_MIN_KEYS 1024
#endif

// Switches of the transposed fp8 register path, measured on the H200 (docs/perf-notes.md, seventh
// session): MLA_ST_MERGE_V4 (default 1) merge_st writes and adds O^T as float4 in a chunk-swizzled
// order (0: the scalar merge, 8-way bank conflicts in the register path's row order; 0 is 5% slower);
// MLA_FP8_RING_SWIZZLE (default 1) 16-byte chunk q of raw row r sits at chunk q ^ ((r >> 1) & 3), so
// the V^T loads take 4 wavefronts instead of 8 (0 is 1.7% slower).
#ifndef MLA_ST_MERGE_V4
#define MLA_ST_MERGE_V4 1
#endif
#ifndef MLA_FP8_RING_SWIZZLE
#define MLA_FP8_RING_SWIZZLE 1
#endif

// MLA_PDL (default 1; 0 for an A/B): the combine kernel of a split call is a
// programmatic dependent launch that may be scheduled once every decode CTA has stored its results
// (the trigger is the last thing a decode CTA does), and waits for the decode grid's completion
// before it reads the workspace. The third session triggered earlier (at the start or after the main
// loop) and lost up to 18 us when early combine CTAs crowded onto the few SMs the decode grid left idle;
// this trigger measured 1-4 us faster on every split call (perf-notes, seventh session).
#ifndef MLA_PDL
#define MLA_PDL 1
#endif

// MLA_FP8_ST_WGS (default 3; 2 = v3.7's two warpgroups and wgmma batches, for an A/B): math warpgroups
// of the transposed fp8 register path. ncu (perf-notes, v3.7) found its two math warps per scheduler
// stalled on their own load -> convert -> wgmma chains with the SM issuing on half its cycles; a third
// warpgroup owning whole tiles gives each scheduler three such warps (512 threads: 128 registers each
// at launch, setmaxnreg 56 for the producer and 152 for the math warpgroups). Measured (perf-notes,
// eighth session): 14 fp8 16-head anchors 5% faster (batch >= 32 4-10%), batch 1 unchanged. 32-row CTAs
// (17..32 heads) always run two (SharedStorageStFp8).
#ifndef MLA_FP8_ST_WGS
#define MLA_FP8_ST_WGS 3
#endif

// (On the transposed fp8 register path the math warpgroups round Q, consumer_st_regs.cuh convert_q_st_fp8;
// v3.25-v3.26's MLA_FP8_Q_BY_MATH=0, the producer rounding it, and MLA_FP8_Q_FIRST, Q's copies at CTA
// entry, measured 0.991x and 0.998x of it and are removed: docs/perf-notes.md v3.25, v3.26.)
// MLA_ST_ROW_OUT_ONCE (default 1): on the fp8 register path, whose merge
// has no registers to spare for the rows' output scale and lse (kRowOutInMerge), store_rows_st_to works
// them out once per row (one thread a row, into s.row_out, then a barrier) instead of in each of its
// rolled passes by all 64 threads of the row: a chain of shared loads, exp2f, log2f and a division per
// pass. The batch-1 trace (v3.25) had the fp8 CTA's store at 1.89 us against bf16's 1.09 at 16 heads
// (3 passes against 4) and 3.33 at 32 heads (8 passes). v3.26: 1.008 over 48 fp8 anchors, 16/32 heads
// at batch 1 2-3% faster. 0: every pass works them out again.
#ifndef MLA_ST_ROW_OUT_ONCE
#define MLA_ST_ROW_OUT_ONCE 1
#endif

// MLA_FP8_S_FIRST (default 0): the seesaw order of the 64-row fp8 kernel with 64-token tiles (consumer.cuh
// consume_two_stage kSFirst; the short-split kernel, below, always runs S first);
// 0 releases a tile after its P V before the next S is issued, which leaves the fp8 producer more slack.
// Measured: 1 is 1.012 on the 128-head fp8 anchors (v3.9). ncu's warp sampling of the 64-row fp8
// kernel (perf-notes v3.16) finds with 0 each math warpgroup waiting a third of its time for the
// other's softmax, and with S first and tile a still released before the softmax of tile b (tried in
// v3.16: 1.014, and 1.018 for bf16) the math warps waiting for widened tiles instead: two fp16 stages
// do not hide a slot's refill (release, copy, widen). A deeper ring (four stages of 32 tokens, v3.17)
// pays only on short splits, so it became the short-split kernel below.
#ifndef MLA_FP8_S_FIRST
#define MLA_FP8_S_FIRST 0
#endif

// MLA_FP8_TMA (default 1; needs MLA_TMA): on the 64-row fp8 path with a page size that is a multiple
// of 64, the copy warps load each full 64-token tile's raw bytes by TMA (one box of 64 bytes x 64
// tokens per slot, no swizzle: the raw rows are plain row-major at kRawSlotOffset of each slot)
// instead of 256 16-byte cp.async per slot; the tile that holds kv_end keeps cp.async and its zero
// fill, and so does the short-split kernel. Measured (perf-notes v3.19): 0.973 geomean over 74 fp8
// anchors at 32-128 heads, pages 64/128; 0.93-0.98 at batch >= 32 x 4096+; S first on top gave most of that back (0.998).
// 0 compiles cp.async back in for every fp8 tile (MLA_TMA=0 in the environment does that at run time).
#ifndef MLA_FP8_TMA
#define MLA_FP8_TMA 1
#endif

// MLA_KV_READER_FENCE (default 0; 1 restores the fence): whether the math warps issue fence.proxy.async
// after each KV slot's full barrier, before their wgmma read the slot (consumer.cuh issue_s). ptxas
// makes it MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, one per slot of every S a math warpgroup issues; the stall ledger of
// 128 x 128 x 16384 at page 1 put ~11% of the samples on those fences and the WARPGROUP.ARRIVE behind
// them. The fence is redundant for TMA slots (async proxy on both sides, ordered by the complete_tx
// barrier) and for fp8 slots (the widening warps fence before they arrive); cp.async slots (bf16 /
// fp16 gathers, and Q) are the case it was for, and there we follow CUTLASS's SM90 cp.async + GMMA
// warp-specialized mainloops and FlashInfer's Hopper MLA kernel, which read cp.async-filled shared
// memory with wgmma after the mbarrier wait and no proxy fence. Measured (perf-notes v3.20): 0.973 over
// 114 bf16 anchors at 16/64/128 heads, pages 1/16/64 (128 heads page 1 at 32 x 16384 and 128 x 4096+:
// 0.90-0.92).
#ifndef MLA_KV_READER_FENCE
#define MLA_KV_READER_FENCE 0
#endif

// MLA_FP8_PROBE_NO_WIDEN (default 0; a timing probe, WRONG RESULTS): the 64-row fp8 path's widening
// warps wait for each slot's raw bytes and hand it on without converting, so the math reads raw bytes
// as fp16. What the kernel would take if widening were free: with S first too, whether the widening
// is what keeps fp8 at 128 heads 1.31x slower than bf16. Measured (perf-notes v3.18), 128 heads, batch
// 32-128, seq 4096-16384: 0.74-0.81 of the fp8 kernel's time with S first, 0.81-0.87 PV first.
// Rejected by their A/Bs in v3.18 and removed: a producer that widened in registers from global loads
// (1.17-1.21x geomean; 1.08-1.15x with an L2 prefetch ahead of it), S(b) queued behind P V(a) (1.20x)
// and an L2 prefetch of the next tile (1.04x). Benchmark without --check; never a default.
#ifndef MLA_FP8_PROBE_NO_WIDEN
#define MLA_FP8_PROBE_NO_WIDEN 0
#endif
constexpr bool kFp8ProbeNoWiden = MLA_FP8_PROBE_NO_WIDEN != 0;

// MLA_EPI_STAGED: how the 64-row path's non-split kernels store the rows of `out` (split kernels,
// even run with one split, always store from the accumulators by pairs, kernel.cuh store_rows).
// 1 (default): through shared memory with 16-byte row-contiguous stores (kernel.cuh store_rows_staged)
// in kernels that load pages by TMA (page sizes that are multiples of 64), by pairs from the
// accumulators on the cp.async pages; 2: staged on every page (v3.12-v3.22); 0: never staged.
// Measured (docs/perf-notes.md v3.23, never staged against staged, batch 128 unsplit at 64/128 heads):
// page 1 0.976-1.000 (bf16) and 0.971-0.989 (fp8), page 64 0.980-1.008 (bf16) and 0.996-1.018 (fp8).
// v3.24 (1 against 2, batch 128): pages 1 / 16 1.010 / 1.018 (bf16), 1.020 / 1.016 (fp8) faster with 1.
#ifndef MLA_EPI_STAGED
#define MLA_EPI_STAGED 1
#endif
static_assert(MLA_EPI_STAGED >= 0 && MLA_EPI_STAGED <= 2, "MLA_EPI_STAGED is 0, 1 or 2");

// MLA_Q_FIRST (default 1; 0 for an A/B): the uniform 16-bit kernels issue Q's copies at the CTA's
// start, before the seq_lens load and the barrier set-up (Q's address does not depend on seq_len),
// and a math thread initialises the barriers, so the initialising thread has no copies of its own in
// flight. Measured (docs/perf-notes.md v3.13): 0.984-0.990 over 48-52 anchors at 16/128 heads, pages
// 1/64, in three A/B runs; batch 1 0.3-0.6 us per call faster.
#ifndef MLA_Q_FIRST
#define MLA_Q_FIRST 1
#endif

// MLA_PARTIAL_16: the element type of split calls' partial outputs in the workspace (kernel.cuh
// Partial). 0: fp32. 2: the output's 16-bit type, as FlashInfer keeps its split-KV partial states.
// 1 (default): 16-bit for variants of kPartial16MinHeads heads or more, fp32 below. A partial is
// normalised (a convex combination of V rows, times k_scale for fp8, up to P's 16-bit rounding), so it
// stays in the output's range except within one ulp of the type's largest value (an fp16 cache holding
// +-65504); the rounding adds at most half an ulp of the partial before the combine's fp32 weighted sum
// (lse stays fp32). 16-bit halves the bytes a split call's CTAs store at their end (128 KiB of fp32
// per 64-row CTA) and the combine reads; the 64-row path stores 16-bit pieces from the accumulators
// two column groups per store (full 32-byte sectors, kernel.cuh store_16_pairs; v3.15-v3.21 staged them
// in the idle ring, 1-2% slower, v3.22). Measured (docs/perf-notes.md v3.15), 16-bit against fp32:
// 64/128 heads 0.985 cold and 0.947 in a CUDA graph over 38 anchors (0.91 at batch 8-32 x 1024, up to
// 1.8 us slower at batch 1 x 1024-4096); 32 heads 1.065 (up to 1.15 at batch 1-8 x 1024); 16 heads
// (transposed path) 1.004. v3.11's version stored the pieces straight from the accumulators (half
// sectors) and measured slower. v3.22, 32 heads with the paired stores: 0.996 cold (batch 1 x 1024
// 1.05-1.08) and 0.96 in a CUDA graph over 18 anchors, so 32 heads keep fp32.
#ifndef MLA_PARTIAL_16
#define MLA_PARTIAL_16 1
#endif
static_assert(MLA_PARTIAL_16 >= 0 && MLA_PARTIAL_16 <= 2, "MLA_PARTIAL_16 is 0, 1 or 2");

namespace mla {

// Whether a variant with NUM_HEADS heads keeps 16-bit partial outputs (MLA_PARTIAL_16 above).
constexpr int kPartial16MinHeads = 64;
template <int NUM_HEADS>
constexpr bool kPartial16 = MLA_PARTIAL_16 == 2 || (MLA_PARTIAL_16 == 1 && NUM_HEADS >= kPartial16MinHeads);

constexpr int kKvLoraRank = 512;      // latent width; V is the first kKvLoraRank values of a row
constexpr int kRopeDim = 64;          // qk_rope_head_dim
constexpr int kHeadDimK = kKvLoraRank + kRopeDim;  // 576 values per cached token
constexpr int kHeadDimV = kKvLoraRank;             // 512

constexpr int kBlockM = 64;           // query rows (q_len x num_heads, padded) per CTA
constexpr int kBlockN = 64;           // KV tokens per tile
constexpr int kStages = 2;            // tiles resident in the shared-memory ring
constexpr int kStagesStFp8 = 4;       // raw e4m3 stages of the transposed fp8 ring (tile t in stage t % 4)
constexpr int kStagesStFp8Rows32 = 3; // ... at 32 rows per CTA, where the 66 KiB merge buffer must fit beside it
// Short splits of fp8 caches (MLA_FP8_SHORT_SPLIT_KEYS): a split variant of the 64-row path whose
// launch gives each split at most this many keys (bounded by the caller's max_seq_len, else the block
// table's capacity; launch.cuh) runs a second kernel, with 32-token tiles in four fp16 stages (the same
// 144 KiB as two stages of 64; tile t in stage t % 4) and the S-first seesaw order. A split that short
// is latency-bound: its first tile lands and is widened in half the time. Longer splits keep 64-token
// tiles, whose wider wgmmas and fewer barriers win once the work is long. Measured (docs/perf-notes.md
// v3.17, 74 fp8 anchors at 32-128 heads, L2 flushed): at 128 keys per split the 64-token kernel takes
// 1.03-1.08x the short one's time; at 256 0.98-1.01x; at 512 and more the short one is 3-19% slower.
// Replayed back to back in a CUDA graph (the cache then stays in L2) the short kernel is 4-8% slower
// at 128 keys and 7-10% at 256: the default keeps it to the 128-key splits, where cold calls gain.
// 0 turns it off.
#ifndef MLA_FP8_SHORT_SPLIT_KEYS
#define MLA_FP8_SHORT_SPLIT_KEYS 128
#endif
static_assert(MLA_FP8_SHORT_SPLIT_KEYS >= 0 && MLA_FP8_SHORT_SPLIT_KEYS % 64 == 0,
              "MLA_FP8_SHORT_SPLIT_KEYS: 0 or a multiple of 64 (splits are whole 64-key tiles)");
constexpr int kShortTileN = 32;       // KV tokens per tile of the short-split fp8 kernel
constexpr int kShortStages = 4;       // its fp16 stages
constexpr int kSubTileCols = 64;      // a tile lands in 64-column sub-tiles (one swizzle atom wide)
constexpr int kSubTiles = kHeadDimK / kSubTileCols;  // 9: 8 of the latent part (K and V), 1 RoPE (K only)
constexpr int kNumWarpgroups = 2;     // math warpgroups: each owns half of O (256 columns) and alternate tiles' S
constexpr int kProducerThreads = 128; // one more warpgroup gathers Q and the KV tiles with cp.async
constexpr int kNumThreads = kProducerThreads + 128 * kNumWarpgroups;
constexpr int kProducerRegs = 40;     // setmaxnreg budgets: 40 x 128 + 232 x 256 <= 65536
constexpr int kMathRegs = 232;
// Transposed path (MLA_ST), bf16/fp16: its math warpgroups need far fewer registers (O^T is 64 per
// thread), and the 40-register producer spilled 4 bytes in the 8-row variants; same total as above.
constexpr int kProducerRegsSt = 56;
constexpr int kMathRegsSt = 224;
// The fp8 register path at 32 rows (two math warpgroups): O^T of 32 rows is 128 registers, and at 224
// the math warpgroups spilled 16 bytes; the producer (copies only) runs at the 64-row path's 40.
constexpr int kProducerRegsSt32Fp8 = 40;
constexpr int kMathRegsSt32Fp8 = 232;
constexpr int kStMathWgsFp8 = MLA_FP8_ST_WGS;  // math warpgroups of the transposed fp8 path (2 or 3)
static_assert(kStMathWgsFp8 == 2 || kStMathWgsFp8 == 3, "MLA_FP8_ST_WGS: 2 or 3");
// Three math warpgroups (512 threads, 128 registers each at launch): the producer keeps 56 and the math
// warpgroups get 152 (32 / 160 spilled in the producer of the page-1 split variants).
constexpr int kProducerRegsSt3 = 56;
constexpr int kMathRegsSt3 = (65536 - kProducerRegsSt3 * kProducerThreads) / (3 * 128) / 8 * 8;  // 152
constexpr int kProducerRegsFp8 = 80;  // fp8 producer (copy + widen warps): 48 spilled; widening slot pairs needs 80
constexpr int kMathRegsFp8 = 208;

constexpr int kChunkElems = 8;        // 16-byte copy chunk, in 16-bit elements
constexpr int kChunksPerRow = kHeadDimK / kChunkElems;  // 72
constexpr int kThreadsPerRow = 8;     // producer threads that copy one 1152-byte Q row together

// The transposed path and its row block per CTA: 16 rows (wgmma n16) for 9..16 heads, 8 (n8) for up
// to 8. Rows are still (qi, h) pairs, row = qi * NUM_HEADS + h, so q_len > 1 fills the block.
// 17..32 heads take it too (MLA_ST32): 32 rows (wgmma n32). fp8 caches there run the register path
// with two math warpgroups (O^T of 32 rows is 128 of a thread's registers, more than the three
// warpgroups' 152 leave room for) and three raw stages (SharedStorageStFp8).
template <int NUM_HEADS, bool kFp8>
constexpr bool kUseSt = MLA_ST != 0 && (NUM_HEADS <= 16 || (MLA_ST32 != 0 && NUM_HEADS <= 32));
template <int NUM_HEADS, bool kFp8>
constexpr int kRowBlock = kUseSt<NUM_HEADS, kFp8> ? (NUM_HEADS <= 8 ? 8 : NUM_HEADS <= 16 ? 16 : 32) : kBlockM;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kHeadDimK % 64 == 0, "576 must tile into 64-column swizzle atoms");
static_assert(kSubTiles * kSubTileCols == kHeadDimK && kKvLoraRank == 4 * kNumWarpgroups * kSubTileCols,
              "each math warpgroup reads V from 4 latent sub-tiles");
// setmaxnreg moves registers within what the launch allocated: __launch_bounds__(kNumThreads, 1) gives
// each thread 65536 / kNumThreads rounded down to a multiple of 8 (168), and a warpgroup's
// setmaxnreg.inc waits until the pool has what it asks for, so a larger sum would hang every CTA.
constexpr int kLaunchRegs = 65536 / kNumThreads / 8 * 8;
static_assert(kProducerRegs * kProducerThreads + kMathRegs * 128 * kNumWarpgroups <= kLaunchRegs * kNumThreads,
              "register file");
static_assert(kProducerRegsSt * kProducerThreads + kMathRegsSt * 128 * kNumWarpgroups <= kLaunchRegs * kNumThreads,
              "register file");
static_assert(kProducerRegsFp8 * kProducerThreads + kMathRegsFp8 * 128 * kNumWarpgroups <= kLaunchRegs * kNumThreads,
              "register file");
// The same rule for a CTA of kProducerThreads + 128 * math_wgs threads (the storages' budgets).
constexpr bool regs_fit(int producer_regs, int math_regs, int math_wgs) {
  return producer_regs * kProducerThreads + math_regs * 128 * math_wgs <=
         65536 / (kProducerThreads + 128 * math_wgs) / 8 * 8 * (kProducerThreads + 128 * math_wgs);
}

}  // namespace mla
