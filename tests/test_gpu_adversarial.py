"""Adversarial GPU cases (from a hostile review of the first version; skipped without an sm_90 GPU).

Each test names the behaviour it guards: builds with only split or only nosplit variants, values the
Python checks must refuse or the kernel must not misread, and legal but unusual inputs (stride-0 q
and block_table, strided caches, permuted lse, q_len 8, head groups with splits, 70000 requests,
side streams and graphs, page 1 with odd head counts). Tests skip when the build lacks the variant.
"""
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # also skip when run outside the repo's conftest
    pytest.skip("no CUDA GPU on this machine (GPU tests run on an sm_90 device)", allow_module_level=True)

from mla_variants import (MLAInputError, _binding, is_supported, mla_decode,  # noqa: E402
                          mla_decode_reference)
from mla_variants.fp8 import FP8_NAN_BYTE, dequantize_kv, quantize_kv  # noqa: E402
from mla_variants.testing import FP8_FAST_TOLERANCE, compare, make_paged_case  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _pick(split=None, dtype=None, min_page=1, largest_page=False, heads=None):
    """A compiled key (num_heads, page_size, dtype, split) matching the filters, else skip."""
    keys = [k for k in _binding.library().table
            if (split is None or k[3] == split) and (k[2] == dtype if dtype else k[2] in DT) and k[1] >= min_page
            and (heads is None or k[0] == heads)]
    if not keys:
        pytest.skip(f"no compiled variant with split={split} dtype={dtype} page>={min_page} heads={heads}")
    keys.sort(key=lambda k: (k[2] != "bf16", -k[1] if largest_page else (k[1] != 64, k[1]), k[0] != 16, k[0], k[3]))
    return keys[0]


def _split_ok(h, p, d) -> bool:
    return is_supported(h, p, d, True)


def _splits(h, p, d, wanted):
    """`wanted` split counts, keeping only 1 when the build has no split variant for (page, dtype)."""
    return tuple(n for n in wanted if n == 1 or _split_ok(h, p, d)) or (1,)


def _ref(case, seq_lens=None, q=None, block_table=None):
    return mla_decode_reference(case.q if q is None else q, case.kv_cache,
                                case.block_table if block_table is None else block_table,
                                case.seq_lens if seq_lens is None else seq_lens, case.softmax_scale)


def _check(out, lse, ref_out, ref_lse, what="", **kw):
    """compare() against the reference; it includes the relative-L2 bound (1e-2) that catches a
    uniform scale error on long sequences."""
    torch.cuda.synchronize()
    problems = compare(out, lse, ref_out, ref_lse, **kw)
    assert not problems, f"{what}: {problems}"


def _nan_out(case):
    b, ql, h = case.q.shape[:3]
    return (torch.full((b, ql, h, 512), float("nan"), dtype=case.q.dtype, device="cuda"),
            torch.full((b, h, ql), float("nan"), device="cuda"))


# ------------------------------------------------------------------------------------------------
# Builds with only one kind of split variant

def test_split_only_build_serves_one_split_calls(monkeypatch):
    """mla_variants/dispatch.py: 'unsplit calls ... fall back to a split variant run with one split' and
    tests/test_dispatch.py asserts that plan. But launch.cuh demands a workspace for every SPLIT
    variant while api.py allocates none when num_kv_splits == 1 -> 'CUDA error 1: invalid argument'.
"""
    h, p, d, _ = _pick(split=True)
    lib = _binding.library()
    monkeypatch.setattr(lib, "table", {k: v for k, v in lib.table.items() if k[3]})  # a split-only build
    case = make_paged_case([1, p + 1, 700, 0], h, p, 2, DT[d], generator=torch.Generator().manual_seed(1))
    ref = _ref(case)
    for n in (1, None):  # forced, and the heuristic on a batch large enough to pick 1
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                              num_kv_splits=n, max_seq_len=64 if n is None else None)
        _check(out, lse, *ref, what=f"split-only build, num_kv_splits={n}")


def test_nosplit_only_build_default_call(monkeypatch):
    """A build with `split: [false]` (valid in variants.yaml): the default heuristic still asks for
    several splits on a small batch with long sequences, and the call dies with
    VariantNotCompiledError although the user never asked for splits."""
    h, p, d, _ = _pick(split=False)
    lib = _binding.library()
    monkeypatch.setattr(lib, "table", {k: v for k, v in lib.table.items() if not k[3]})
    case = make_paged_case([4000], h, p, 1, DT[d], generator=torch.Generator().manual_seed(2))
    out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    _check(out, lse, *_ref(case), what="nosplit-only build, default num_kv_splits")


