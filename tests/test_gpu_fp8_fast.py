"""fp8_mode="fast" (the fp8_e4m3_fast variants, templates/mla/fp8_fast.cuh) against the fp32 reference on
the dequantized cache (skipped without an sm_90 GPU or without fast variants in the build).

As tests/test_gpu_fp8.py: caches written the way engines write them (N(0, 0.1^2) values quantized with
k_scale), the e4m3 NaN byte in unused slots, permuted block tables with junk past each request, outputs
prefilled with NaN, q_len 1-4, forced splits, seq_lens mixing 0, 1 and page boundaries, k_scale 0.0625 /
1 / 37.5 as a float and as a device tensor; plus varlen, a plan in a CUDA graph and the op. Tolerance:
mla_variants.testing.FP8_FAST_TOLERANCE (q and P are rounded to e4m3; its comment has the error model).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import (MLADecodePlan, MLAInputError, _binding, mla_decode, mla_decode_reference,  # noqa: E402
                          mla_decode_varlen, mla_decode_varlen_reference)
from mla_variants.plan import SCHEDULE_OVERHEAD_TILES_FP8_FAST  # noqa: E402
from mla_variants.testing import (FP8_FAST_TOLERANCE, capture_graph, compare, make_paged_case,  # noqa: E402
                                  replay_steps, run_nan_prefilled)

FP8 = torch.float8_e4m3fn


def _fast_keys():
    try:
        return sorted(k for k in _binding.library().table if k[2] == "fp8_e4m3_fast")
    except Exception:  # no build: the parametrized tests are skipped ("got empty parameter set")
        return []


def _any_fast_key():
    keys = _fast_keys()
    if not keys:
        pytest.skip("no fp8_e4m3_fast variant compiled")
    return sorted(keys, key=lambda k: (k[1] != 64, k[0] != 128))[0]


@pytest.mark.parametrize("key", _fast_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}_{'split' if k[3] else 'nosplit'}")
def test_fast_variant_against_reference(key):
    num_heads, page, _, split = key
    g = torch.Generator().manual_seed(1000 * key[0] + key[1] + 7 * key[3])  # not hash(): it varies per process
    for q_len, k_scale in ((1, 0.0625), (2, 37.5), (3, 1.0), (4, 1.0)):
        lens = [0, 1, max(page - 1, 1), page, page + 1, 3000 + 37 * q_len]
        case = make_paged_case(lens, num_heads, page, q_len, FP8, generator=g, k_scale=k_scale)
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale, k_scale=k_scale)
        for n in ([1, 2, 7, 256] if split else [1]):
            for scale_arg in (k_scale, torch.tensor([k_scale], device="cuda")):
                out, lse = run_nan_prefilled(case, n, k_scale=scale_arg, fp8_mode="fast")
                problems = compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
                assert not problems, f"{key} q_len={q_len} k_scale={k_scale} splits={n}: {problems}"
                assert torch.equal(out[0].float(), torch.zeros_like(out[0].float())) and torch.isneginf(lse[0]).all()


def test_fast_mode_runs_its_own_kernel():
    """The same call in both modes: the fast one rounds q and P to e4m3, so its result differs from the
    exact one (which shows the fast kernel ran) while both match the reference."""
    heads, page, _, _ = _any_fast_key()
    case = make_paged_case([700, 4100, 33], heads, page, 1, FP8, generator=torch.Generator().manual_seed(2),
                           k_scale=0.5)
    assert [l.symbol for l in _binding.library().plan(heads, page, "fp8_e4m3_fast", True)] == [
        f"mla_decode_h{heads}_p{page}_fp8_e4m3_fast_split"]
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.5)
    exact = run_nan_prefilled(case, 2, k_scale=0.5)
    fast = run_nan_prefilled(case, 2, k_scale=0.5, fp8_mode="fast")
    assert not compare(*fast, *ref, **FP8_FAST_TOLERANCE)
    assert not torch.equal(exact[0], fast[0])


@pytest.mark.parametrize("kv_mean", [0.1, 0.3])
def test_fast_out_keeps_the_cache_mean(kv_mean):
    """A cache whose values share a sign (N(kv_mean, 0.1^2)): out must stay a weighted mean of V. O sums
    the e4m3-rounded P, so dividing it by the unrounded P's row sums scaled each row by their ratio,
    up to ~0.8% here (lab/fp8_fast_error_model.py --kv-mean, design kernel vs kernel-l2); the kernel
    divides by the rounded P's sums. Measured per row: mean(out) / mean(reference) over the 512 dims
    (bf16 rounding of out averages out there)."""
    heads, page, _, _ = _any_fast_key()
    g = torch.Generator().manual_seed(41)
    case = make_paged_case([4096, 16384, 1500], heads, page, 1, FP8, generator=g, k_scale=0.5, kv_mean=kv_mean)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                            case.softmax_scale, k_scale=0.5)
    for n in (1, 4):
        out, lse = run_nan_prefilled(case, n, k_scale=0.5, fp8_mode="fast")
        assert not compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
        ratio = out.float().mean(dim=-1) / ref_out.float().mean(dim=-1)
        worst = (ratio - 1).abs().max().item()
        assert worst <= 1e-3, f"kv_mean={kv_mean} splits={n}: a row's mean is off by {worst:.2e} (relative)"


def test_fast_tiny_q_rows_stay_finite():
    """Q rows of tiny magnitude: the kernel scales each row by 2^floor(log2(448 / amax)) before rounding it
    to e4m3. For amax below 448 x 2^-126 (about 5e-36) that ratio overflowed to inf and the row's out
    and lse were NaN; the scale now stops at 2^126. Rows scaled by 1e-37 (normal bf16), 1e-39 (subnormal)
    and 0 must match the reference (scores near 0: out about the mean of V, lse about log(seq_len))."""
    heads, page, _, _ = _any_fast_key()
    g = torch.Generator().manual_seed(43)
    case = make_paged_case([3000, 700], heads, page, 2, FP8, generator=g, k_scale=0.5)
    case.q[:, :, 0].mul_(1e-37)
    case.q[:, :, 1].mul_(1e-39)
    case.q[:, :, 2].zero_()
    assert case.q[:, :, 1].abs().max().item() < 1.2e-38  # bf16 subnormals, as intended
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                            case.softmax_scale, k_scale=0.5)
    for n in (1, 4):
        out, lse = run_nan_prefilled(case, n, k_scale=0.5, fp8_mode="fast")
        problems = compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
        assert not problems, f"splits={n}: {problems}"


def test_fast_mode_runs_the_exact_short_split_kernel_on_splits_of_at_most_128_keys():
    """A fast split variant's second kernel is the exact fp8 short-split one (config.cuh VariantTraits;
    faster on such splits, docs/design.md 3.3): with every split at most 128 keys both modes launch
    the same kernels, so their results are bit-identical, and they match the reference."""
    heads, page, _, split = _any_fast_key()
    if not split:
        pytest.skip("no split fast variant compiled")
    facts = _binding.library().plan(heads, page, "fp8_e4m3_fast", True)[0].facts
    assert facts.second_kernel == "short_split" and facts.second_max_split_keys == 128
    case = make_paged_case([700, 4100, 33], heads, page, 1, FP8, generator=torch.Generator().manual_seed(4),
                           k_scale=0.5)
    assert facts.runs_second(4100, 33) and not facts.runs_second(4100, 32)  # 2 and 3 tiles a split
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.5)
    for n, same in ((33, True), (32, False)):
        exact = run_nan_prefilled(case, n, k_scale=0.5)
        fast = run_nan_prefilled(case, n, k_scale=0.5, fp8_mode="fast")
        assert not compare(*fast, *ref, **FP8_FAST_TOLERANCE), n
        assert (torch.equal(exact[0], fast[0]) and torch.equal(exact[1], fast[1])) == same, n


def test_fast_mode_at_32_heads_or_fewer_runs_the_exact_variants():
    """fp8_mode="fast" of at most 32 heads runs the fp8_e4m3 variants (codegen.variant.call_dtype): the same
    launches as exact mode and bit-identical results."""
    lib = _binding.library()
    keys = sorted((k for k in lib.table if k[2] == "fp8_e4m3" and k[0] <= 32 and k[3]),
                  key=lambda k: (k[0] != 16, k[1] != 64, k))
    if not keys:
        pytest.skip("no fp8_e4m3 split variant of at most 32 heads compiled")
    heads, page, _, _ = keys[0]
    assert lib.plan(heads, page, "fp8_e4m3_fast", True) == lib.plan(heads, page, "fp8_e4m3", True)
    case = make_paged_case([700, 4100, 33], heads, page, 2, FP8, generator=torch.Generator().manual_seed(5),
                           k_scale=0.5)
    exact = run_nan_prefilled(case, 3, k_scale=0.5)
    fast = run_nan_prefilled(case, 3, k_scale=0.5, fp8_mode="fast")
    assert torch.equal(exact[0], fast[0]) and torch.equal(exact[1], fast[1])


def test_fast_mode_with_a_16_bit_cache_is_refused():
    heads, page, _, _ = _any_fast_key()
    case = make_paged_case([100], heads, page, 1, torch.bfloat16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' with a torch.bfloat16 kv_cache"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, fp8_mode="fast")
    with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' or 'fast', got 'turbo'"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, fp8_mode="turbo")


def test_fast_varlen_against_reference():
    heads, page, _, _ = _any_fast_key()
    q_lens, seq_lens = [2, 0, 1, 4, 3, 4, 1], [1500, 0, 1, 3, 700, 4100, 65]
    g = torch.Generator().manual_seed(heads + page)
    case = make_paged_case(seq_lens, heads, page, 4, FP8, generator=g, k_scale=0.25)
    q = torch.cat([case.q[b, : q_lens[b]] for b in range(len(q_lens))])
    loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ref = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                      query_start_loc=loc, k_scale=0.25)
    for splits in (None, 1, 7):
        out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda")
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                          max_q_len=4, num_kv_splits=splits, out=out, lse=lse, k_scale=0.25, fp8_mode="fast")
        problems = compare(out[None].cpu(), lse[None].cpu(), ref[0][None].cpu(), ref[1][None].cpu(),
                           **FP8_FAST_TOLERANCE)
        assert not problems, f"splits {splits}: {problems}"


def test_fast_plan_in_a_graph_follows_k_scale_and_growing_lengths():
    heads, page, _, _ = _any_fast_key()
    g = torch.Generator().manual_seed(11)
    case = make_paged_case([1000, 64, 3500, 200], heads, page, 2, FP8, generator=g, k_scale=37.5)  # pages for the last step
    case.seq_lens.copy_(torch.tensor([900, 0, 3000, 65], dtype=torch.int32))
    plan = MLADecodePlan(4, heads, page, q_len=2, kv_dtype=FP8, max_seq_len=4096, fp8_mode="fast")
    assert "fp8_mode='fast'" in repr(plan) and all("fast" in l.symbol for l in plan.launches)
    scale = torch.tensor([37.5], device="cuda")
    out = torch.full((4, 2, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((4, heads, 2), float("nan"), device="cuda")
    step = plan.bind(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse,
                     k_scale=scale)
    graph = capture_graph(step)
    for lens, value in (([900, 0, 3000, 65], 37.5), ([901, 1, 3001, 66], 37.5), ([1000, 64, 3500, 200], 2.0)):
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        scale.fill_(value)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                   k_scale=value)
        problems = compare(out, lse, *ref, **FP8_FAST_TOLERANCE)
        assert not problems, f"lens {lens} k_scale {value}: {problems}"


def test_fast_op_matches_the_call():
    heads, page, _, _ = _any_fast_key()
    case = make_paged_case([700, 64], heads, page, 1, FP8, generator=torch.Generator().manual_seed(4), k_scale=0.5)
    scale = torch.tensor([0.5], device="cuda")
    q_nope, q_pe = case.q[..., :512], case.q[..., 512:]
    out, lse = torch.ops.mla_variants.mla_decode(q_nope, q_pe, case.kv_cache, case.block_table, case.seq_lens,
                                                 case.softmax_scale, 2, scale, "fast")
    ref_out, ref_lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                  num_kv_splits=2, k_scale=scale, fp8_mode="fast")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _balanced_fast_keys():
    try:
        lib = _binding.library()
        return sorted(k for k in lib.table if k[2] == "fp8_e4m3_fast" and lib.facts[k].balanced_schedule)
    except Exception:  # no build: the parametrized tests are skipped ("got empty parameter set")
        return []


# Ragged batches, empty and one-key requests, a request longer than one CTA's run, many short ones.
BALANCED_LENGTHS = {
    "ragged": [529, 744, 1028, 1280, 7454, 1612, 2231, 2386, 2601, 4160, 3621, 3705, 4057, 64, 4194, 4380],
    "zeros_ones_long": [0, 1, 100_000, 0, 65, 1, 0, 4096, 3],
    "many_short": [1 + (7 * i) % 200 for i in range(300)],
    "all_empty": [0, 0, 0],
}


@pytest.mark.parametrize("key", _balanced_fast_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}")
@pytest.mark.parametrize("name", sorted(BALANCED_LENGTHS))
def test_fast_balanced_schedule_against_reference(key, name):
    """The fast kernel's scheduled instantiation (fp8_fast.cuh SCHED): a CTA's run may span several
    requests (one segment each, the ring carried across them) or end inside one (a workspace piece),
    at q_len 1, 2 and 4 and k_scale as a float and as a device tensor; both of the schedule's cuts."""
    heads, page = key[0], key[1]
    g = torch.Generator().manual_seed(31 * heads + page)
    lens = BALANCED_LENGTHS[name]
    for q_len, k_scale, overhead in ((1, 0.0625, None), (2, 37.5, 1), (4, 1.0, 50)):  # None: the plan's default
        case = make_paged_case(lens, heads, page, q_len, FP8, generator=g, k_scale=k_scale)
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale, k_scale=k_scale)
        plan = MLADecodePlan(len(lens), heads, page, q_len=q_len, kv_dtype=FP8, max_seq_len=max(max(lens), 1),
                             balanced=True, fp8_mode="fast")
        assert plan.balanced and all("fast" in l.symbol for l in plan.launches)
        assert plan.default_overhead_tiles == SCHEDULE_OVERHEAD_TILES_FP8_FAST  # the fast kernel's segment cost
        assert plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page, overhead_tiles=overhead)
        for scale_arg in (k_scale, torch.tensor([k_scale], device="cuda")):
            out = torch.full((len(lens), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((len(lens), heads, q_len), float("nan"), device="cuda")
            plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse,
                     k_scale=scale_arg)
            torch.cuda.synchronize()
            problems = compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
            assert not problems, f"{name} q_len {q_len} overhead {overhead} ({plan.scheduled_cut()}): {problems}"


def test_fast_balanced_plan_in_a_graph_follows_seq_lens():
    """schedule + run of a fast plan captured once; replays after seq_lens changed in place (other tile
    counts, another cut) stay within the fast tolerance."""
    keys = _balanced_fast_keys()
    if not keys:
        pytest.skip("no split fp8_e4m3_fast variant compiled")
    heads, page = sorted(keys, key=lambda k: (k[1] != 64, k[0] != 128))[0][:2]
    steps = ([300, 5000, 1, 2000, 0, 800], [8000, 1, 0, 64, 4000, 65])
    case = make_paged_case([max(x) for x in zip(*steps)], heads, page, 1, FP8,
                           generator=torch.Generator().manual_seed(9), k_scale=0.5)
    seq_lens = case.seq_lens.clone()
    plan = MLADecodePlan(len(steps[0]), heads, page, kv_dtype=FP8, max_seq_len=8000, balanced=True, fp8_mode="fast")
    out = torch.empty(len(steps[0]), 1, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(len(steps[0]), heads, 1, device="cuda")
    scale = torch.tensor([0.5], device="cuda")
    max_keys = case.block_table.shape[1] * page

    def step():
        plan.schedule(seq_lens, max_seq_len=max_keys)
        plan.run(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale, out=out, lse=lse, k_scale=scale)

    replay_steps(capture_graph(step), seq_lens, steps, out, lse,
                 lambda: mla_decode_reference(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale,
                                              k_scale=0.5), **FP8_FAST_TOLERANCE)


def test_fast_balanced_varlen_skips_padding_blocks():
    """Varlen on a fast balanced plan (q_len up to 4, 128 heads where built): requests with fewer tokens
    than the launch's q_len leave row blocks with no placed row, which read no keys."""
    keys = [k for k in _balanced_fast_keys() if k[0] == 128] or _balanced_fast_keys()
    if not keys:
        pytest.skip("no split fp8_e4m3_fast variant compiled")
    heads, page = sorted(keys, key=lambda k: k[1] != 64)[0][:2]
    q_lens, lens = [1, 4, 0, 2, 3, 1], [5000, 300, 2000, 0, 9000, 64]
    case = make_paged_case(lens, heads, page, 4, FP8, generator=torch.Generator().manual_seed(13), k_scale=2.0)
    loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    # Request b's tokens: the last q_lens[b] query positions of the uniform case, packed.
    q = torch.cat([case.q[b, 4 - n:] for b, n in enumerate(q_lens)]).contiguous()
    plan = MLADecodePlan(len(lens), heads, page, q_len=4, kv_dtype=FP8, max_seq_len=9216, balanced=True,
                         fp8_mode="fast")
    assert plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page)
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda")
    plan.run_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                    out=out, lse=lse, k_scale=2.0)
    ref_out, ref_lse = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens,
                                                   case.softmax_scale, query_start_loc=loc, k_scale=2.0)
    torch.cuda.synchronize()
    problems = compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
    assert not problems, f"{plan.scheduled_cut()}: {problems}"


