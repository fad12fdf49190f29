"""CPU model of the kernels' varlen placement (params.cuh query_row and combine.cuh's fill kernel):
a varlen step as a padded uniform batch, each request's q_len_b tokens scattered into the last q_len_b
of its max_q_len rows, any uniform decode (the fp32 reference in tests/test_varlen.py), and the real
rows gathered back; tokens no well-placed request owns get NaN. The product's mla_decode_varlen runs
the same placement inside the kernels; this model lets the CPU tests check the placement, the causal
bounds and the NaN contract against the per-request reference."""
from __future__ import annotations

import torch

from mla_variants.validation import HEAD_DIM, KV_LORA_RANK, check_tensor, fail
from mla_variants.varlen import _check


def padded_index(query_start_loc: torch.Tensor, total_q_tokens: int, max_q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, valid): for each packed token t, its row dst[t] in the padded [batch * max_q_len] layout
    (request b's q_len_b tokens at its last q_len_b rows), and whether t is valid: query_start_loc is
    well formed and places t in a request of at most max_q_len tokens (else dst[t] is 0). Device tensors, no host
    synchronization. query_start_loc: [batch + 1] int32."""
    loc = query_start_loc.to(torch.int64)
    t = torch.arange(total_q_tokens, device=loc.device, dtype=torch.int64)
    batch = loc.shape[0] - 1
    b = torch.searchsorted(loc[1:].contiguous(), t, right=True)  # requests that end at or before t
    bc = b.clamp_max(batch - 1)
    start, q_len = loc[bc], loc[bc + 1] - loc[bc]
    pos = t - start
    # A query_start_loc that is not 0 = first <= ... <= last <= total makes every token invalid (no
    # single request's rows can be trusted then); a request longer than max_q_len only its own, and
    # tokens past the last request (an engine's padding of total_q_tokens) only themselves.
    whole = (loc[0] == 0) & (loc[-1] <= total_q_tokens) & (loc[1:] >= loc[:-1]).all()
    valid = whole & (b < batch) & (pos >= 0) & (pos < q_len) & (q_len <= max_q_len)
    dst = bc * max_q_len + (max_q_len - q_len) + pos
    return torch.where(valid, dst, torch.zeros_like(dst)), valid


def run_padded(decode, q, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_q_len: int, out=None,
               lse=None, buffers=None, inputs=()):
    """The varlen call through `decode(q_pad, seq_lens, out_pad, lse_pad)` (mla_decode, MLADecodePlan.run
    or the reference, on q_pad [batch, max_q_len, num_heads, 576]; out_pad / lse_pad None, or the
    uniform outputs to write) on the padded uniform batch (module docstring). buffers: None (q_pad
    allocated here, the outputs by decode), or (q_pad [>= batch * max_q_len, num_heads, 576], out_pad
    [>= batch, max_q_len, num_heads, 512], lse_pad [>= batch, num_heads, max_q_len] fp32). Returns (out
    [total_q_tokens, num_heads, 512], lse [num_heads, total_q_tokens] fp32). inputs: the call's other
    tensors (kv_cache, block_table, k_scale), which out and lse must not overlap."""
    total, heads = _check(q, query_start_loc, max_q_len, out, lse, inputs)
    first = q[0] if isinstance(q, (tuple, list)) else q
    batch = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, 1, torch.int32, first.device)
    if seq_lens.shape[0] != batch:
        fail("seq_lens", f"[batch = len(query_start_loc) - 1 = {batch}] int32", f"shape {tuple(seq_lens.shape)}")
    dst, valid = padded_index(query_start_loc, total, max_q_len)
    rows = batch * max_q_len
    if buffers is None:
        q_pad = torch.zeros(rows, heads, HEAD_DIM, dtype=first.dtype, device=first.device)
        out_pad = lse_pad = None
    else:
        q_pad, out_pad, lse_pad = buffers[0][:rows], buffers[1][:batch], buffers[2][:batch]
        q_pad.zero_()
    packed = torch.cat([q[0], q[1]], dim=-1) if isinstance(q, (tuple, list)) else q
    # Tokens that are not valid land on row 0 as zeros (dropping them instead would need their count
    # on the host).
    q_pad.index_put_((dst,), packed.masked_fill(~valid[:, None, None], 0), accumulate=True)
    out_pad, lse_pad = decode(q_pad.view(batch, max_q_len, heads, HEAD_DIM), seq_lens, out_pad, lse_pad)
    # Gathered straight into out / lse (index_select's out=), then the invalid tokens' rows set to NaN
    # with a Python scalar (no host-to-device copy, so the call stays capturable).
    flat_out = out_pad.reshape(rows, heads, KV_LORA_RANK)
    if out is None or out.dtype != flat_out.dtype or not out.is_contiguous():
        got = flat_out.index_select(0, dst)
        out = got.to(first.dtype) if out is None else out.copy_(got)
    else:
        torch.index_select(flat_out, 0, dst, out=out)
    out.masked_fill_(~valid[:, None, None], float("nan"))
    got_lse = lse_pad.float().transpose(0, 1).reshape(heads, rows).index_select(1, dst)  # [heads, total]: small
    lse = got_lse if lse is None else lse.copy_(got_lse)
    lse.masked_fill_(~valid[None, :], float("nan"))
    return out, lse
