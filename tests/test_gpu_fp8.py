"""fp8 (e4m3) KV-cache variants against the fp32 reference on the dequantized cache (issue 5; skipped
without an sm_90 GPU).

Caches are written the way engines write them (real N(0, 0.1^2) values quantized with k_scale), unused
slots hold the e4m3 NaN byte 0x7F, block tables are randomly permuted with junk past each request,
outputs are prefilled with NaN; q_len 1, 2 and 4, forced splits, seq_lens mixing 0, 1 and page
boundaries; k_scale far from 1 (0.0625 and 37.5), as a float and as a device tensor. Tolerance:
mla_variants.testing.FP8_TOLERANCE (the issue's bounds).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import MLAInputError, _binding, mla_decode, mla_decode_reference  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, capture_graph, compare, make_paged_case, run_nan_prefilled  # noqa: E402

FP8 = torch.float8_e4m3fn


def _fp8_keys():
    try:
        from mla_variants._binding import library
        return sorted(k for k in library().table if k[2] == "fp8_e4m3")
    except Exception:  # no build: the parametrized test is skipped ("got empty parameter set")
        return []


def _run(case, splits, k_scale):
    return run_nan_prefilled(case, splits, k_scale=k_scale)


@pytest.mark.parametrize("key", _fp8_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}_{'split' if k[3] else 'nosplit'}")
def test_fp8_variant_against_reference(key):
    num_heads, page, _, split = key
    g = torch.Generator().manual_seed(1000 * key[0] + key[1] + 7 * key[3])  # not hash(): it varies per process
    splits = [2, 7, 256] if split else [1]
    for q_len, k_scale in ((1, 0.0625), (2, 37.5), (4, 1.0)):
        lens = [0, 1, max(page - 1, 1), page, page + 1, 3000 + 37 * q_len]
        case = make_paged_case(lens, num_heads, page, q_len, FP8, generator=g, k_scale=k_scale)
        assert case.kv_cache.dtype == FP8 and case.q.dtype == torch.bfloat16
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale, k_scale=k_scale)
        for n in splits:
            for scale_arg in (k_scale, torch.tensor([k_scale], device="cuda")):
                out, lse = _run(case, n, scale_arg)
                assert out.dtype == torch.bfloat16
                problems = compare(out, lse, ref_out, ref_lse, **FP8_TOLERANCE)
                assert not problems, f"{key} q_len={q_len} k_scale={k_scale} splits={n} {type(scale_arg).__name__}: {problems}"


def _st_fp8_keys():
    """fp8 variants on the transposed register path (at most 32 heads): raw rings of 4 stages (8-16
    rows, three math warpgroups) or 3 (32 rows, two)."""
    return [k for k in _fp8_keys() if _binding.library().facts[k].rows_per_cta < 64]  # the transposed path


@pytest.mark.parametrize("key", _st_fp8_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}_{'split' if k[3] else 'nosplit'}")
def test_fp8_transposed_ring_wraps_at_every_tile_count(key):
    """Requests of exactly 1..8 tiles of 64 keys and in between, so that each warpgroup's tiles land in
    every stage of the raw ring and the ring wraps at each position (tile t in stage t % kRing, owned by
    warpgroup t % kMathWgs; layouts.cuh SharedStorageStFp8), with splits that leave 0..4 tiles per CTA."""
    num_heads, page, _, split = key
    g = torch.Generator().manual_seed(4242 + num_heads + page)
    lens = [64, 128, 192, 256, 320, 384, 448, 512, 65, 191, 449, 1000]
    for q_len in (1, 4):
        case = make_paged_case(lens, num_heads, page, q_len, FP8, generator=g, k_scale=0.5)
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale, k_scale=0.5)
        for n in ([1, 2, 3, 5] if split else [1]):
            out, lse = _run(case, n, 0.5)
            problems = compare(out, lse, ref_out, ref_lse, **FP8_TOLERANCE)
            assert not problems, f"{key} q_len={q_len} splits={n}: {problems}"


@pytest.mark.parametrize("key", _st_fp8_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}_{'split' if k[3] else 'nosplit'}")
def test_fp8_empty_request_ignores_its_q(key):
    """A request with seq_len 0 gets out 0 and lse -inf whatever its q holds (a CUDA-graph padding row's
    q may be stale memory). On the register path Q's bf16 rows are staged in the buffer the final merge
    reuses (layouts.cuh SharedStorageStFp8): a copy of them landing after the merge's zeros (v3.25's
    racy Q-at-entry form did so in CTAs without tiles) would show as NaN, since q of every empty request
    is NaN, +inf and -inf. Many empty requests beside two long ones, one split (out written by the
    decode kernel) and, for split variants, several. test_gpu_adversarial.py has the bf16 counterpart."""
    num_heads, page, _, split = key
    g = torch.Generator().manual_seed(777 + num_heads + page)
    lens = [0] * 20 + [3000, 1]
    empty = [i for i, n in enumerate(lens) if n == 0]
    case = make_paged_case(lens, num_heads, page, 1, FP8, generator=g, k_scale=0.5)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                            case.softmax_scale, k_scale=0.5)
    for j, b in enumerate(empty):  # the reference of the other rows does not depend on these q rows
        case.q[b] = (float("nan"), float("inf"), float("-inf"))[j % 3]
    for n in ([1, 2] if split else [1]):
        for _ in range(3):
            out, lse = _run(case, n, 0.5)
            assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float())), f"{key} splits={n}"
            assert torch.isneginf(lse[empty]).all(), f"{key} splits={n}"
            problems = compare(out, lse, ref_out, ref_lse, **FP8_TOLERANCE)
            assert not problems, f"{key} splits={n}: {problems}"


def _any_fp8_key(split=None):
    keys = [k for k in _fp8_keys() if split is None or k[3] == split]
    if not keys:
        pytest.skip("no fp8_e4m3 variant compiled")
    return sorted(keys, key=lambda k: (k[1] != 64, k[0] != 16))[0]


def test_fp8_k_scale_tensor_followed_by_a_cuda_graph():
    """k_scale as a device tensor: a captured graph replays with the scale's new value."""
    heads, page, _, _ = _any_fp8_key()
    case = make_paged_case([700, 64, 2000], heads, page, 1, FP8, generator=torch.Generator().manual_seed(3), k_scale=0.5)
    scale = torch.tensor([0.5], device="cuda")
    out = torch.empty(3, 1, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, heads, 1, device="cuda")
    graph = capture_graph(lambda: mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                             case.softmax_scale, out=out, lse=lse, num_kv_splits=1, k_scale=scale))
    for value in (0.5, 4.0, 0.03125):
        scale.fill_(value)
        _replay_and_check(graph, case, out, lse, value, f"k_scale {value} replayed")