# ------------------------------------------------------------------------------------------------
# Values the Python checks must refuse, or the kernel must not misread

def test_block_table_capacity_overflowing_int32():
    """A block table wider than 2**31 / page_size: the capacity check must not overflow int32 (it
    would drop every key silently)."""
    h, p, d, _ = _pick(split=False, min_page=16, largest_page=True)
    width = (2**31) // p + 1
    case = make_paged_case([300, 5], h, p, 1, DT[d], generator=torch.Generator().manual_seed(3))
    wide = torch.zeros((2, width), dtype=torch.int32, device="cuda")
    wide[:, : case.block_table.shape[1]] = case.block_table
    ref = _ref(case, block_table=wide)
    out, lse = mla_decode(case.q, case.kv_cache, wide, case.seq_lens, case.softmax_scale, num_kv_splits=1)
    _check(out, lse, *ref, what=f"block_table width {width} x page {p} >= 2**31")


@pytest.mark.parametrize("heads,dtype", [(16, "bf16"), (128, "bf16"), (128, "fp8_e4m3_fast")])
def test_seq_len_int32_max(heads, dtype):
    """One request of 2**31 - 1 keys, the largest seq_len: key indices near INT_MAX must not overflow
    (a tile test written tile_start + 64 <= limit wrapped and let the last tile go unmasked), and the
    last page's slots past seq_len (NaN) stay masked. Every full page is one physical page and the last
    page another, so the reference is a softmax over their rows weighted by how often each is read.
    lse gets 1e-2: 2**23 identical tiles per split add the same rounding error in fp32 each time; a
    masking or indexing error shows as NaN or as garbage far above that."""
    fast = dtype == "fp8_e4m3_fast"
    keys = [k for k in _binding.library().table
            if k[0] == heads and k[2] == (dtype if fast else "bf16") and k[3] and k[1] >= 64]
    if not keys:
        pytest.skip(f"no compiled split variant with {heads} heads, {dtype}, page >= 64")
    p = max(k[1] for k in keys)
    seq_len = 2**31 - 1
    n_full, rem = divmod(seq_len, p)
    g = torch.Generator().manual_seed(12)
    real = torch.randn(2, p, 576, generator=g) * 0.1
    k_scale = 0.5 if fast else None
    if fast:
        kv = quantize_kv(real, k_scale)
        rows_of = dequantize_kv(kv, k_scale)
        kv.view(torch.uint8)[1, rem:] = FP8_NAN_BYTE
        kv = kv.cuda()
    else:
        kv = real.to(torch.bfloat16)
        rows_of = kv.float()
        kv[1, rem:] = float("nan")
        kv = kv.cuda()
    block_table = torch.zeros(1, n_full + 1, dtype=torch.int32, device="cuda")
    block_table[0, n_full] = 1
    q = (torch.randn(1, 1, heads, 576, generator=g) * 0.1).to(torch.bfloat16)
    scale = 576 ** -0.5
    out, lse = mla_decode(q.cuda(), kv, block_table, torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
                          scale, num_kv_splits=256, k_scale=k_scale, fp8_mode="fast" if fast else "exact")
    rows = torch.cat([rows_of[0], rows_of[1, :rem]]).double()
    counts = torch.cat([torch.full((p,), float(n_full)), torch.ones(rem)]).double()
    w = q[0, 0].double() @ rows.T * scale + counts.log()  # [heads, p + rem]
    ref_out = (torch.softmax(w, -1) @ rows[:, :512]).float().view(1, 1, heads, 512)
    ref_lse = torch.logsumexp(w, -1).float().view(1, heads, 1)
    # 16-bit paths: the tensor cores truncate their fp32 accumulator, which drifts about 1.5% over the
    # 2**23 keys of one split (design.md 1, "Accumulation"; an H100 measured 1.3-1.5e-2 relative L2,
    # elements up to 1.4e-3 off), against 1e-2 and 1e-3 by default.
    tol = dict(FP8_FAST_TOLERANCE) if fast else dict(atol=3e-3, rtol=4e-2, rel_l2_tol=3e-2, cos_tol=1e-4)
    tol["lse_atol"] = 1e-2
    _check(out, lse, ref_out.cuda(), ref_lse.cuda(), what=f"seq_len 2**31 - 1, {heads} heads, {dtype}, page {p}", **tol)


