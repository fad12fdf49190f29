"""Variable q_len per request (the engines' varlen layout: MTP and speculative steps whose draft lengths
differ): q packed as [total_q_tokens, num_heads, 576] with query_start_loc [batch + 1].

How it runs: the kernels take the packed layout themselves (abi.h query_start_loc): a launch has
max_q_len query rows per request, and request b's q_len_b tokens take its last q_len_b rows, so with
the mask causal and bottom-right aligned, row max_q_len - q_len_b + j sees seq_len - (q_len_b - 1 - j)
keys: exactly what query j of a request with q_len_b new tokens sees. The kernels read each row's q and
write its out and lse at the packed token's place (params.cuh query_row); the first max_q_len - q_len_b
rows are padding, which shares the request's one read of its keys. Nothing is derived on the host from
query_start_loc, so the call can be captured in a CUDA graph. tests/design/varlen_model.py is the same
computation on a padded uniform batch (scatter, a uniform decode, gather), the CPU model of it.

A request with q_len 0 (an empty slot of a padded batch) writes nothing. Tokens past
query_start_loc[-1] (an engine padding total_q_tokens to a captured size) belong to no request and get
NaN out and lse; so does a request longer than max_q_len, as a bad seq_len does, and every token when
query_start_loc is malformed (not starting at 0, decreasing, or ending past total_q_tokens); debug=True
checks query_start_loc on the host first and raises MLAInputError instead.
"""
from __future__ import annotations

import torch

from .validation import HEAD_DIM, KV_LORA_RANK, MAX_Q_LEN, Q_DTYPES, MLAInputError, byte_span, check_no_overlap, \
    check_tensor, fail, shown


def _check(q, query_start_loc, max_q_len: int, out, lse, inputs=()):
    """(total_q_tokens, num_heads) after checking the varlen arguments; out and lse must not share
    memory with each other, q, query_start_loc or `inputs` ((name, tensor or other value) pairs: the
    caller's other arguments; those that are not strided tensors are checked by the caller's own
    checks, which name them)."""
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or not 1 <= max_q_len <= MAX_Q_LEN:
        fail("max_q_len", f"an int from 1 to {MAX_Q_LEN} (the longest request's q_len this call allows)", shown(max_q_len))
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            fail("q", "a tensor or the pair (q_nope, q_pe)", f"a sequence of {len(q)}")
        check_tensor("q_nope", q[0], 3, tuple(Q_DTYPES))
        check_tensor("q_pe", q[1], 3, q[0].dtype, q[0].device)
        if q[0].shape[-1] != KV_LORA_RANK or q[1].shape[-1] != HEAD_DIM - KV_LORA_RANK or q[0].shape[:2] != q[1].shape[:2]:
            fail("q", f"q_nope [total_q_tokens, num_heads, {KV_LORA_RANK}] and q_pe [total_q_tokens, num_heads, "
                      f"{HEAD_DIM - KV_LORA_RANK}]", f"{tuple(q[0].shape)} and {tuple(q[1].shape)}")
        first = q[0]
    else:
        check_tensor("q", q, 3, tuple(Q_DTYPES))
        if q.shape[-1] != HEAD_DIM:
            fail("q", f"[total_q_tokens, num_heads, {HEAD_DIM}] (the varlen layout)", f"shape {tuple(q.shape)}")
        first = q
    total, heads = first.shape[0], first.shape[1]
    if heads < 1:
        fail("q", "num_heads (dim 1) >= 1", heads)
    check_tensor("query_start_loc", query_start_loc, 1, torch.int32, first.device)
    if query_start_loc.shape[0] < 2 or not query_start_loc.is_contiguous():
        fail("query_start_loc", "a contiguous [batch + 1] int32 tensor with batch >= 1 (the kernels read it)",
             f"shape {tuple(query_start_loc.shape)}, strides {tuple(query_start_loc.stride())}")
    if out is not None:
        check_tensor("out", out, 3, first.dtype, first.device)
        if tuple(out.shape) != (total, heads, KV_LORA_RANK):
            fail("out", f"shape {(total, heads, KV_LORA_RANK)} ([total_q_tokens, num_heads, 512])", tuple(out.shape))
    if lse is not None:
        check_tensor("lse", lse, 2, torch.float32, first.device)
        if tuple(lse.shape) != (heads, total):
            fail("lse", f"shape {(heads, total)} ([num_heads, total_q_tokens])", tuple(lse.shape))
    given = [(name, t) for name, t in (("out", out), ("lse", lse)) if t is not None]
    qs = (("q_nope", q[0]), ("q_pe", q[1])) if isinstance(q, (tuple, list)) else (("q", q),)
    others = [*qs, ("query_start_loc", query_start_loc),
              *((n, t) for n, t in inputs if isinstance(t, torch.Tensor) and t.layout == torch.strided)]
    for i, (name, t) in enumerate(given):
        check_no_overlap(name, t)
        span = byte_span(t)
        for other_name, other in others + given[i + 1:]:
            o = byte_span(other) if other.device == t.device else None
            if span and o and span[0] < o[1] and o[0] < span[1]:
                fail(name, "memory of its own (it would overwrite an input or the other output)",
                     f"a tensor that shares memory with {other_name}")
    return total, heads


