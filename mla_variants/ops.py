"""mla_decode as PyTorch custom ops, for torch.compile (fullgraph) and torch.library.opcheck.

    torch.ops.mla_variants.mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits)
        -> (out, lse)                                   # functional: allocates out and lse
    torch.ops.mla_variants.mla_decode_out(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                          num_kv_splits, out, lse) -> None   # writes the preallocated out / lse

num_kv_splits = 0 means the default heuristic. q_nope / q_pe may be views of one packed q
(``q[..., :512]``, ``q[..., 512:]``). Each op has a fake (meta) implementation, so compiled graphs see
the output shapes without running the kernel. The eager fast path is :func:`mla_variants.mla_decode`
(or :class:`mla_variants.MLADecodePlan`); the ops add the dispatcher's overhead.
"""
from __future__ import annotations

import torch

from .api import FP8_DTYPE, KV_LORA_RANK, _fail, mla_decode as _mla_decode


def _no_fp8(kv_cache) -> None:
    if kv_cache.dtype is FP8_DTYPE:
        _fail("kv_cache", "bf16 or fp16 (the torch.library ops take no k_scale yet; call mla_decode(..., k_scale=) "
                          "for a float8_e4m3fn cache)", kv_cache.dtype)


def _fake_check(q_nope, q_pe) -> None:
    if q_nope.dim() != 4 or q_nope.shape[-1] != KV_LORA_RANK or q_pe.dim() != 4 or q_pe.shape[-1] != 64 \
            or q_pe.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_nope/q_pe: expected [batch, q_len, num_heads, 512] and [.., 64], "
                         f"got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")


@torch.library.custom_op("mla_variants::mla_decode", mutates_args=(), device_types="cuda")
def mla_decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, softmax_scale: float, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_variants.mla_decode as an op: q_nope [batch, q_len, num_heads, 512] and q_pe [.., 64] (bf16/fp16,
    CUDA), kv_cache [num_pages, page_size, 576], block_table [batch, max_pages] int32, seq_lens [batch]
    int32; num_kv_splits 0 = heuristic. Returns out [batch, q_len, num_heads, 512] (q's dtype) and lse
    [batch, num_heads, q_len] fp32 (natural log). Raises what mla_decode raises; CPU tensors have no
    kernel (NotImplementedError from the dispatcher)."""
    _no_fp8(kv_cache)
    return _mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale,
                       num_kv_splits=num_kv_splits or None)


@mla_decode_op.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits):
    _fake_check(q_nope, q_pe)
    batch, q_len, num_heads, _ = q_nope.shape
    return (q_nope.new_empty((batch, q_len, num_heads, KV_LORA_RANK)),
            q_nope.new_empty((batch, num_heads, q_len), dtype=torch.float32))


@torch.library.custom_op("mla_variants::mla_decode_out", mutates_args=("out", "lse"), device_types="cuda")
def mla_decode_out_op(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, softmax_scale: float, num_kv_splits: int, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """The in-place form of mla_decode_op: writes the preallocated out [batch, q_len, num_heads, 512]
    and lse [batch, num_heads, q_len] fp32 and returns nothing."""
    _no_fp8(kv_cache)
    _mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale,
                num_kv_splits=num_kv_splits or None, out=out, lse=lse)


@mla_decode_out_op.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse):
    _fake_check(q_nope, q_pe)
    return None