@pytest.mark.parametrize("heads,dtype", [(16, "bf16"), (128, "bf16"), (128, "fp8_e4m3"), (128, "fp8_e4m3_fast")])
def test_long_split_accumulation(heads, dtype):
    """One split of 2**20 keys whose pages are all one physical page gives the same softmax as 256 keys
    of it: out equal, lse larger by log(4096). What differs is only how O and l accumulate over 16384
    tiles instead of 4, so this isolates accumulation error from rounding. The fp8 wgmma keeps its
    accumulator to 13 mantissa bits: accumulated there over a long split, O^T stalls (out about 4x too
    small here) unless each tile's product is promoted to fp32 (design.md 3.3); 16-bit wgmma truncates
    at fp32 precision, about 0.2% over this split."""
    fast = dtype == "fp8_e4m3_fast"
    cache_dtype = "fp8_e4m3" if dtype.startswith("fp8") else dtype
    keys = [k for k in _binding.library().table if k[0] == heads and k[2] == dtype and k[1] >= 64]
    if not keys:
        pytest.skip(f"no compiled variant with {heads} heads, {dtype}, page >= 64")
    p = max(k[1] for k in keys)
    g = torch.Generator().manual_seed(13)
    real = torch.randn(1, p, 576, generator=g) * 0.1
    k_scale = 0.5 if cache_dtype == "fp8_e4m3" else None
    kv = (quantize_kv(real, k_scale) if k_scale else real.to(DT[cache_dtype])).cuda()
    q = (torch.randn(1, 1, heads, 576, generator=g) * 0.1).to(torch.bfloat16).cuda()
    results = {}
    for seq_len in (256, 2**20):
        table = torch.zeros(1, seq_len // p, dtype=torch.int32, device="cuda")
        results[seq_len] = mla_decode(q, kv, table, torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
                                      576 ** -0.5, num_kv_splits=1, k_scale=k_scale,
                                      fp8_mode="fast" if fast else "exact")
    (short, short_lse), (long, long_lse) = results[256], results[2**20]
    _check(long, long_lse - math.log(2**20 / 256), short.float(), short_lse,
           what=f"2**20 keys in one split, {heads} heads, {dtype}, page {p}",
           atol=2e-3, rtol=2e-2, cos_tol=1e-4, lse_atol=1e-3, rel_l2_tol=1e-2)


def test_softmax_scale_overflowing_float32_is_rejected():
    """softmax_scale=1e39 is finite in Python (passes the check) but becomes inf in the ABI's float
    field: NaN output. It should be an MLAInputError."""
    h, p, d, _ = _pick(split=False)
    case = make_paged_case([100], h, p, 1, DT[d], generator=torch.Generator().manual_seed(4))
    with pytest.raises(MLAInputError, match="softmax_scale"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, 1e39, num_kv_splits=1)


@pytest.mark.parametrize("heads", [None, 128])
def test_scores_below_running_max_init(heads):
    """The running max starts at -1e30 (log2 domain). If every visible score is below it, p = 0 and
    the row comes out as 'no key' (out 0, lse -inf) though the reference gives finite values.
    Needs an absurd scale (1e28), so low severity. heads None: the default pick (the transposed path
    at 16 heads); 128: the 64-row path, whose softmax must keep p <= 1 at such scores."""
    h, p, d, _ = _pick(split=False if heads is None else None, heads=heads)
    case = make_paged_case([70, 1], h, p, 1, DT[d], generator=torch.Generator().manual_seed(5),
                           softmax_scale=1e28)
    case.q.fill_(0.5)
    kv = case.kv_cache
    kv[torch.isfinite(kv)] = -0.5  # q.k = -144 for every visible key -> score -1.44e30
    ref = _ref(case)
    assert torch.isfinite(ref[1]).all()
    out, lse = mla_decode(case.q, kv, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=1)
    _check(out, lse, *ref, what="all scores < -1e30", lse_rtol=1e-3)


def test_self_overlapping_outputs_are_rejected():
    """out/lse with stride-0 (expanded) or overlapping rows pass validation; every head then writes
    the same memory. torch itself refuses to write such tensors."""
    h, p, d, _ = _pick()
    case = make_paged_case([100, 3], max(h, 2), p, 1, DT[d], generator=torch.Generator().manual_seed(6))
    b, ql, hh = case.q.shape[:3]
    bad_out = torch.empty((b, ql, 1, 512), dtype=case.q.dtype, device="cuda").expand(b, ql, hh, 512)
    with pytest.raises(MLAInputError, match="out"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=bad_out)
    bad_lse = torch.empty((b, 1, ql), device="cuda").expand(b, hh, ql)
    with pytest.raises(MLAInputError, match="lse"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, lse=bad_lse)


def test_outputs_sharing_memory_with_inputs_are_rejected():
    """out, lse or workspace overlapping q, the cache or each other would be written while read (the
    combine reads the workspace while it writes out): an MLAInputError naming the output, through
    mla_decode and MLADecodePlan alike. Disjoint views of one buffer stay legal."""
    from mla_variants import MLADecodePlan
    h, p, d, split = _pick(split=True)
    case = make_paged_case([700, 3], h, p, 1, DT[d], generator=torch.Generator().manual_seed(8))
    b, ql, hh = case.q.shape[:3]
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping q,"):
        mla_decode(*args, out=case.q[..., :512])
    q_param = torch.nn.Parameter(case.q, requires_grad=False)  # a Tensor subclass is still one q, not a pair
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping q,"):
        mla_decode(q_param, *args[1:], out=case.q[..., :512])
    q_nope, q_pe = case.q[..., :512], case.q[..., 512:]
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping q_nope"):
        mla_decode((q_nope, q_pe), *args[1:], out=q_nope)
    flat = case.kv_cache.view(-1)
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping kv_cache"):
        mla_decode(*args, out=flat[: b * ql * hh * 512].view(b, ql, hh, 512))
    buf = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    out = buf[: b * ql * hh * 512 * 2].view(case.q.dtype).view(b, ql, hh, 512)
    with pytest.raises(MLAInputError, match="workspace: expected memory of its own, not overlapping out"):
        mla_decode(*args, num_kv_splits=2, out=out, workspace=buf)
    lse = torch.empty((b, hh, ql), device="cuda")
    with pytest.raises(MLAInputError, match="lse: expected memory of its own, not overlapping out"):
        mla_decode(*args, out=out, lse=out.view(-1)[: b * hh * ql * 2].view(torch.float32).view(b, hh, ql))
    # Disjoint views of one buffer: out in its first bytes, the workspace after them.
    ws = buf[(out.numel() * 2 + 255) // 256 * 256:]
    res, res_lse = mla_decode(*args, num_kv_splits=2, out=out, lse=lse, workspace=ws)
    _check(res, res_lse, *_ref(case), what="disjoint views of one buffer")
    plan = MLADecodePlan(max_batch=b, num_heads=hh, page_size=p, q_len=ql, dtype=DT[d])
    with pytest.raises(MLAInputError, match="out"):
        plan.run(*args, out=case.q[..., :512], lse=lse)


def test_empty_request_ignores_its_q():
    """A request with seq_len 0 gets out 0 and lse -inf whatever its q holds (a CUDA-graph padding row's
    q may be stale memory, NaN or inf): every 16-bit path (8-32 heads transposed, 64-128 heads 64-row,
    split and not) with NaN, +inf and -inf q in 20 empty requests beside two long ones."""
    keys = sorted({(k[0], k[3]) for k in _binding.library().table if k[2] == "bf16" and k[1] == 64})
    if not keys:
        pytest.skip("no compiled bf16 page-64 variant")
    for heads, split in keys:
        g = torch.Generator().manual_seed(779 + heads)
        lens = [0] * 20 + [3000, 1]
        empty = [i for i, n in enumerate(lens) if n == 0]
        case = make_paged_case(lens, heads, 64, 1, torch.bfloat16, generator=g)
        ref = _ref(case)
        for j, b in enumerate(empty):
            case.q[b] = (float("nan"), float("inf"), float("-inf"))[j % 3]
        for n in ([1, 2] if split else [1]):
            out, lse = _nan_out(case)
            mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                       num_kv_splits=n, out=out, lse=lse)
            torch.cuda.synchronize()
            assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float())), f"h{heads} splits={n}"
            assert torch.isneginf(lse[empty]).all(), f"h{heads} splits={n}"
            _check(out, lse, *ref, what=f"h{heads} splits={n}")