def check_batch(query_start_loc: torch.Tensor, block_table, seq_lens) -> int:
    """batch = len(query_start_loc) - 1, after checking that block_table [n, max_pages] and seq_lens [n],
    when both are dense tensors that agree on n, agree with it: a query_start_loc of the wrong length is
    named as such (check_cache names block_table or seq_lens when only one of them is off, or is not a
    tensor of its rank). Only compares sizes, so a traced (symbolic) size goes through."""
    batch = query_start_loc.shape[0] - 1
    if all(isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_nested for t in (block_table, seq_lens)) \
            and block_table.dim() == 2 and seq_lens.dim() == 1:
        n = seq_lens.shape[0]
        if block_table.shape[0] == n and n != batch:
            fail("query_start_loc", f"batch + 1 = {n + 1} entries (block_table and seq_lens have batch = {n} rows)",
                 f"{batch + 1} entries")
    return batch


def _debug_check(query_start_loc: torch.Tensor, total: int, max_q_len: int) -> None:
    loc = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(loc, loc[1:])]
    if loc[0] != 0 or loc[-1] > total or min(q_lens) < 0 or max(q_lens) > max_q_len:
        fail("query_start_loc", f"0 = query_start_loc[0] <= ... <= query_start_loc[-1] <= total_q_tokens = {total}, "
                                f"each request's q_len (the differences) at most max_q_len = {max_q_len}", loc)