@pytest.mark.parametrize("negative", [False, True], ids=["mixed", "all_negative"])
def test_fast_huge_scores_stay_exact(negative):
    """softmax_scale 1e28 on scores of +-144 (log2 units near +-2^101): the fast kernel folds the scale into
    exp2's FFMA on unmasked tiles, and at the row max that FFMA leaves the product's rounding error (up to
    ulp(m) / 2, here 2^76) in the exponent, and m - 8 is not exact past 2^26, so P came out inf or 0; rows
    whose max reaches 2^20 must be scaled and shifted before the exponent (fp8_fast.cuh shift_huge_rows). Keys are row patterns whose q.k is exact in every precision
    (q all +-0.5; k all 0.5, or 1.0 / 0.0 halves of the latent with a 0.5 RoPE part: both +-144; or all
    -0.5), so within a split the reference's ties are the kernel's and P is 0 or 1. (Across two splits the
    combine weighs them by their lse, equal in fp32 at 1e30 whatever their tie counts: an error of about
    1e-3, inside the tolerance.) negative: q -0.5 and no -0.5 rows, every score -144 x 1e28."""
    heads, page, _, split = _any_fast_key()
    g = torch.Generator().manual_seed(31)
    case = make_paged_case([700, 1, 3000], heads, page, 1, FP8, generator=g, k_scale=1.0)
    kv = case.kv_cache.float().cpu()
    pick = torch.randint(0, 2 if negative else 3, kv.shape[:2], generator=g)
    rows = torch.full(kv.shape, 0.5)
    rows[pick == 1, :256] = 1.0
    rows[pick == 1, 256:512] = 0.0
    rows[pick == 2] = -0.5
    case.kv_cache = torch.where(torch.isnan(kv), kv, rows).to(FP8).to(case.kv_cache.device)
    case.q.fill_(-0.5 if negative else 0.5)
    case.softmax_scale = 1e28
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                            case.softmax_scale, k_scale=1.0)
    assert torch.isfinite(ref_out[0]).all() and torch.isfinite(ref_lse[0]).all()
    for n in ([1, 2] if split else [1]):
        out, lse = run_nan_prefilled(case, n, fp8_mode="fast")
        problems = compare(out, lse, ref_out, ref_lse, **FP8_FAST_TOLERANCE)
        assert not problems, f"negative={negative} splits={n}: {problems}"
