"""Variable q_len per request (mla_variants/varlen.py): the kernels' placement, modelled as a padded
uniform batch (tests/design/varlen_model.py), equals the per-request reference, on the CPU with the fp32 reference as the decode (the GPU half, with the
kernels and CUDA graphs, is in test_gpu_varlen.py); malformed query_start_loc gives NaN rows, or
MLAInputError with debug=True; argument errors name the argument."""
import math

import pytest
import torch

from mla_variants import MLAInputError, mla_decode_reference, mla_decode_varlen, mla_decode_varlen_reference
from mla_variants.testing import compare, make_paged_case
from design.varlen_model import padded_index, run_padded


def packed_case(seq_lens, q_lens, num_heads, page_size, dtype=torch.bfloat16, seed=0, device="cpu"):
    """A paged case whose request b has q_lens[b] new tokens, q packed as [total, heads, 576]."""
    g = torch.Generator().manual_seed(seed)
    case = make_paged_case(seq_lens, num_heads, page_size, max(max(q_lens), 1), dtype, device=device, generator=g)
    q = torch.cat([case.q[b, : q_lens[b]] for b in range(len(q_lens))])
    loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return case, q, loc


def reference_decode(case):
    def decode(q_pad, seq_lens, _out, _lse):
        return mla_decode_reference(q_pad, case.kv_cache, case.block_table, seq_lens, case.softmax_scale,
                                    k_scale=case.k_scale)
    return decode


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_padded_batch_equals_each_request_alone(page_size, dtype):
    q_lens, max_q_len = [3, 0, 1, 4, 2, 4], 4
    seq_lens = [200, 0, 1, 3, 130, 70]  # request 3: 4 new tokens over 3 keys (the first query sees none)
    case, q, loc = packed_case(seq_lens, q_lens, 16, page_size, dtype, seed=page_size)
    out, lse = run_padded(reference_decode(case), q, case.seq_lens, loc, max_q_len)
    ref_out, ref_lse = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens,
                                                   case.softmax_scale, query_start_loc=loc, k_scale=case.k_scale)
    assert out.shape == (sum(q_lens), 16, 512) and lse.shape == (16, sum(q_lens))
    assert torch.isinf(ref_lse[:, 4]).all() and (ref_out[4] == 0).all()  # token 4: request 3's first query sees no key
    # compare() takes [batch, q_len, heads, 512] / [batch, heads, q_len]: one packed "request" of all tokens
    assert not compare(out[None], lse[None], ref_out[None].to(out.dtype), ref_lse[None])
    # and each request's rows are its own uniform reference with q_len_b tokens
    for b, (lo, hi) in enumerate(zip(loc.tolist(), loc.tolist()[1:])):
        if hi > lo:
            o, l = mla_decode_reference(q[lo:hi][None], case.kv_cache, case.block_table[b:b + 1], case.seq_lens[b:b + 1],
                                        case.softmax_scale, k_scale=case.k_scale)
            torch.testing.assert_close(ref_out[lo:hi], o[0])


def test_q_pair_and_outputs_in_place():
    case, q, loc = packed_case([50, 90], [2, 1], 8, 16)
    out = torch.full((3, 8, 512), float("nan"), dtype=q.dtype)
    lse = torch.full((8, 3), float("nan"))
    got = run_padded(reference_decode(case), (q[..., :512], q[..., 512:]), case.seq_lens, loc, 2, out, lse)
    assert got[0] is out and got[1] is lse and torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                      query_start_loc=loc)
    assert not compare(out[None], lse[None], ref[0][None].to(out.dtype), ref[1][None])


def test_index_places_each_token_at_its_requests_last_rows():
    loc = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    dst, valid = padded_index(loc, 6, 4)
    assert valid.all()
    assert dst.tolist() == [2, 3, 9, 10, 11, 15]  # request 0 rows 2-3, request 2 rows 9-11, request 3 row 15