def test_max_seq_len_wrong_type_is_an_input_error():
    """A max_seq_len of the wrong type is an MLAInputError on real GPU tensors too (a str once gave
    TypeError, nan ValueError and inf OverflowError from inside the split heuristic)."""
    h, p, d, _ = _pick()
    case = make_paged_case([100], h, p, 1, DT[d], generator=torch.Generator().manual_seed(7))
    for bad in ("4096", float("nan"), float("inf")):
        with pytest.raises(MLAInputError, match="max_seq_len"):
            mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, max_seq_len=bad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_non_current_device():
    """With q on cuda:1 and cuda:0 current, the call runs on cuda:1 (as torch ops do)."""
    h, p, d, _ = _pick()
    case = make_paged_case([500, 3], h, p, 1, DT[d], device="cuda:1", generator=torch.Generator().manual_seed(8))
    with torch.cuda.device(0):
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    torch.cuda.synchronize(1)
    _check(out, lse, *_ref(case), what="tensors on cuda:1, current device 0")


# ------------------------------------------------------------------------------------------------
# Legal but unusual inputs the existing GPU tests do not cover (should pass)

def test_stride_zero_and_strided_inputs():
    """q broadcast over the batch (stride 0), one block_table row shared by every request (stride 0)
    with different seq_lens, a cache that is every other page of a larger buffer, and lse as a
    permuted view of a [batch, q_len, heads] buffer."""
    h, p, d, _ = _pick()
    g = torch.Generator().manual_seed(9)
    base = make_paged_case([3 * p + 5], h, p, 3, DT[d], generator=g)
    big = torch.full((2 * base.kv_cache.shape[0], p, 576), float("nan"), dtype=base.kv_cache.dtype, device="cuda")
    big[::2] = base.kv_cache
    kv = big[::2]
    seq = torch.tensor([3 * p + 5, p, 1, 0, 2], dtype=torch.int32, device="cuda")
    q = base.q[:1].expand(5, -1, -1, -1)
    table = base.block_table[:1].expand(5, -1)
    ref = mla_decode_reference(q, base.kv_cache, table, seq, base.softmax_scale)
    for n in _splits(h, p, d, (1, 3)):
        lse_buf = torch.full((5, 3, h), float("nan"), device="cuda")
        out, lse = mla_decode(q, kv, table, seq, base.softmax_scale, num_kv_splits=n, lse=lse_buf.permute(0, 2, 1))
        _check(out, lse, *ref, what=f"stride-0 q/block_table, strided kv, permuted lse, splits={n}")


