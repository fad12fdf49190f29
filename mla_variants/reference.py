"""A plain PyTorch reference for MLA decode, in fp32 (or any float dtype), for tests and examples."""
from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, check_compute_dtype, check_dense, dequantize_kv, is_integer_tensor
from .validation import HEAD_DIM, KV_LORA_RANK, SOFTMAX_SCALE_RANGE, MLAInputError, softmax_scale_ok


def check_readable(name: str, t: torch.Tensor) -> None:
    """MLAInputError unless t is a dense tensor with data (the references index and read it)."""
    check_dense(MLAInputError, **{name: t})


def joined_q(q, lead: str):
    """q itself, or the pair (q_nope [*lead, 512], q_pe [*lead, 64]) joined along the last dimension after
    checking that it fits together (tensors with data, one dtype and device, equal leading shapes); `lead`
    names the leading dimensions in the message (e.g. "batch, q_len, num_heads")."""
    if not isinstance(q, (tuple, list)):
        return q
    if len(q) != 2 or not all(isinstance(t, torch.Tensor) for t in q):
        raise MLAInputError(f"q: expected a tensor or the pair (q_nope, q_pe) of tensors, got {type(q).__name__} "
                             f"of {len(q)}")
    q_nope, q_pe = q
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        check_readable(name, t)
    rank = lead.count(",") + 2
    if q_nope.dim() != rank or q_pe.dim() != rank or q_nope.shape[-1] != KV_LORA_RANK \
            or q_pe.shape[-1] != HEAD_DIM - KV_LORA_RANK or q_nope.shape[:-1] != q_pe.shape[:-1] \
            or q_nope.dtype != q_pe.dtype or q_nope.device != q_pe.device:
        raise MLAInputError(f"q: expected q_nope [{lead}, {KV_LORA_RANK}] and q_pe [{lead}, {HEAD_DIM - KV_LORA_RANK}] "
                             f"of one dtype and device, got {q_nope.dtype} {tuple(q_nope.shape)} on {q_nope.device} "
                             f"and {q_pe.dtype} {tuple(q_pe.shape)} on {q_pe.device}")
    return torch.cat([q_nope, q_pe], dim=-1)


def check_softmax_scale(softmax_scale) -> None:
    """MLAInputError unless softmax_scale passes mla_decode's rule (validation.softmax_scale_ok)."""
    if not softmax_scale_ok(softmax_scale):
        raise MLAInputError(f"softmax_scale: expected {SOFTMAX_SCALE_RANGE} (as mla_decode), got {softmax_scale!r}")