@pytest.mark.parametrize("loc, bad", [
    ([0, 2, 7], [2, 3, 4, 5, 6]),          # request 1 has 5 tokens, more than max_q_len 4: its own rows
    ([1, 3, 7], list(range(7))),           # not starting at 0: every row
    ([0, 3, 5], [5, 6]),                   # tokens past the last request (padding): their own rows
    ([0, 4, 2, 7], list(range(7))),        # decreasing: every row
])
def test_a_malformed_query_start_loc_gives_nan_rows_not_a_crash(loc, bad):
    case, _, _ = packed_case([40] * (len(loc) - 1), [4] * (len(loc) - 1), 8, 16)
    q = case.q.reshape(-1, 8, 576)[:7]
    loc = torch.tensor(loc, dtype=torch.int32)
    out, lse = run_padded(reference_decode(case), q, case.seq_lens, loc, 4)
    nan_rows = [t for t in range(7) if torch.isnan(out[t]).all() and torch.isnan(lse[:, t]).all()]
    assert nan_rows == bad
    assert torch.isfinite(out[[t for t in range(7) if t not in bad]]).all()
    if loc[-1] < 7 and bad == [5, 6]:
        return  # legal: padding tokens past the last request
    with pytest.raises(MLAInputError, match="^query_start_loc: expected 0 = query_start_loc"):
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                          query_start_loc=loc, max_q_len=4, debug=True)


@pytest.mark.parametrize("kwargs, arg", [
    ({"max_q_len": 0}, "max_q_len"), ({"max_q_len": 9}, "max_q_len"), ({"max_q_len": True}, "max_q_len"),
    ({"query_start_loc": torch.tensor([0, 1, 3])}, "query_start_loc"),              # int64
    ({"query_start_loc": torch.tensor([3], dtype=torch.int32)}, "query_start_loc"),  # no request
    ({"q": torch.zeros(1, 3, 8, 576, dtype=torch.bfloat16)}, "q"),                  # the uniform layout
    ({"out": torch.zeros(3, 8, 511, dtype=torch.bfloat16)}, "out"),
    ({"lse": torch.zeros(3, 8)}, "lse"),                                            # [total, heads]: transposed
    ({"debug": 1}, "debug"),
    ({"q": (torch.zeros(3, 8, 512, dtype=torch.bfloat16), torch.zeros(3, 8, 64, dtype=torch.float16))}, "q_pe"),
    ({"q": torch.zeros(3, 8, 576)}, "q"),                                            # fp32 q
    ({"seq_lens": [30, 40]}, "seq_lens"),
    # one entry too many: block_table and seq_lens agree on 2 requests, so query_start_loc is the one named
    ({"query_start_loc": torch.tensor([0, 1, 2, 3], dtype=torch.int32)}, "query_start_loc"),
    ({"seq_lens": torch.tensor([30], dtype=torch.int32)}, "seq_lens"),               # one of the two disagrees
    ({"seq_lens": None}, "seq_lens"),                                                # not a tensor: named itself
])
def test_argument_errors_name_the_argument(kwargs, arg):
    case, q, loc = packed_case([30, 40], [1, 2], 8, 16)
    call = {"q": q, "query_start_loc": loc, "max_q_len": 2, "seq_lens": case.seq_lens, **kwargs}
    with pytest.raises(MLAInputError, match=f"^{arg}: expected"):
        mla_decode_varlen(call.pop("q"), case.kv_cache, case.block_table, call.pop("seq_lens"), case.softmax_scale, **call)


def test_outputs_that_share_memory_with_an_input_or_each_other_are_refused():
    case, q, loc = packed_case([30, 40], [1, 2], 8, 16)
    buf = torch.zeros(3 * 8 * 512 * 2, dtype=torch.uint8)
    out = buf.view(torch.bfloat16).view(3, 8, 512)
    with pytest.raises(MLAInputError, match="^out: expected memory of its own"):  # out and lse overlap
        run_padded(reference_decode(case), q, case.seq_lens, loc, 2, out, buf[: 8 * 3 * 4].view(torch.float32).view(8, 3))
    over_cache = case.kv_cache.view(-1)[: 3 * 8 * 512].view(3, 8, 512)
    with pytest.raises(MLAInputError, match="^out: expected memory of its own.*shares memory with kv_cache"):
        mla_decode_varlen(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, query_start_loc=loc,
                          max_q_len=2, out=over_cache)


