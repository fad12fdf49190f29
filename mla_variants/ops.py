"""mla_decode as PyTorch custom ops, for torch.compile (fullgraph) and torch.library.opcheck.

    torch.ops.mla_variants.mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits,
                                      k_scale=None, fp8_mode="exact") -> (out, lse)   # allocates out and lse
    torch.ops.mla_variants.mla_decode_out(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                          num_kv_splits, out, lse, k_scale=None, fp8_mode="exact") -> None
    torch.ops.mla_variants.mla_decode_varlen(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
                                             max_q_len, softmax_scale, num_kv_splits, k_scale=None,
                                             fp8_mode="exact") -> (out, lse)
                # q [total_q_tokens, num_heads, ...], out [total_q_tokens, num_heads, 512], lse [num_heads, total]

num_kv_splits = 0 means the default heuristic. k_scale is the float8_e4m3fn cache's dequantization scale as
a 1-element fp32 device tensor (cache value x k_scale = real value; required for an fp8 cache, None for
bf16/fp16); ops take it as a tensor only, which the kernel reads when it runs, so a compiled or captured
graph follows its value. fp8_mode ("exact" or "fast") picks the fp8 cache's math as in mla_decode; the
schema types it as a str, so torch refuses a non-string (RuntimeError naming it) before the op runs.
q_nope / q_pe may be views of one packed q
(``q[..., :512]``, ``q[..., 512:]``). Each op has a fake (meta) implementation, so compiled graphs see
the output shapes without running the kernel. The eager fast path is :func:`mla_variants.mla_decode`
(or :class:`mla_variants.MLADecodePlan`); the ops add the dispatcher's overhead.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import mla_decode as _mla_decode
from .varlen import check_batch, mla_decode_varlen as _mla_decode_varlen
from .fp8 import FP8_DTYPE
from .validation import KV_LORA_RANK, MAX_KV_SPLITS, MAX_Q_LEN, MAX_SOFTMAX_SCALE, MIN_SOFTMAX_SCALE, \
    SOFTMAX_SCALE_RANGE, check_cache_shape, check_tensor, fail, fp8_token, shown


def _tensor_scale(k_scale) -> None:
    # the op schema already types k_scale as Tensor?; a 0-d/1-element fp32 tensor is checked by mla_decode
    if k_scale is not None and not isinstance(k_scale, torch.Tensor):
        fail("k_scale", "None or a 1-element float32 tensor (the ops take the scale as a tensor)", shown(k_scale))


def _fake_check(q_nope, q_pe, kv_cache, k_scale, fp8_mode="exact", block_table=None, seq_lens=None,
                softmax_scale=None, num_kv_splits=None, batch=None) -> None:
    """What tracing can check without data, so that a traced graph fails where the eager call would:
    q's shapes and dtypes (q_len 1..8, num_heads >= 1), kv_cache's shape and dtype (q's, or
    float8_e4m3fn with bf16 q), block_table and seq_lens (int32, one row per request: `batch`, default
    q's), softmax_scale, num_kv_splits (0 = the heuristic), k_scale given exactly for fp8 caches, and
    fp8_mode."""
    if q_nope.dim() != 4 or q_nope.shape[-1] != KV_LORA_RANK or q_pe.dim() != 4 or q_pe.shape[-1] != 64 \
            or q_pe.shape[:3] != q_nope.shape[:3]:
        fail("q_nope/q_pe", "shapes [batch, q_len, num_heads, 512] and [batch, q_len, num_heads, 64]",
              f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    if q_nope.dtype not in (torch.bfloat16, torch.float16) or q_pe.dtype is not q_nope.dtype:
        fail("q_nope/q_pe", "one dtype, bf16 or fp16", f"{q_nope.dtype} and {q_pe.dtype}")
    if not 1 <= q_nope.shape[1] <= MAX_Q_LEN or q_nope.shape[2] < 1:
        fail("q_nope", f"q_len (dim 1) from 1 to {MAX_Q_LEN} and num_heads (dim 2) >= 1", f"shape {tuple(q_nope.shape)}")
    check_tensor("kv_cache", kv_cache, 3, (q_nope.dtype, FP8_DTYPE) if q_nope.dtype is torch.bfloat16 else q_nope.dtype)
    check_cache_shape(kv_cache)
    batch = q_nope.shape[0] if batch is None else batch
    if block_table is not None:
        check_tensor("block_table", block_table, 2, torch.int32)
        if block_table.shape[0] != batch or block_table.shape[1] < 1:
            fail("block_table", f"shape [batch={batch}, max_pages_per_seq >= 1]", f"shape {tuple(block_table.shape)}")
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, 1, torch.int32)
        if seq_lens.shape[0] != batch:
            fail("seq_lens", f"shape [batch={batch}]", f"shape {tuple(seq_lens.shape)}")
    # The schema makes it a float (a SymFloat while tracing, which softmax_scale_ok's isinstance would refuse).
    if softmax_scale is not None and not MIN_SOFTMAX_SCALE <= softmax_scale <= MAX_SOFTMAX_SCALE:
        fail("softmax_scale", SOFTMAX_SCALE_RANGE, shown(softmax_scale))
    if num_kv_splits is not None and not 0 <= num_kv_splits <= MAX_KV_SPLITS:
        fail("num_kv_splits", f"0 (the heuristic) or an int from 1 to {MAX_KV_SPLITS}", shown(num_kv_splits))
    if (kv_cache.dtype is FP8_DTYPE) != (k_scale is not None):
        fail("k_scale", "a 1-element float32 tensor for a float8_e4m3fn kv_cache, None for bf16/fp16",
              f"{'None' if k_scale is None else 'a tensor'} with a {kv_cache.dtype} kv_cache")
    if k_scale is not None and (k_scale.numel() != 1 or k_scale.dtype is not torch.float32):
        fail("k_scale", "a 1-element float32 tensor", f"a {k_scale.dtype} tensor of shape {tuple(k_scale.shape)}")
    fp8_token(fp8_mode, kv_cache.dtype)


@torch.library.custom_op("mla_variants::mla_decode", mutates_args=(), device_types="cuda")
def mla_decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, softmax_scale: float, num_kv_splits: int,
                  k_scale: Optional[torch.Tensor] = None, fp8_mode: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """mla_variants.mla_decode as an op: q_nope [batch, q_len, num_heads, 512] and q_pe [.., 64] (bf16/fp16,
    CUDA), kv_cache [num_pages, page_size, 576], block_table [batch, max_pages] int32, seq_lens [batch]
    int32; num_kv_splits 0 = heuristic; k_scale None, or for a float8_e4m3fn cache (bf16 q) its scale as a
    1-element fp32 tensor on the cache's device; fp8_mode "exact" or "fast" (fp8 caches; as mla_decode).
    Returns out [batch, q_len, num_heads, 512] (q's dtype) and lse
    [batch, num_heads, q_len] fp32 (natural log). Raises what mla_decode raises; CPU tensors have no
    kernel (NotImplementedError from the dispatcher); a k_scale that is not a tensor is refused by the
    op's schema (RuntimeError from torch, naming k_scale) before this function runs."""
    _tensor_scale(k_scale)
    return _mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale,
                       num_kv_splits=num_kv_splits or None, k_scale=k_scale, fp8_mode=fp8_mode)


@mla_decode_op.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, k_scale=None, fp8_mode="exact"):
    _fake_check(q_nope, q_pe, kv_cache, k_scale, fp8_mode, block_table, seq_lens, softmax_scale, num_kv_splits)
    batch, q_len, num_heads, _ = q_nope.shape
    return (q_nope.new_empty((batch, q_len, num_heads, KV_LORA_RANK)),
            q_nope.new_empty((batch, num_heads, q_len), dtype=torch.float32))


