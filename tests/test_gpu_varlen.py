"""mla_decode_varlen on the GPU against the per-request fp32 reference: NaN-prefilled outputs, NaN in
unused cache slots, permuted block tables, q_len 0..max per request, forced splits, fp8 caches, and a
CUDA graph captured once and replayed with other query_start_loc and seq_lens."""
import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import MLAInputError, mla_decode_varlen, mla_decode_varlen_reference  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, capture_graph, compare, make_paged_case  # noqa: E402


def _case(seq_lens, q_lens, heads, page, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    case = make_paged_case(seq_lens, heads, page, max(q_lens), dtype, generator=g)
    q = torch.cat([case.q[b, : q_lens[b]] for b in range(len(q_lens))])
    loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return case, q, loc


def _check(case, q, loc, out, lse):
    ref = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                      query_start_loc=loc, k_scale=case.k_scale)
    tol = FP8_TOLERANCE if case.k_scale is not None else {}
    return compare(out[None].cpu(), lse[None].cpu(), ref[0][None].cpu(), ref[1][None].cpu(), **tol)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_varlen_against_reference(heads, page, dtype):
    q_lens, seq_lens = [2, 0, 1, 4, 3, 4, 1], [1500, 0, 1, 3, 700, 4100, 65]
    case, q, loc = _case(seq_lens, q_lens, heads, page, dtype, heads + page)
    for splits in (None, 1, 7):
        out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda")
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                          max_q_len=4, num_kv_splits=splits, out=out, lse=lse, k_scale=case.k_scale)
        problems = _check(case, q, loc, out, lse)
        assert not problems, f"{heads} heads page {page} {dtype} splits {splits}: {problems}"