def test_a_sparse_input_beside_a_given_out_is_named_not_a_crash():
    """The outputs' overlap check runs before the inputs' own checks: a tensor without strided storage
    (here a sparse kv_cache) is left to the check that names it (review finding: RuntimeError)."""
    case, q, loc = packed_case([30, 40], [1, 2], 8, 16)
    out = torch.empty(3, 8, 512, dtype=q.dtype)
    with pytest.raises(MLAInputError, match="^kv_cache: expected"):
        mla_decode_varlen(q, case.kv_cache.to_sparse(), case.block_table, case.seq_lens, case.softmax_scale,
                          query_start_loc=loc, max_q_len=2, out=out)


def test_uniform_q_len_is_the_uniform_call():
    """A varlen call whose requests all have q_len Q gives what the uniform [batch, Q, ...] call gives."""
    case, q, loc = packed_case([100, 33, 7], [3, 3, 3], 16, 1)
    out, lse = run_padded(reference_decode(case), q, case.seq_lens, loc, 3)
    u_out, u_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    torch.testing.assert_close(out, u_out.reshape(9, 16, 512).to(out.dtype), rtol=0, atol=0)
    assert torch.equal(lse, u_lse.permute(1, 0, 2).reshape(16, 9)) or math.isclose(
        (lse - u_lse.permute(1, 0, 2).reshape(16, 9)).nan_to_num().abs().max().item(), 0.0, abs_tol=1e-6)