def _replay_and_check(graph, case, out, lse, k_scale: float, what: str) -> None:
    """Replay `graph` into NaN-prefilled `out` and compare with the reference at `k_scale`."""
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                               k_scale=k_scale)
    problems = compare(out, lse, *ref, **FP8_TOLERANCE)
    assert not problems, f"{what}: {problems}"


def test_fp8_large_q_and_mixed_lengths_with_splits():
    """|q| up to ~1e4 (kept finite by the kernel's 2^-8 prescale) and 0 / 1 / 100k keys in one batch."""
    heads, page, _, _ = _any_fp8_key(split=True)
    g = torch.Generator().manual_seed(5)
    case = make_paged_case([0, 1, 100_000], heads, page, 1, FP8, generator=g, k_scale=0.0625, q_std=3000.0)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.0625)
    for n in (1, 16, 256):
        out, lse = _run(case, n, 0.0625)
        problems = compare(out, lse, *ref, **FP8_TOLERANCE)
        assert not problems, f"splits={n}: {problems}"


def _short_kernel_keys():
    """fp8 split variants with a short-split kernel (the 64-row path, more than 32 heads)."""
    return [k for k in _fp8_keys() if _binding.library().facts[k].second_kernel == "short_split"]


@pytest.mark.parametrize("key", _short_kernel_keys(), ids=lambda k: f"h{k[0]}_p{k[1]}")
def test_fp8_short_split_kernel_and_the_long_one_on_the_same_call(key):
    """The launcher picks the short-split kernel (32-token tiles, four stages) from max_seq_len and the
    split count alone (templates/mla/launch.cuh). Four splits of 832 keys (13 tiles of 64) each way: without
    max_seq_len the 64-token kernel runs; with max_seq_len=1 the short one runs 26 tiles of 32 per split
    (the four-stage ring wraps six times). Both must match the reference, and they must differ from
    each other (other tile boundaries round P differently), which shows the two kernels ran."""
    num_heads, page, _, _ = key
    g = torch.Generator().manual_seed(11 + num_heads + page)
    for q_len in (1, 2):
        case = make_paged_case([0, 1, 33, 700, 3071 + q_len], num_heads, page, q_len, FP8, generator=g, k_scale=0.25)
        ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                   k_scale=0.25)
        outs = []
        for bound in (None, 1):
            out, lse = run_nan_prefilled(case, 4, k_scale=0.25, max_seq_len=bound)
            problems = compare(out, lse, *ref, **FP8_TOLERANCE)
            assert not problems, f"{key} q_len={q_len} max_seq_len={bound}: {problems}"
            outs.append(out)
        assert not torch.equal(outs[0], outs[1]), f"{key} q_len={q_len}: the same kernel ran for both max_seq_len"