@torch.library.custom_op("mla_variants::mla_decode_out", mutates_args=("out", "lse"), device_types="cuda")
def mla_decode_out_op(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, softmax_scale: float, num_kv_splits: int, out: torch.Tensor,
                      lse: torch.Tensor, k_scale: Optional[torch.Tensor] = None, fp8_mode: str = "exact") -> None:
    """The in-place form of mla_decode_op: writes the preallocated out [batch, q_len, num_heads, 512]
    and lse [batch, num_heads, q_len] fp32 and returns nothing."""
    _tensor_scale(k_scale)
    _mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale,
                num_kv_splits=num_kv_splits or None, out=out, lse=lse, k_scale=k_scale, fp8_mode=fp8_mode)


@mla_decode_out_op.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse, k_scale=None,
      fp8_mode="exact"):
    _fake_check(q_nope, q_pe, kv_cache, k_scale, fp8_mode, block_table, seq_lens, softmax_scale, num_kv_splits)
    batch, q_len, num_heads, _ = q_nope.shape
    check_tensor("out", out, 4, q_nope.dtype)
    if tuple(out.shape) != (batch, q_len, num_heads, KV_LORA_RANK):
        fail("out", f"shape {(batch, q_len, num_heads, KV_LORA_RANK)}", f"shape {tuple(out.shape)}")
    check_tensor("lse", lse, 3, torch.float32)
    if tuple(lse.shape) != (batch, num_heads, q_len):
        fail("lse", f"shape {(batch, num_heads, q_len)}", f"shape {tuple(lse.shape)}")
    return None