def native_call(q, kv_cache, block_table, seq_lens, softmax_scale, query_start_loc, max_q_len: int, out, lse,
                k_scale, inputs=(), debug: bool = False):
    """The validated launch of a varlen step in the packed layout (validation.Call with query_start_loc:
    batch = len(query_start_loc) - 1 requests of max_q_len rows, q / out / lse strides of the packed
    tensors with batch stride 0). out / lse are allocated when None; inputs: (name, tensor) pairs of
    further tensors they must not overlap (a plan's workspace). MLAInputError names a bad argument;
    debug: query_start_loc is checked on the host first."""
    from .validation import Call, check_cache, check_layout, set_scale
    total, heads = _check(q, query_start_loc, max_q_len, out, lse, (("kv_cache", kv_cache), ("block_table", block_table),
                                                                   ("seq_lens", seq_lens), ("k_scale", k_scale), *inputs))
    if debug:
        _debug_check(query_start_loc, total, max_q_len)
    pair = isinstance(q, (tuple, list))
    q_nope, q_pe = (q[0], q[1]) if pair else (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])
    names = ("q_nope", "q_pe") if pair else ("q", "q")
    dtype, device = q_nope.dtype, q_nope.device
    batch = check_batch(query_start_loc, block_table, seq_lens)
    fp8 = check_cache(kv_cache, block_table, seq_lens, softmax_scale, k_scale, batch, dtype, device, names[0])
    if device.type != "cuda":
        fail(names[0], "a CUDA tensor", f"a tensor on {device}")
    if total:
        check_layout(names[0], q_nope, 8)
        check_layout(names[1], q_pe, 8)
        check_layout("kv_cache", kv_cache, 16 if fp8 else 8)
    if out is None:
        out = torch.empty(total, heads, KV_LORA_RANK, dtype=dtype, device=device)
    elif total:
        check_layout("out", out, 4)
    if lse is None:
        lse = torch.empty(heads, total, dtype=torch.float32, device=device)
    elif min(lse.stride(), default=0) < 0:
        fail("lse", "non-negative strides", f"strides {tuple(lse.stride())}")
    c = Call()
    c.batch, c.q_len, c.num_heads, c.page_size, c.dtype = batch, max_q_len, heads, kv_cache.shape[1], dtype
    c.device_index = device.index
    c.qn_ptr, c.qn_st = q_nope.data_ptr(), (0, q_nope.stride(0), q_nope.stride(1))
    c.qp_ptr, c.qp_st = q_pe.data_ptr(), (0, q_pe.stride(0), q_pe.stride(1))
    c.kv_ptr, c.kv_st = kv_cache.data_ptr(), kv_cache.stride()
    c.bt_ptr, c.bt_st, c.max_pages = block_table.data_ptr(), block_table.stride(0), block_table.shape[1]
    c.sl_ptr, c.scale, c.out, c.lse = seq_lens.data_ptr(), float(softmax_scale), out, lse
    c.kv_cache, c.block_table, c.seq_lens = kv_cache, block_table, seq_lens
    c.loc_ptr, c.total_q_tokens = query_start_loc.data_ptr(), total
    set_scale(c, kv_cache, k_scale)
    return c


def mla_decode_varlen(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      softmax_scale: float, *, query_start_loc: torch.Tensor, max_q_len: int,
                      num_kv_splits: int | None = None, max_seq_len: int | None = None,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None, k_scale=None,
                      debug: bool = False, fp8_mode: str = "exact"):
    """One MLA decode step with a different q_len per request (the varlen layout).

    Args:
      q: [total_q_tokens, num_heads, 576] bf16/fp16, request b's tokens at rows query_start_loc[b] ..
        query_start_loc[b + 1] - 1 in order; or the pair (q_nope [..., 512], q_pe [..., 64]).
      kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, max_seq_len, k_scale, fp8_mode: as in
        :func:`mla_variants.mla_decode` (seq_lens counts each request's keys including its new tokens).
      query_start_loc: [batch + 1] int32 on q's device, query_start_loc[0] = 0, non-decreasing, the last
        entry total_q_tokens; request b's q_len is query_start_loc[b + 1] - query_start_loc[b] (0 is
        legal: the request writes nothing).
      max_q_len: 1..8, at least every request's q_len (fixed per plan, as engines size their steps);
        each request's query j of q_len_b sees its first seq_len - (q_len_b - 1 - j) keys (causal,
        bottom-right aligned per request).
      out: optional [total_q_tokens, num_heads, 512] in q's dtype; lse: optional [num_heads,
        total_q_tokens] fp32 (natural log).
      debug: check query_start_loc on the host first (one synchronization) and raise MLAInputError
        for a malformed one; without it, tokens it does not place get NaN rows.
    Returns (out, lse) as above. Raises what mla_decode raises, and MLAInputError naming query_start_loc,
    max_q_len, q, out or lse for a malformed varlen argument.
    Math: as mla_decode per request (softmax attention over the request's cached latent rows).
    """
    from .api import run_validated
    from .validation import MAX_KV_SPLITS, apply_fp8_mode

    if debug is not False and debug is not True:
        fail("debug", "a bool", shown(debug))
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or not 1 <= max_seq_len <= 2**31 - 1):
        fail("max_seq_len", "None or an int from 1 to 2**31 - 1 (an upper bound of seq_lens)", shown(max_seq_len))
    if num_kv_splits is not None and (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
                                      or not 1 <= num_kv_splits <= MAX_KV_SPLITS):
        fail("num_kv_splits", f"an int from 1 to {MAX_KV_SPLITS}", shown(num_kv_splits))
    c = native_call(q, kv_cache, block_table, seq_lens, softmax_scale, query_start_loc, max_q_len, out, lse, k_scale,
                    debug=debug)
    apply_fp8_mode(c, fp8_mode)
    if c.total_q_tokens == 0:
        return c.out, c.lse
    run_validated(c, num_kv_splits, max_seq_len, debug)
    return c.out, c.lse