def test_q_len_8_every_boundary_many_splits():
    h, p, d, _ = _pick(split=False)
    g = torch.Generator().manual_seed(10)
    lens = [0, 1, 7, 8, 9, 63, 64, 65, p - 1 if p > 1 else 2, p, p + 1, 2500]
    case = make_paged_case(lens, h, p, 8, DT[d], generator=g)
    ref = _ref(case)
    for n in _splits(h, p, d, (1, 2, 37, 256)):
        out, lse = _nan_out(case)
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                              num_kv_splits=n, out=out, lse=lse)
        _check(out, lse, *ref, what=f"q_len 8, splits={n}")


def test_heads_above_largest_with_splits_and_q_len_3():
    keys = [k for k in _binding.library().table if k[3] and k[2] in DT]
    if not keys:
        pytest.skip("no split variant")
    d, p = _pick(split=True)[2], _pick(split=True)[1]
    largest = max(k[0] for k in keys if k[1] == p and k[2] == d)
    case = make_paged_case([900, 0, 65], 2 * largest + 3, p, 3, DT[d], generator=torch.Generator().manual_seed(11))
    ref = _ref(case)
    for n in (1, 5):
        out, lse = _nan_out(case)
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                              num_kv_splits=n, out=out, lse=lse)
        _check(out, lse, *ref, what=f"{2 * largest + 3} heads (head groups), splits={n}")