def mla_decode_reference(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         softmax_scale: float, dtype: torch.dtype = torch.float32, k_scale=None):
    """Dense softmax attention per request over the gathered pages, computed in `dtype`.

    Same arguments as :func:`mla_variants.mla_decode` (q may be the pair (q_nope, q_pe)); runs on any
    device. A float8_e4m3fn cache is dequantized first with `k_scale` (cache value x k_scale = real
    value; see mla_variants.fp8). Returns (out [batch, q_len, num_heads, 512], lse [batch, num_heads, q_len]) in `dtype`;
    a query that sees no key gets out 0 and lse -inf. Causal for q_len > 1, bottom-right aligned.
    Math: lse = logsumexp_j(s_j), out = sum_j softmax(s)_j v_j with s_j = softmax_scale * q.k_j
    (scaled dot-product attention, "Attention Is All You Need", arXiv:1706.03762, over the MLA latent
    cache of DeepSeek-V2, arXiv:2405.04434).
    Raises MLAInputError (a ValueError) where the kernel would give NaN rows instead (a seq_len below 0 or beyond
    max_pages_per_seq * page_size, a used block_table entry outside [0, num_pages)), and, as mla_decode
    does, for an fp8 cache without k_scale or a k_scale given with a bf16/fp16 cache, a softmax_scale
    outside mla_decode's range (1.18e-38 to 1e30), or shapes and dtypes of q,
    kv_cache, block_table and seq_lens that do not fit together (dense tensors with data; q, or q_nope and
    q_pe of one dtype, and kv_cache float, on one device, rows of 576; integer block_table and seq_lens,
    one seq_len per request), and a `dtype` that is not a float dtype of 16 bits or more.
    """
    q = joined_q(q, "batch, q_len, num_heads")
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise MLAInputError(f"{name}: expected a tensor, got {type(t).__name__}")
        check_readable(name, t)
    check_compute_dtype(dtype, MLAInputError)
    if not q.is_floating_point():
        raise MLAInputError(f"q: expected a float dtype, got {q.dtype}")
    if not (kv_cache.is_floating_point() or kv_cache.dtype == FP8_DTYPE):
        raise MLAInputError(f"kv_cache: expected a float dtype or float8_e4m3fn, got {kv_cache.dtype}")
    if kv_cache.device != q.device:
        raise MLAInputError(f"kv_cache: expected a tensor on q's device {q.device}, got {kv_cache.device}")
    if k_scale is not None and kv_cache.dtype != FP8_DTYPE:
        raise MLAInputError(f"k_scale: only for a float8_e4m3fn kv_cache; this cache is {kv_cache.dtype}")
    if kv_cache.dtype == FP8_DTYPE and k_scale is None:
        raise MLAInputError("k_scale: required for a float8_e4m3fn cache (cache value x k_scale = real value)")
    if q.dim() != 4 or kv_cache.dim() != 3 or q.shape[-1] != HEAD_DIM or kv_cache.shape[-1] != HEAD_DIM:
        raise MLAInputError(f"q/kv_cache: expected q [batch, q_len, num_heads, {HEAD_DIM}] and kv_cache [num_pages, "
                             f"page_size, {HEAD_DIM}], got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or not is_integer_tensor(block_table):
        raise MLAInputError(f"block_table: expected an integer tensor of shape [batch={q.shape[0]}, max_pages], "
                             f"got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != q.shape[0] or not is_integer_tensor(seq_lens):
        raise MLAInputError(f"seq_lens: expected an integer tensor of shape [batch={q.shape[0]}], "
                             f"got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    check_softmax_scale(softmax_scale)
    batch, q_len, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros(batch, q_len, num_heads, KV_LORA_RANK, dtype=dtype, device=q.device)
    lse = torch.full((batch, num_heads, q_len), float("-inf"), dtype=dtype, device=q.device)
    lens = seq_lens.tolist()
    num_pages, capacity = kv_cache.shape[0], block_table.shape[1] * page_size
    for b in range(batch):
        n = int(lens[b])
        if n < 0 or n > capacity:
            raise MLAInputError(f"seq_lens[{b}]: expected 0..{capacity} (max_pages_per_seq * page_size), got {n}")
        if n == 0:
            continue
        pages = block_table[b, : (n + page_size - 1) // page_size].long()
        if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
            raise MLAInputError(f"block_table[{b}]: expected page ids in [0, {num_pages}), got {pages.tolist()}")
        kv = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:n]
        kv = dequantize_kv(kv, k_scale, dtype) if kv.dtype == FP8_DTYPE else kv.to(dtype)  # [n, 576]
        s = torch.einsum("qhd,nd->qhn", q[b].to(dtype), kv) * softmax_scale     # [q_len, heads, n]
        visible = n - (q_len - 1 - torch.arange(q_len, device=q.device))         # keys each query sees
        mask = torch.arange(n, device=q.device)[None, :] < visible[:, None]      # [q_len, n]
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        has_key = visible > 0
        row_max = s.amax(dim=-1, keepdim=True).masked_fill(~has_key[:, None, None], 0.0)
        e = torch.exp(s - row_max)                                                # 0 where masked
        total = e.sum(dim=-1, keepdim=True)
        # normalise by the sum, not by exp(lse): at |s| ~ 1e30, lse - max rounds to 0 in fp32
        p = torch.where(has_key[:, None, None], e / total.clamp_min(torch.finfo(dtype).tiny), torch.zeros_like(s))
        row_lse = (row_max + torch.log(total)).squeeze(-1)                        # [q_len, heads]
        out[b] = torch.einsum("qhn,nd->qhd", p, kv[:, :KV_LORA_RANK])
        lse[b] = torch.where(has_key[:, None], row_lse, torch.full_like(row_lse, float("-inf"))).transpose(0, 1)
    return out, lse