def test_a_captured_graph_follows_query_start_loc_and_seq_lens():
    case, q, loc = _case([900, 40, 300], [1, 3, 2], 16, 16, torch.bfloat16, 7)
    out = torch.full((6, 16, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((16, 6), float("nan"), device="cuda")
    graph = capture_graph(lambda: mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens,
                                                    case.softmax_scale, query_start_loc=loc, max_q_len=4,
                                                    out=out, lse=lse))
    for new_loc, new_lens in (([0, 1, 4, 6], [900, 40, 300]), ([0, 4, 4, 6], [800, 0, 290]), ([0, 2, 3, 6], [5, 39, 1])):
        loc.copy_(torch.tensor(new_loc, dtype=torch.int32))
        case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not _check(case, q, loc, out, lse), f"replay with query_start_loc {new_loc}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_plan_run_varlen_and_its_graph(dtype):
    from mla_variants import MLADecodePlan
    case, q, loc = _case([900, 0, 300, 77], [1, 0, 4, 2], 16, 64, dtype, 11)
    kv_dtype = dtype if dtype == torch.float8_e4m3fn else None
    plan = MLADecodePlan(8, 16, 64, q_len=4, dtype=torch.bfloat16, kv_dtype=kv_dtype, max_seq_len=4096)
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((16, q.shape[0]), float("nan"), device="cuda")

    def step():
        plan.run_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                        out=out, lse=lse, k_scale=case.k_scale)
    step()
    torch.cuda.synchronize()
    assert not _check(case, q, loc, out, lse)
    graph = capture_graph(step)
    loc.copy_(torch.tensor([0, 3, 3, 6, 7], dtype=torch.int32))
    case.seq_lens.copy_(torch.tensor([850, 0, 5, 3], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not _check(case, q, loc, out, lse)


def test_balanced_plan_run_varlen_skips_padding_blocks_exactly():
    """128 heads, q_len up to 4 on the balanced schedule: a request with fewer tokens than the launch's
    q_len leaves whole 64-row blocks without a placed row, which read no keys (params.cuh row_block_empty)
    while the blocks of its tokens, shared across CTAs, still combine exactly."""
    from mla_variants import MLADecodePlan, _binding
    lib = _binding.library()
    if not any(k[0] == 128 and k[2] == "bf16" and lib.facts[k].balanced_schedule for k in lib.table):
        pytest.skip("no 128-head bf16 split variant with the balanced schedule in this build")
    q_lens, seq_lens = [1, 4, 0, 2, 3, 1], [5000, 300, 2000, 0, 9000, 64]
    case, q, loc = _case(seq_lens, q_lens, 128, 64, torch.bfloat16, 13)
    plan = MLADecodePlan(len(q_lens), 128, 64, q_len=4, dtype=torch.bfloat16, max_seq_len=9216, balanced=True)
    assert plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * 64)
    out = torch.full((q.shape[0], 128, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((128, q.shape[0]), float("nan"), device="cuda")
    plan.run_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                    out=out, lse=lse)
    torch.cuda.synchronize()
    assert not _check(case, q, loc, out, lse), plan.scheduled_cut()


def test_plan_run_varlen_refuses_an_out_that_shares_memory_with_seq_lens():
    from mla_variants import MLADecodePlan
    case, q, loc = _case([40, 50, 60], [1, 1, 1], 8, 16, torch.bfloat16, 3)
    plan = MLADecodePlan(4, 8, 16, q_len=2, dtype=torch.bfloat16, max_seq_len=64)
    buf = torch.zeros(q.shape[0] * 8 * 512 * 2, dtype=torch.uint8, device="cuda")
    out = buf.view(torch.bfloat16).view(q.shape[0], 8, 512)
    lens = buf[:12].view(torch.int32)
    lens.copy_(case.seq_lens)
    with pytest.raises(MLAInputError, match="^out: "):
        plan.run_varlen(q, case.kv_cache, case.block_table, lens, case.softmax_scale, query_start_loc=loc, out=out,
                        lse=torch.empty(8, q.shape[0], device="cuda"))
    assert lens.tolist() == case.seq_lens.tolist()


def test_varlen_op_compiles_fullgraph_and_passes_opcheck():
    import mla_variants.ops  # noqa: F401
    case, q, loc = _case([900, 40, 300], [1, 3, 2], 16, 64, torch.bfloat16, 5)

    class Attn(torch.nn.Module):
        def forward(self, q, kv, bt, sl, loc):
            out, lse = torch.ops.mla_variants.mla_decode_varlen(q[..., :512], q[..., 512:], kv, bt, sl, loc, 4,
                                                                 case.softmax_scale, 0)
            return out * 2, lse

    out, lse = torch.compile(Attn(), fullgraph=True)(q, case.kv_cache, case.block_table, case.seq_lens, loc)
    assert not _check(case, q, loc, out / 2, lse)
    args = (q[..., :512], q[..., 512:], case.kv_cache, case.block_table, case.seq_lens, loc, 4, case.softmax_scale, 3)
    torch.library.opcheck(torch.ops.mla_variants.mla_decode_varlen.default, args)


@pytest.mark.parametrize("loc, bad", [
    ([0, 2, 7], [2, 3, 4, 5, 6]),          # request 1 has 5 tokens, more than max_q_len 4: its own rows
    ([1, 3, 7], list(range(7))),           # not starting at 0: every row
    ([0, 3, 5], [5, 6]),                   # tokens past the last request (padding): their own rows
    ([0, 4, 2, 7], list(range(7))),        # decreasing: every row
])
def test_tokens_no_request_owns_get_nan(loc, bad):
    """The kernels write only the tokens of well-placed requests and the fill kernel gives the others NaN
    (outputs prefilled with zeros, so every NaN was written): the same rows as the reference's."""
    n = len(loc) - 1
    case, _, _ = _case([40] * n, [4] * n, 16, 16, torch.bfloat16, 11)
    q = case.q.reshape(-1, 16, 576)[:7].contiguous()
    loc_t = torch.tensor(loc, dtype=torch.int32, device="cuda")
    for splits in (1, 3):
        out = torch.zeros(7, 16, 512, dtype=q.dtype, device="cuda")
        lse = torch.zeros(16, 7, device="cuda")
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc_t,
                          max_q_len=4, num_kv_splits=splits, out=out, lse=lse)
        torch.cuda.synchronize()
        nan_rows = [t for t in range(7) if torch.isnan(out[t]).all() and torch.isnan(lse[:, t]).all()]
        assert nan_rows == bad, (loc, splits, nan_rows)
        good = [t for t in range(7) if t not in bad]
        assert torch.isfinite(out[good]).all() and torch.isfinite(lse[:, good]).all()
        if good:  # a well-formed query_start_loc (the reference refuses the malformed ones)
            ref_out, ref_lse = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens,
                                                           case.softmax_scale, query_start_loc=loc_t)
            assert not compare(out[good][None].cpu(), lse[:, good][None].cpu(), ref_out[good][None].cpu(),
                               ref_lse[:, good][None].cpu()), (loc, splits)


@pytest.mark.parametrize("heads", [20, 160])
def test_masked_heads_and_head_groups(heads):
    """20 heads run masked on a larger variant, 160 as head groups: each launch's rows find their packed
    tokens (query_row), per group's head offset."""
    q_lens, seq_lens = [3, 1, 0, 2], [500, 64, 7, 1300]
    case, q, loc = _case(seq_lens, q_lens, heads, 64, torch.bfloat16, heads)
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda")
    for splits in (None, 2):
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                          max_q_len=3, num_kv_splits=splits, out=out, lse=lse)
        assert not _check(case, q, loc, out, lse), (heads, splits)