def test_negative_and_over_capacity_seq_lens():
    """A negative seq_len or one beyond the table's capacity is never read past the table: that
    request's rows are NaN (never a plausible answer), the others are right; debug=True raises."""
    h, p, d, _ = _pick(split=False)
    case = make_paged_case([0, 2 * p, 5], h, p, 2, DT[d], generator=torch.Generator().manual_seed(12))
    cap = case.block_table.shape[1] * p
    seq = torch.tensor([-7, cap + 1000, 5], dtype=torch.int32, device="cuda")
    for n in _splits(h, p, d, (1, 3, 9, 17, 32)):  # 3 / 9 / 17 / 32: the four uniform combines' NaN paths
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, seq, case.softmax_scale, num_kv_splits=n)
        torch.cuda.synchronize()
        assert torch.isnan(out[:2]).all() and torch.isnan(lse[:2]).all(), n
        ref = _ref(case, seq_lens=seq[2:], q=case.q[2:], block_table=case.block_table[2:])
        _check(out[2:], lse[2:], *ref, what=f"valid request beside invalid ones, splits={n}")
    with pytest.raises(MLAInputError, match="seq_lens"):
        mla_decode(case.q, case.kv_cache, case.block_table, seq, case.softmax_scale, debug=True)


def test_long_sequences_norm_is_right():
    """compare() alone is blind to a uniform scale error of out on long sequences; check the L2 error."""
    h, p, d, _ = _pick()
    lens = [60000, 1] if p > 1 else [20000, 1]
    case = make_paged_case(lens, h, p, 1, DT[d], generator=torch.Generator().manual_seed(13))
    ref = _ref(case)
    out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                          num_kv_splits=None if _split_ok(h, p, d) else 1)
    _check(out, lse, *ref, what="long sequence, default splits")
    ratio = (out.float().norm() / ref[0].norm()).item()
    assert abs(ratio - 1) < 1e-2, ratio


def test_huge_batch_grid_x_over_65535():
    """70000 requests (grid.x > 65535, combine grid > 1M rows): each request reads one of 8 pages
    with its own seq_len in 0..3 and its own q, so a wrong request index shows."""
    h, p, d, _ = _pick(split=False)
    batch, g = 70000, torch.Generator().manual_seed(14)
    kv = (torch.randn(8, p, 576, generator=g) * 0.1).to(DT[d]).cuda()
    qpool = (torch.randn(97, 1, h, 576, generator=g) * 0.1).to(DT[d]).cuda()
    q = qpool[torch.arange(batch) % 97]                                  # [batch, 1, h, 576], distinct rows
    table = torch.randint(0, 8, (batch, 1), generator=g, dtype=torch.int32).cuda()
    seq = torch.randint(0, min(p, 4) + 1, (batch,), generator=g, dtype=torch.int32).cuda()
    scale = (128 + 64) ** -0.5
    idx = torch.tensor([0, 1, 65534, 65535, 65536, 65537, batch - 1] + list(range(1000, batch, 9973)), device="cuda")
    ref = mla_decode_reference(q[idx], kv, table[idx], seq[idx], scale)
    for n in _splits(h, p, d, (1, 2)):
        out, lse = mla_decode(q, kv, table, seq, scale, num_kv_splits=n)
        _check(out[idx], lse[idx], *ref, what=f"batch {batch}, splits={n}")


def test_side_stream_and_cuda_graph():
    h, p, d, _ = _pick(split=False)
    n = None if _split_ok(h, p, d) else 1
    case = make_paged_case([1500, 70, 0], h, p, 2, DT[d], generator=torch.Generator().manual_seed(15))
    ref = _ref(case)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=n)
    s.synchronize()
    _check(out, lse, *ref, what="side stream")
    # graph capture with the default heuristic (the workspace is allocated inside the capture)
    q = case.q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=n)
        s.synchronize()
        with torch.cuda.graph(graph, stream=s):
            g_out, g_lse = mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                      num_kv_splits=n)
    q.copy_((torch.randn(q.shape, generator=torch.Generator().manual_seed(99)) * 0.1).to(q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    _check(g_out, g_lse, *_ref(case, q=q), what="CUDA graph replay with new q")


def test_page_size_1_long_and_odd_head_count():
    keys = sorted((k for k in _binding.library().table if k[1] == 1 and k[2] in DT), key=lambda k: (k[2] != "bf16", k[3]))
    if not keys:
        pytest.skip("no page_size 1 variant")
    d = keys[0][2]
    case = make_paged_case([20000, 1, 2, 0], 5, 1, 4, DT[d], generator=torch.Generator().manual_seed(16))
    ref = _ref(case)
    out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                          num_kv_splits=None if _split_ok(5, 1, d) else 1)
    _check(out, lse, *ref, what="page 1, 5 heads, q_len 4, default splits")