def mla_decode_varlen_reference(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                softmax_scale: float, *, query_start_loc: torch.Tensor,
                                dtype: torch.dtype = torch.float32, k_scale=None):
    """The fp32 reference of :func:`mla_decode_varlen`, one request at a time (mla_decode_reference on
    request b's q_len_b tokens), on any device. Returns (out [total_q_tokens, num_heads, 512], lse
    [num_heads, total_q_tokens]) in `dtype`. Raises MLAInputError (a ValueError) for a malformed q or
    query_start_loc, or seq_lens / block_table without one row per request, and what
    mla_decode_reference raises (naming request b's entries)."""
    from .fp8 import check_compute_dtype, is_integer_tensor
    from .reference import check_readable, check_softmax_scale, joined_q, mla_decode_reference

    packed = joined_q(q, "total_q_tokens, num_heads")
    if not isinstance(packed, torch.Tensor) or packed.dim() != 3:
        fail("q", "a tensor [total_q_tokens, num_heads, 576] (or the pair)", shown(q))
    check_readable("q", packed)
    if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1 \
            or not is_integer_tensor(query_start_loc) or query_start_loc.shape[0] < 2:
        fail("query_start_loc", "a 1-d integer tensor [batch + 1] with batch >= 1", shown(query_start_loc))
    check_readable("query_start_loc", query_start_loc)
    check_compute_dtype(dtype, MLAInputError)
    check_batch(query_start_loc, block_table, seq_lens)
    for name, t in (("seq_lens", seq_lens), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != query_start_loc.shape[0] - 1:
            fail(name, f"batch = len(query_start_loc) - 1 = {query_start_loc.shape[0] - 1} rows", shown(t))
    check_softmax_scale(softmax_scale)  # also when no request has a token
    loc = query_start_loc.tolist()
    if loc[0] != 0 or loc[-1] > packed.shape[0] or any(b < a for a, b in zip(loc, loc[1:])):
        fail("query_start_loc", f"at least 2 entries, 0 = first <= ... <= last <= total_q_tokens = {packed.shape[0]}", loc)
    total, heads = packed.shape[:2]
    out = torch.full((total, heads, KV_LORA_RANK), float("nan"), dtype=dtype, device=packed.device)
    lse = torch.full((heads, total), float("nan"), dtype=dtype, device=packed.device)  # tokens of no request
    for b, (lo, hi) in enumerate(zip(loc, loc[1:])):
        if hi == lo:
            continue
        try:
            o, l = mla_decode_reference(packed[lo:hi][None], kv_cache, block_table[b:b + 1], seq_lens[b:b + 1],
                                        softmax_scale, dtype=dtype, k_scale=k_scale)
        except ValueError as e:  # the reference saw request b alone, as request 0: name it as b
            msg = str(e).replace("seq_lens[0]", f"seq_lens[{b}]").replace("block_table[0", f"block_table[{b}")
            raise type(e)(msg) from e
        out[lo:hi] = o[0]
        lse[:, lo:hi] = l[0]
    return out, lse