@torch.library.custom_op("mla_variants::mla_decode_varlen", mutates_args=(), device_types="cuda")
def mla_decode_varlen_op(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_q_len: int, softmax_scale: float,
                         num_kv_splits: int, k_scale: Optional[torch.Tensor] = None,
                         fp8_mode: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """mla_variants.mla_decode_varlen as an op: q_nope [total_q_tokens, num_heads, 512] and q_pe [.., 64],
    query_start_loc [batch + 1] int32, max_q_len 1..8, the rest as mla_decode_op. Returns out
    [total_q_tokens, num_heads, 512] (q's dtype) and lse [num_heads, total_q_tokens] fp32."""
    _tensor_scale(k_scale)
    return _mla_decode_varlen((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale,
                              query_start_loc=query_start_loc, max_q_len=max_q_len,
                              num_kv_splits=num_kv_splits or None, k_scale=k_scale, fp8_mode=fp8_mode)


@mla_decode_varlen_op.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_q_len, softmax_scale, num_kv_splits,
      k_scale=None, fp8_mode="exact"):
    if q_nope.dim() != 3 or q_nope.shape[-1] != KV_LORA_RANK or q_pe.dim() != 3 or q_pe.shape[-1] != 64 \
            or q_pe.shape[:2] != q_nope.shape[:2]:
        fail("q_nope/q_pe", "shapes [total_q_tokens, num_heads, 512] and [total_q_tokens, num_heads, 64]",
             f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.dtype is not torch.int32 or query_start_loc.shape[0] < 2:
        fail("query_start_loc", "a 1-d int32 tensor [batch + 1] with batch >= 1",
             f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    _fake_check(q_nope[:, None], q_pe[:, None], kv_cache, k_scale,  # one token a row: q_len 1
                block_table=block_table, seq_lens=seq_lens, softmax_scale=softmax_scale, num_kv_splits=num_kv_splits,
                batch=check_batch(query_start_loc, block_table, seq_lens))
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or not 1 <= max_q_len <= MAX_Q_LEN:
        fail("max_q_len", f"an int from 1 to {MAX_Q_LEN}", max_q_len)
    fp8_token(fp8_mode, kv_cache.dtype)  # last, as the eager call checks it
    total, num_heads, _ = q_nope.shape
    return (q_nope.new_empty((total, num_heads, KV_LORA_RANK)),
            q_nope.new_empty((num_heads, total), dtype=torch.float32))