def test_fp8_cache_stride_must_keep_rows_16_byte_aligned():
    heads, page, _, _ = _any_fp8_key()
    case = make_paged_case([100], heads, page, 1, FP8, generator=torch.Generator().manual_seed(1), k_scale=1.0)
    wide = torch.zeros(case.kv_cache.shape[0], page, 584, dtype=FP8, device="cuda")
    wide[..., :576] = case.kv_cache
    with pytest.raises(MLAInputError, match="kv_cache: expected non-negative strides that are multiples of 16 elements"):
        mla_decode(case.q, wide[..., :576], case.block_table, case.seq_lens, case.softmax_scale, k_scale=1.0)
    wide = torch.zeros(case.kv_cache.shape[0], page, 592, dtype=FP8, device="cuda")  # 592 = 37 x 16: fine
    wide[..., :576] = case.kv_cache
    out, lse = mla_decode(case.q, wide[..., :576], case.block_table, case.seq_lens, case.softmax_scale, k_scale=1.0)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=1.0)
    assert not compare(out, lse, *ref, **FP8_TOLERANCE)


def test_fp8_plan_run_bind_and_graph_follow_k_scale():
    """MLADecodePlan with kv_dtype=float8_e4m3fn: run with a float scale, bind with a tensor scale, and a
    captured bound step that follows the tensor's new value and growing lengths."""
    from mla_variants import MLADecodePlan
    heads, page, _, _ = _any_fp8_key()
    g = torch.Generator().manual_seed(11)
    case = make_paged_case([900, 0, 3000, 65], heads, page, 2, FP8, generator=g, k_scale=37.5)
    plan = MLADecodePlan(4, heads, page, q_len=2, kv_dtype=FP8, max_seq_len=4096)
    out = torch.full((4, 2, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((4, heads, 2), float("nan"), device="cuda")
    plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse, k_scale=37.5)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=37.5)
    problems = compare(out, lse, *ref, **FP8_TOLERANCE)
    assert not problems, f"plan.run: {problems}"
    with pytest.raises(MLAInputError, match="k_scale: expected the dequantization scale"):
        plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    with pytest.raises(MLAInputError, match="kv_cache: expected torch.float8_e4m3fn \\(this plan's kv_dtype\\)"):
        plan.run(case.q, case.kv_cache.to(torch.bfloat16), case.block_table, case.seq_lens, case.softmax_scale,
                 out=out, lse=lse)
    scale = torch.tensor([37.5], device="cuda")
    step = plan.bind(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse,
                     k_scale=scale)
    graph = capture_graph(step)
    for value, lens in ((0.0625, [850, 0, 2990, 64]), (4.0, [1, 0, 3000, 0])):
        scale.fill_(value)
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        _replay_and_check(graph, case, out, lse, value, f"bound step replayed with k_scale {value}, lens {lens}")


def test_fp8_ops_compile_and_opcheck():
    import mla_variants.ops  # noqa: F401
    heads, page, _, _ = _any_fp8_key()
    case = make_paged_case([200, 1, 3000], heads, page, 1, FP8, generator=torch.Generator().manual_seed(13),
                           k_scale=0.0625)
    scale = torch.tensor([0.0625], device="cuda")

    class Attn(torch.nn.Module):
        def forward(self, q, kv, bt, sl, k_scale):
            return torch.ops.mla_variants.mla_decode(q[..., :512], q[..., 512:], kv, bt, sl, case.softmax_scale, 0,
                                                     k_scale)

    out, lse = torch.compile(Attn(), fullgraph=True)(case.q, case.kv_cache, case.block_table, case.seq_lens, scale)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                               k_scale=0.0625)
    problems = compare(out, lse, *ref, **FP8_TOLERANCE)
    assert not problems, f"compiled op: {problems}"
    args = (case.q[..., :512], case.q[..., 512:], case.kv_cache, case.block_table, case.seq_lens,
            case.softmax_scale, 2)
    # opcheck's test_schema compares inputs with arithmetic that torch has no fp8 kernel for ("mul_cuda"
    # not implemented for Float8_e4m3fn); the schema itself is the bf16 ops' and is checked there.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mla_variants.mla_decode.default, args, {"k_scale": scale}, test_utils=utils)
    out2 = torch.full((3, 1, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse2 = torch.empty(3, heads, 1, device="cuda")
    torch.library.opcheck(torch.ops.mla_variants.mla_decode_out.default, args + (out2, lse2), {"k_scale": scale},
                          test_utils=utils)
    torch.ops.mla_variants.mla_decode_out(*args, out2, lse2, k_scale=scale)
    problems = compare(out2, lse2, *ref, **FP8_TOLERANCE)
    assert not problems, f"mla_decode_out op: {problems}"