def test_the_varlen_op_has_shapes_for_tracing():
    """torch.ops.mla_variants.mla_decode_varlen's fake implementation (what torch.compile traces), on
    meta tensors: out [total_q_tokens, num_heads, 512], lse [num_heads, total_q_tokens]."""
    import mla_variants.ops  # noqa: F401

    m = dict(device="meta")
    args = (torch.empty(7, 16, 512, dtype=torch.bfloat16, **m), torch.empty(7, 16, 64, dtype=torch.bfloat16, **m),
            torch.empty(10, 64, 576, dtype=torch.bfloat16, **m), torch.empty(3, 4, dtype=torch.int32, **m),
            torch.empty(3, dtype=torch.int32, **m), torch.empty(4, dtype=torch.int32, **m))
    out, lse = torch.ops.mla_variants.mla_decode_varlen(*args, 4, 0.1, 0)
    assert out.shape == (7, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (16, 7) and lse.dtype == torch.float32
    with pytest.raises(MLAInputError, match="^q_nope/q_pe: expected shapes \\[total_q_tokens"):
        torch.ops.mla_variants.mla_decode_varlen(args[0][None], args[1][None], *args[2:], 4, 0.1, 0)
    with pytest.raises(MLAInputError, match="^max_q_len: expected an int from 1 to 8, got 9"):
        torch.ops.mla_variants.mla_decode_varlen(*args, 9, 0.1, 0)
    with pytest.raises(MLAInputError, match="^query_start_loc: expected a 1-d int32 tensor"):
        torch.ops.mla_variants.mla_decode_varlen(*args[:5], args[5].long(), 4, 0.1, 0)
    with pytest.raises(MLAInputError, match="^q_nope/q_pe: expected one dtype"):
        torch.ops.mla_variants.mla_decode_varlen(args[0], args[1].half(), *args[2:], 4, 0.1, 0)
    with pytest.raises(MLAInputError, match="^query_start_loc: expected a 1-d int32 tensor \\[batch \\+ 1\\] with batch >= 1"):
        torch.ops.mla_variants.mla_decode_varlen(*args[:5], args[5][:1], 4, 0.1, 0)
    with pytest.raises(MLAInputError, match="^seq_lens: expected shape \\[batch=3\\]"):
        torch.ops.mla_variants.mla_decode_varlen(*args[:4], args[4][:2], args[5], 4, 0.1, 0)
    with pytest.raises(MLAInputError, match="^query_start_loc: expected batch \\+ 1 = 4 entries"):
        torch.ops.mla_variants.mla_decode_varlen(*args[:5], args[5][:3], 4, 0.1, 0)
    # symbolic sizes (torch.compile dynamic=True) trace through the checks (break-it finding: a set of
    # SymInts raised "unhashable type")
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(lambda *a: torch.ops.mla_variants.mla_decode_varlen(*a, 4, 0.1, 0), tracing_mode="symbolic")(*args)
    assert "mla_decode_varlen" in str(graph.graph)
    # more tokens than MAX_Q_LEN in all is fine: each packed token is one query row
    many = (torch.empty(40, 16, 512, dtype=torch.bfloat16, **m), torch.empty(40, 16, 64, dtype=torch.bfloat16, **m))
    out, lse = torch.ops.mla_variants.mla_decode_varlen(*many, *args[2:], 4, 0.1, 0)
    assert out.shape == (40, 16, 512) and lse.shape == (16, 40)


def test_the_reference_names_the_request_and_the_argument():
    from mla_variants import mla_decode_varlen_reference
    case = make_paged_case([40, 50, 60], 8, 16, 1, torch.bfloat16, device="cpu")
    q, loc = case.q[:, 0], torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    lens = case.seq_lens.clone()
    lens[2] = 10**6
    with pytest.raises(ValueError, match="^seq_lens\\[2\\]: expected 0..64"):
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table, lens, case.softmax_scale, query_start_loc=loc)
    with pytest.raises(MLAInputError, match="^block_table: expected batch = len\\(query_start_loc\\) - 1 = 3 rows, "
                                            "got a torch.int32 tensor of shape \\(2, 4\\)"):
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table[:2], case.seq_lens, case.softmax_scale,
                                    query_start_loc=loc)
    # pairs that do not fit together, among them a swapped pair (break-it finding: silently wrong)
    for pair in ((q[..., :512], q[:2, :, 512:]), (q[..., 512:], q[..., :512]), (q[..., :512], q[..., 512:].float())):
        with pytest.raises(MLAInputError, match="^q: expected q_nope \\[total_q_tokens, num_heads, 512\\]"):
            mla_decode_varlen_reference(pair, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                        query_start_loc=loc)
    with pytest.raises(MLAInputError, match="^query_start_loc: expected batch \\+ 1 = 4 entries"):  # one too many
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                    query_start_loc=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32))
    with pytest.raises(MLAInputError, match="^q: expected a dense tensor with data"):
        mla_decode_varlen_reference(q.to_sparse(), case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                    query_start_loc=loc)
    # break-it findings: an empty query_start_loc was blamed on seq_lens ("-1 rows"); a batch of q_len-0
    # requests checked nothing
    with pytest.raises(MLAInputError, match="^query_start_loc: expected a 1-d integer tensor \\[batch \\+ 1\\] with batch >= 1"):
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                    query_start_loc=loc[:1])
    for bad in (torch.tensor([False, True, True, True]), loc.to("meta")):  # break-it findings: accepted, torch's error
        with pytest.raises(MLAInputError, match="^query_start_loc: expected"):
            mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                        query_start_loc=bad)
    with pytest.raises(MLAInputError, match="^dtype: expected a float torch.dtype"):
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                    query_start_loc=loc, dtype=torch.int32)
    with pytest.raises(ValueError, match="^softmax_scale: expected a finite positive float"):
        mla_decode_varlen_reference(q, case.kv_cache, case.block_table, case.seq_lens, -1.0,
                                    query_start_loc=torch.zeros(4, dtype=torch.int32))
