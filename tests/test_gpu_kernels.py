"""Every compiled variant against the fp32 reference on the GPU (skipped without an sm_90 GPU).

Inputs: fresh random q and KV from N(0, 0.1^2), randomly permuted block tables, NaN in every slot
past seq_len and every unused page, junk block_table entries past each request's pages, outputs
prefilled with NaN, seq_lens mixing {0, 1, page-1, page, page+1, long} in one batch.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import mla_decode, mla_decode_reference  # noqa: E402
from mla_variants.testing import compare, make_paged_case, run_nan_prefilled  # noqa: E402

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _table():
    try:
        from mla_variants._binding import library
        return sorted(k for k in library().table if k[2] in DTYPE)  # fp8 variants: tests/test_gpu_fp8.py
    except Exception:  # no build: the parametrized test is skipped ("got empty parameter set")
        return []


def _mixed_lens(page: int, long: int) -> list[int]:
    return [0, 1, max(page - 1, 1), page, page + 1, long]


_run = run_nan_prefilled


def _need(num_heads: int, page: int, split: bool, dtype: str = "bf16") -> None:
    """Skip a test whose fixed shape the build cannot serve. Only a reduced build lacks a page size (codegen
    --filter, as lab/ab_bench.sh builds, or a preset such as ci's page 64); the default build compiles
    every one, so there these tests always run."""
    from mla_variants._binding import library
    from mla_variants.dispatch import is_supported
    if not is_supported(library().table, num_heads, page, dtype, split):
        pytest.skip(f"the build serves no num_heads={num_heads} page_size={page} dtype={dtype} split={split}")


@pytest.mark.parametrize("key", _table(), ids=lambda k: f"h{k[0]}_p{k[1]}_{k[2]}_{'split' if k[3] else 'nosplit'}")
def test_variant_against_reference(key):
    num_heads, page, dtype, split = key
    g = torch.Generator().manual_seed(hash(key) % 2**31)
    # 2-8: the warp-per-row combine; 9-16: a warp per 128 columns; 17-31: the CTA-per-row one; 32 and
    # more: four CTAs per row (launch.cuh)
    splits = [2, 3, 4, 7, 8, 9, 16, 17, 31, 32, 256] if split else [1]
    for q_len in (1, 2, 4):
        case = make_paged_case(_mixed_lens(page, 3000 + 37 * q_len), num_heads, page, q_len, DTYPE[dtype], generator=g)
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
        for n in splits:
            out, lse = _run(case, n)
            problems = compare(out, lse, ref_out, ref_lse)
            assert not problems, f"{key} q_len={q_len} num_kv_splits={n}: {problems}"


@pytest.mark.parametrize("key", [k for k in _table() if 16 < k[0] <= 32],
                         ids=lambda k: f"h{k[0]}_p{k[1]}_{k[2]}_{'split' if k[3] else 'nosplit'}")
def test_17_to_32_heads_both_kernels_on_the_same_call(key):
    """bf16 / fp16 variants of 17..32 heads have two kernels: the transposed one (32 rows per CTA) and a
    64-row one, which the launcher takes when every split is shorter than 1024 keys (the variant's second
    kernel, from max_seq_len, else the block table's capacity, and the split count).
    Without max_seq_len the table addresses 3000+ keys, so one split (two for split variants) of 1500+
    keys runs the transposed kernel; max_seq_len=1 the 64-row one. Both must match the reference and,
    at q_len 1, differ from each other (other tile orders round P differently), which shows that both
    ran. At q_len 2 a request's 64 rows take the 64-row kernel whatever the split length (rows_for), so
    the two results are bit-identical."""
    num_heads, page, dtype, split = key
    g = torch.Generator().manual_seed(7 + num_heads + page)
    n = 2 if split else 1
    for q_len in (1, 2):
        case = make_paged_case(_mixed_lens(page, 3001 + q_len), num_heads, page, q_len, DTYPE[dtype], generator=g)
        ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
        outs = []
        for bound in (None, 1):
            out, lse = _run(case, n, max_seq_len=bound)
            problems = compare(out, lse, *ref)
            assert not problems, f"{key} q_len={q_len} max_seq_len={bound}: {problems}"
            outs.append(out)
        if q_len == 1:
            assert not torch.equal(outs[0], outs[1]), f"{key} q_len=1: the same kernel ran for both max_seq_len"
        else:
            assert torch.equal(outs[0], outs[1]), f"{key} q_len={q_len}: 64 rows per request, yet two kernels ran"


@pytest.mark.parametrize("num_heads", [1, 3, 20, 100, 160])
@pytest.mark.parametrize("q_len", [1, 3])
def test_head_counts_not_in_table(num_heads, q_len):
    """Heads served by a larger variant with masked rows, or by head groups past the largest."""
    _need(num_heads, 64, split=True)
    g = torch.Generator().manual_seed(num_heads * 10 + q_len)
    case = make_paged_case([5, 0, 700, 64, 1500], num_heads, 64, q_len, generator=g)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    for n in (1, 3):
        out, lse = _run(case, n)
        assert not compare(out, lse, ref_out, ref_lse), (num_heads, q_len, n, compare(out, lse, ref_out, ref_lse))


@pytest.mark.parametrize("page", [1, 64])
def test_large_logits(page):
    """q ~ N(0, 10^2): P is rounded to 16 bits before P V, so only cosine and lse bounds apply."""
    _need(16, page, split=True)
    g = torch.Generator().manual_seed(7)
    case = make_paged_case([1, 300, 2000, 4097], 16, page, 2, q_std=10.0, generator=g, softmax_scale=0.3)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    for n in (1, 4, 33):
        out, lse = _run(case, n)
        assert not compare(out, lse, ref_out, ref_lse, elementwise=False), (n, compare(out, lse, ref_out, ref_lse, elementwise=False))


def test_q_pair_and_strided_views():
    """q as (q_nope, q_pe) views of one buffer, a cache that is a view into a larger per-layer buffer,
    and preallocated strided out."""
    _need(32, 16, split=True)
    g = torch.Generator().manual_seed(3)
    case = make_paged_case([100, 2000, 33], 32, 16, 2, generator=g)
    layers = torch.randn(2, *case.kv_cache.shape, device="cuda").to(case.kv_cache.dtype)
    layers[1] = case.kv_cache
    kv_view = layers[1]
    qbuf = torch.randn(3, 2, 32, 1024, device="cuda").to(case.q.dtype)
    qbuf[..., 128:640] = case.q[..., :512]
    qbuf[..., 768:832] = case.q[..., 512:]
    q_pair = (qbuf[..., 128:640], qbuf[..., 768:832])
    obuf = torch.full((3, 2, 32, 640), float("nan"), device="cuda").to(case.q.dtype)
    # Rows 16-byte aligned, and rows only 8-byte aligned (the epilogue's 8-byte store path).
    obuf8 = torch.full((3, 2, 32, 520), float("nan"), device="cuda").to(case.q.dtype)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    for out_view in (obuf[..., :512], obuf8[..., 4:516]):
        for n in (1, 5):
            out_view.fill_(float("nan"))
            out, lse = mla_decode(q_pair, kv_view, case.block_table, case.seq_lens, case.softmax_scale,
                                  num_kv_splits=n, out=out_view)
            assert out.data_ptr() == out_view.data_ptr()
            assert not compare(out, lse, ref_out, ref_lse), compare(out, lse, ref_out, ref_lse)
    assert obuf8[..., :4].isnan().all() and obuf8[..., 516:].isnan().all(), "wrote outside the out view"


def test_long_sequence_and_default_splits():
    _need(16, 64, split=True)
    g = torch.Generator().manual_seed(11)
    case = make_paged_case([70000, 1, 0], 16, 64, 1, generator=g)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    out, lse = _run(case, None)
    assert not compare(out, lse, ref_out, ref_lse), compare(out, lse, ref_out, ref_lse)


def test_fresh_data_changes_the_answer():
    """Guards against a kernel that returns something constant: two random draws must differ."""
    _need(16, 64, split=False)
    a = make_paged_case([500], 16, 64, generator=torch.Generator().manual_seed(1))
    b = make_paged_case([500], 16, 64, generator=torch.Generator().manual_seed(2))
    oa, _ = mla_decode(a.q, a.kv_cache, a.block_table, a.seq_lens, a.softmax_scale)
    ob, _ = mla_decode(b.q, b.kv_cache, b.block_table, b.seq_lens, b.softmax_scale)
    assert not torch.equal(oa, ob)


@pytest.mark.parametrize("q_len", [3, 5, 6, 7, 8])
@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_every_q_len_to_8(num_heads, q_len, dtype):
    """q_len 3 and 5-8 (1, 2 and 4 run per variant above) at every default head count, page 64: the
    transposed variants' 16/32-row blocks and requests spread over several 32-row CTAs, the 64-row
    path's several row blocks per request; causal rows that see no key (seq_len < q_len), forced splits."""
    from mla_variants.testing import FP8_TOLERANCE
    token = "fp8_e4m3" if dtype == torch.float8_e4m3fn else "bf16"
    _need(num_heads, 64, True, token)
    g = torch.Generator().manual_seed(num_heads * 100 + q_len)
    case = make_paged_case([q_len - 2, 1, 64, 65, 700 + q_len, 2500], num_heads, 64, q_len, dtype, generator=g)
    kw = {"k_scale": case.k_scale} if case.k_scale is not None else {}
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, **kw)
    for n in (1, 3, 17):
        out, lse = _run(case, n)
        problems = compare(out, lse, ref_out, ref_lse, **(FP8_TOLERANCE if case.k_scale is not None else {}))
        assert not problems, f"heads {num_heads} q_len {q_len} {token} num_kv_splits {n}: {problems}"
