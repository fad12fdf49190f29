"""The fp32 reference against an independent dense softmax (PyTorch SDPA in float64), on the CPU."""
import math

import pytest
import torch
import torch.nn.functional as F

from mla_variants import mla_decode_reference
from mla_variants import workspace_size
from mla_variants.splits import num_kv_splits_for
from mla_variants.testing import compare, make_paged_case


def _dense(case, b):
    """Gather request b contiguously and run SDPA with an explicit causal mask, in float64."""
    n = int(case.seq_lens[b])
    page = case.kv_cache.shape[1]
    pages = case.block_table[b, : (n + page - 1) // page].long()
    kv = case.kv_cache[pages].reshape(-1, 576)[:n].double()
    q = case.q[b].double().transpose(0, 1)  # [heads, q_len, 576]
    q_len = q.shape[1]
    mask = torch.arange(n)[None, :] < (n - (q_len - 1 - torch.arange(q_len)))[:, None]
    out = F.scaled_dot_product_attention(q, kv[None], kv[None, :, :512], attn_mask=mask, scale=case.softmax_scale)
    s = (q @ kv.T) * case.softmax_scale
    lse = torch.logsumexp(s.masked_fill(~mask, -math.inf), dim=-1)
    return out.transpose(0, 1), lse


@pytest.mark.parametrize("page,q_len", [(1, 1), (16, 2), (64, 4), (5, 3)])
def test_reference_matches_dense_softmax(page, q_len):
    g = torch.Generator().manual_seed(page * 7 + q_len)
    case = make_paged_case([37, 200, 64, 9], 4, page, q_len, torch.float32, device="cpu", generator=g)
    out, lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert torch.isfinite(out).all()
    for b in range(4):
        d_out, d_lse = _dense(case, b)
        torch.testing.assert_close(out[b].double(), d_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), d_lse, atol=1e-5, rtol=1e-5)


def test_reference_empty_rows_and_q_pair():
    g = torch.Generator().manual_seed(0)
    case = make_paged_case([0, 2], 3, 16, 4, torch.float32, device="cpu", generator=g)
    out, lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    # request 1 has 2 keys and q_len 4: queries 0 and 1 see none, 2 sees one, 3 sees two
    assert torch.isneginf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2:]).all()
    assert (out[1, :2] == 0).all()
    torch.testing.assert_close(out[1, 2], case.kv_cache[case.block_table[1, 0].long(), 0, :512].expand(3, 512))
    pair = (case.q[..., :512], case.q[..., 512:])
    out2, lse2 = mla_decode_reference(pair, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_compare_catches_wrong_answers():
    g = torch.Generator().manual_seed(1)
    case = make_paged_case([50, 0], 2, 16, 1, torch.float32, device="cpu", generator=g)
    out, lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert compare(out, lse, out, lse) == []
    assert compare(out * 1.1, lse, out, lse)
    long = make_paged_case([16384], 1, 64, 1, torch.float32, device="cpu", generator=g)
    lo, ll = mla_decode_reference(long.q, long.kv_cache, long.block_table, long.seq_lens, long.softmax_scale)
    assert any("relative L2" in p for p in compare(lo * 0.9, ll, lo, ll))  # cosine and atol alone miss a scale
    assert compare(out[:1], lse[:1], out, lse)  # shape mismatch
    assert compare(out, lse + 1e-2, out, lse)
    bad = out.clone(); bad[0, 0, 0, 0] = float("nan")
    assert compare(bad, lse, out, lse)
    bad_lse = lse.clone(); bad_lse[1] = 0.0
    assert compare(out, bad_lse, out, lse)


def test_reference_rejects_what_it_cannot_read():
    case = make_paged_case([20], 1, 16, 1, torch.float32, device="cpu", generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]: expected 0..32"):
        mla_decode_reference(case.q, case.kv_cache, case.block_table, torch.tensor([33], dtype=torch.int32), 0.1)
    table = case.block_table.clone()
    table[0, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[0\]: expected page ids"):
        mla_decode_reference(case.q, case.kv_cache, table, case.seq_lens, 0.1)


def test_reference_checks_its_arguments():
    """The reference refuses what mla_decode refuses instead of computing NaN or indexing past a list."""
    case = make_paged_case([20, 5], 1, 16, 1, torch.float32, device="cpu", generator=torch.Generator().manual_seed(4))
    args = [case.q, case.kv_cache, case.block_table, case.seq_lens, 0.1]
    for i, bad, words in ((4, float("nan"), "softmax_scale: expected a finite positive float"),
                          (4, -1.0, "softmax_scale"), (4, True, "softmax_scale"),
                          (3, case.seq_lens[:1], r"seq_lens: expected an integer tensor of shape \[batch=2\]"),
                          (3, case.seq_lens.float(), "seq_lens: expected an integer tensor"),
                          (2, case.block_table[0], "block_table: expected an integer tensor of shape"),
                          (2, case.block_table.float(), "block_table: expected an integer tensor"),
                          (1, case.kv_cache[..., :512], "q/kv_cache: expected q"),
                          # break-it findings: fp32 overflow to NaN, a string, a non-tensor, rows of 600
                          (4, 1e31, r"softmax_scale: expected a finite positive float \(at least 1.18e-38 and at most 1e"),
                          (4, 1e-46, "softmax_scale: expected a finite positive float"),
                          (4, "0.1", "softmax_scale"), (1, None, "kv_cache: expected a tensor, got NoneType"),
                          (3, [20, 5], "seq_lens: expected a tensor"),
                          (3, case.seq_lens.bool(), "seq_lens: expected an integer tensor"),
                          (0, (case.q[..., :512], case.q[..., 512:], case.q), "q: expected a tensor or the pair"),
                          (0, torch.cat([case.q, case.q[..., :24]], -1), "q/kv_cache: expected q"),
                          # break-it findings (2026-12-06): a pair that does not fit together (torch's
                          # RuntimeError, or a 500 / 76 split accepted), non-float q or cache, another
                          # device, tensors without data
                          (0, (case.q[..., :512], case.q[:1, ..., 512:]), r"q: expected q_nope \[batch"),
                          (0, (case.q[..., :500], case.q[..., 500:]), r"q: expected q_nope \[batch"),
                          (0, (case.q[..., :512], case.q[..., 512:].double()), "of one dtype"),
                          (0, case.q.to(torch.complex64), "q: expected a float dtype"),
                          (0, case.q.int(), "q: expected a float dtype"),
                          (1, case.kv_cache.bool(), "kv_cache: expected a float dtype"),
                          (1, case.kv_cache.to("meta"), "kv_cache: expected a dense tensor with data"),
                          (0, case.q.to_sparse(), "q: expected a dense tensor with data")):
        a = list(args)
        a[i] = bad
        with pytest.raises(ValueError, match=words):
            mla_decode_reference(*a)
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="dtype: expected a float torch.dtype of 16 bits or more"):
            mla_decode_reference(*args, dtype=dtype)
    fp8 = case.kv_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale: required"):
        mla_decode_reference(case.q, fp8, case.block_table, torch.zeros(2, dtype=torch.int32), 0.1)


def test_poisoning_covers_unused_slots():
    case = make_paged_case([3, 17], 1, 8, 1, torch.float32, device="cpu", generator=torch.Generator().manual_seed(2))
    used = 0
    for b, n in enumerate([3, 17]):
        for j in range((n + 7) // 8):
            page = case.kv_cache[case.block_table[b, j].long()]
            k = min(8, n - 8 * j)
            assert torch.isfinite(page[:k]).all() and torch.isnan(page[k:]).all()
            used += 1
    assert torch.isnan(case.kv_cache).any(dim=-1).any(dim=-1).sum() == case.kv_cache.shape[0] - used + 2  # 2 partial pages


def _facts(num_heads, dtype="bf16", page_size=64, split=True):
    """A variant's path facts as codegen writes them into the manifest, read back as the runtime does."""
    from codegen.variant import PathFacts
    return PathFacts.from_json(PathFacts.of(num_heads, page_size, dtype, split).to_json())


def _splits(batch, heads, q_len, max_seq_len, num_sms, dtype="bf16"):
    return num_kv_splits_for(_facts(heads, dtype), batch, heads, q_len, max_seq_len, num_sms)


def test_split_heuristic_and_workspace_size():
    assert _splits(132, 16, 1, 16384, 132) == 1            # batch fills the GPU
    assert _splits(1, 16, 1, 16384, 132) == 64             # 256 tiles, capped at 64
    assert _splits(1, 16, 1, 4096, 132) == 64              # batch 1: one tile per split
    assert _splits(1, 16, 1, 1024, 132) == 16
    assert _splits(1, 128, 1, 1024, 132) == 16             # 2 CTAs, 16 tiles
    assert _splits(2, 16, 1, 4096, 132) == 32              # batch > 1: 64 tiles / 2 per split
    assert _splits(2, 16, 1, 1024, 132) == 8
    assert _splits(8, 128, 1, 16384, 132) == 8             # 16 CTAs -> 8 pieces each
    assert _splits(0, 16, 1, 100, 132) == 1
    # the transposed path holds up to 32 of a request's q_len x num_heads rows per CTA, the 64-row
    # kernel of a transposed 16-bit variant 64 (rows_for)
    assert _splits(33, 16, 4, 16384, 132) == 4             # 64 rows: 1 CTA per request, 33 CTAs -> 4 pieces
    assert _splits(33, 16, 2, 16384, 132) == 4             # 32 rows: 1 transposed CTA per request
    assert _splits(33, 8, 5, 16384, 132) == 4              # 40 rows: one 64-row CTA per request
    assert _splits(1, 8, 8, 16384, 132) == 64              # 64 rows: 1 CTA -> 132 pieces, capped at 64
    assert _splits(132, 8, 2, 16384, 132) == 1             # 16 rows: one CTA per request fills the GPU
    assert _splits(1, 32, 2, 16384, 132) == 64             # capped
    assert _splits(4, 32, 2, 4096, 132) == 32              # 64 rows: 4 CTAs, 64 tiles / 2 per piece
    assert _splits(4, 32, 1, 4096, 132) == 32              # q_len 1: 32 or 64 rows, one CTA per request
    assert _splits(66, 32, 1, 16384, 132) == 2             # 66 32-row CTAs: 2 pieces
    assert _splits(66, 32, 2, 16384, 132) == 2             # 66 64-row CTAs: 2 pieces
    assert _splits(132, 32, 2, 16384, 132) == 1            # 132 64-row CTAs fill the GPU
    assert _splits(66, 32, 2, 16384, 132, "fp8_e4m3") == 1   # fp8: 32-row CTAs, 132 of them
    assert _splits(4, 32, 2, 4096, 132, "fp8_e4m3") == 16    # 8 CTAs: 16 pieces of 256 keys
    assert _splits(4, 32, 1, 4096, 132, "fp8_e4m3") == 32    # fp8 32 heads q_len 1: 32-row CTAs
    # a last wave that leaves SMs idle (the wave model): 192 64-row CTAs on 132 SMs take two waves, the
    # second 45% full; 2 pieces make three full waves of half the tiles
    assert _splits(32, 128, 3, 16384, 132) == 2            # 6 CTAs per request: 192
    assert _splits(128, 128, 3, 16384, 132) == 1           # 768 CTAs: 5.8 waves, full enough
    assert _splits(128, 128, 1, 16384, 132) == 1           # 256 CTAs: 1.94 waves
    assert _splits(96, 128, 1, 16384, 132) == 2            # 192 CTAs
    assert _splits(48, 128, 1, 16384, 132) == 4            # 96 CTAs: one wave is 73% of the SMs; 4 pieces, 3 waves
    assert _splits(96, 128, 1, 256, 132) == 1              # 4 tiles: a piece's fixed cost outweighs the wave
    assert _splits(96, 128, 1, 1024, 132) == 1             # pieces of 8 tiles: measured 1.12x slower at 2
    assert _splits(96, 64, 1, 4096, 132) == 1              # 64 rows a request: memory-bound, 4 pieces ran 1.16x
    assert _splits(96, 16, 3, 16384, 132) == 1             # 48 rows a request: likewise (1.05x at 4 pieces)
    # integer arithmetic: a length far beyond float range still gives the capped split count
    assert _splits(1, 16, 1, 2**1100, 132) == 64
    assert _splits(1, 16, 1, 0, 132) == 1
    assert workspace_size(4, 16, 2, 1) == 0
    assert workspace_size(4, 16, 2, 3) == 3 * 4 * 2 * 16 * 513 * 4
    with pytest.raises(ValueError, match="num_kv_splits: expected a positive int"):
        workspace_size(4, 16, 2, 0)


def test_token_page_view_is_the_same_problem():
    from mla_variants.testing import as_token_pages
    case = make_paged_case([37, 200, 1], 2, 16, 2, torch.float32, device="cpu", generator=torch.Generator().manual_seed(4))
    kv1, table1 = as_token_pages(case.kv_cache, case.block_table)
    assert kv1.shape == (case.kv_cache.shape[0] * 16, 1, 576) and kv1.data_ptr() == case.kv_cache.data_ptr()
    a = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    b = mla_decode_reference(case.q, kv1, table1, case.seq_lens, case.softmax_scale)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_make_paged_case_on_cpu_only_machine_names_the_fix(monkeypatch):
    """A CPU-only machine asking for the default device='cuda' gets a message naming the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device='cpu'"):
        make_paged_case([10], 4, 16)
    assert make_paged_case([10], 4, 16, device="cpu").q.device.type == "cpu"
