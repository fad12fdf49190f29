"""Writing and reading an fp8 (e4m3) latent KV cache, the way serving engines write theirs.

Scale convention (one per-tensor scale, as engines keep per layer): a stored value times `k_scale`
is the real value, i.e. ``real = float(cache) * k_scale`` and ``cache = saturate(real / k_scale)``,
rounded to nearest even and clamped to the e4m3 range +-448 (finite inputs never become NaN). The
same scale applies to both the score side (K, all 576 values) and the value side (V, the first 512).
The NaN byte of e4m3fn is 0x7F (tests poison unused slots with it).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_NAN_BYTE = 0x7F


# fp32's normal range: the scale is applied in fp32, where a smaller value is a subnormal or 0 and a
# larger one overflows (mla_decode's k_scale takes the same range, less its 2^-8 q prescale margin).
FP32_TINY = torch.finfo(torch.float32).tiny   # 1.18e-38
FP32_MAX = torch.finfo(torch.float32).max     # 3.4e38


def _check_scale(k_scale) -> float:
    if isinstance(k_scale, (bool, str, bytes)):
        raise ValueError(f"k_scale: expected a positive finite float or a 1-element tensor, got {k_scale!r}")
    try:
        scale = float(k_scale)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"k_scale: expected a positive finite float or a 1-element tensor, got {k_scale!r}") from None
    if not FP32_TINY <= scale <= FP32_MAX:
        raise ValueError(f"k_scale: expected a positive float in fp32's normal range [{FP32_TINY:.3g}, "
                         f"{FP32_MAX:.3g}] (it is applied in fp32), got {scale!r}")
    return scale


def is_integer_tensor(t: torch.Tensor) -> bool:
    """Whether t holds integers (not float, complex or bool): block tables, lengths, positions."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype is torch.bool)


def check_dense(error=ValueError, **named) -> None:
    """`error` naming the first argument that is not a dense tensor with data (a non-tensor, a sparse,
    nested or meta tensor); the helpers here raise ValueError, the references MLAInputError."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise error(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            raise error(f"{name}: expected a dense tensor with data, got a {'nested' if t.is_nested else t.layout} "
                        f"tensor on {t.device}")


def check_compute_dtype(dtype, error=ValueError) -> None:
    """`error` unless dtype is a float torch.dtype of 16 bits or more (what dequantize_kv and the
    references compute in)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise error(f"dtype: expected a float torch.dtype of 16 bits or more, got {dtype!r}")


def quantize_kv(real: torch.Tensor, k_scale) -> torch.Tensor:
    """Quantize real KV values (any float dtype, any shape) to float8_e4m3fn with ``cache = real / k_scale``,
    rounded to nearest and clamped to +-448 (e4m3fn, "FP8 Formats for Deep Learning", arXiv:2209.05433);
    NaN stays NaN. Returns the same shape. Raises ValueError for a non-tensor `real` or a non-positive or
    non-finite k_scale."""
    check_dense(real=real)
    scale = _check_scale(k_scale)
    return (real.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, k_scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values of an fp8 cache (any shape): ``cache * k_scale`` in `dtype`, same shape.

    Raises ValueError if cache is not a float8_e4m3fn tensor, k_scale is missing, non-positive or not
    finite, or dtype is not a float torch.dtype."""
    check_dense(cache=cache)
    check_compute_dtype(dtype)
    if cache.dtype != FP8_DTYPE:
        raise ValueError(f"cache: expected dtype {FP8_DTYPE}, got {cache.dtype}")
    if k_scale is None:
        raise ValueError("k_scale: required for a float8_e4m3fn cache (cache value x k_scale = real value)")
    return cache.to(dtype) * _check_scale(k_scale)


def write_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, new_kv: torch.Tensor, k_scale=None) -> None:
    """Append tokens to a paged cache in place: token t goes to flat slot ``slot_mapping[t]`` =
    page_id * page_size + offset (the slot mapping vLLM and SGLang build from block_table).

    kv_cache: [num_pages, page_size, 576], bf16/fp16 or float8_e4m3fn (then `k_scale` is required).
    slot_mapping: [num_tokens] int32/int64, each in [0, num_pages * page_size); negative entries are skipped
    (padding tokens). new_kv: [num_tokens, 576] real values. The cache may be a strided view (e.g. one
    layer of a larger buffer).
    Raises ValueError naming the argument for wrong shapes, dtypes or slots, a missing k_scale for an
    fp8 cache, or a k_scale given for a bf16/fp16 cache."""
    check_dense(kv_cache=kv_cache, slot_mapping=slot_mapping, new_kv=new_kv)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != 576:
        raise ValueError(f"kv_cache: expected shape [num_pages, page_size, 576], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        raise ValueError(f"kv_cache: expected dtype bf16, fp16 or {FP8_DTYPE} (the caches mla_decode reads), "
                         f"got {kv_cache.dtype}")
    if new_kv.dim() != 2 or new_kv.shape[-1] != 576:
        raise ValueError(f"new_kv: expected shape [num_tokens, 576], got {tuple(new_kv.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != new_kv.shape[0] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected int32/int64 of shape [{new_kv.shape[0]}] (one slot per row of "
                         f"new_kv), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= num_pages * page_size:
        raise ValueError(f"slot_mapping: expected slots below num_pages * page_size = {num_pages * page_size}, "
                         f"got {int(slots.max())}")
    rows = new_kv[keep]
    if kv_cache.dtype == FP8_DTYPE:
        if k_scale is None:
            raise ValueError("k_scale: required for a float8_e4m3fn cache (cache value x k_scale = real value)")
        rows = quantize_kv(rows, k_scale)
    elif k_scale is not None:
        raise ValueError(f"k_scale: only for a float8_e4m3fn cache; this cache is {kv_cache.dtype}")
    kv_cache[slots // page_size, slots % page_size] = rows.to(kv_cache.dtype)  # works on strided views too


def slot_mapping_for(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slots of token `positions[b]` of each request b: block_table[b, pos // page_size] * page_size
    + pos % page_size, as int64 [batch]; positions < 0 map to -1 (skipped by write_kv_cache).
    block_table: [batch, max_pages] integer; positions: [batch] integer. Raises ValueError for a position
    past the table's width, positions of another shape, a position whose page entry is negative (an
    unallocated page: its token would otherwise be dropped), arguments that are not integer tensors, and
    a page_size outside 1..2**20."""
    check_dense(block_table=block_table, positions=positions)
    if block_table.dim() != 2 or block_table.shape[1] < 1 or not is_integer_tensor(block_table):
        raise ValueError(f"block_table: expected an integer tensor of shape [batch, max_pages >= 1], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if positions.dim() != 1 or positions.shape[0] != block_table.shape[0] or not is_integer_tensor(positions):
        raise ValueError(f"positions: expected an integer tensor of shape [batch={block_table.shape[0]}] (one per "
                         f"block_table row), got {positions.dtype} {tuple(positions.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 2**20:
        raise ValueError(f"page_size: expected an int from 1 to 2**20, got {page_size!r}")
    pos = positions.long()
    capacity = block_table.shape[1] * page_size
    if pos.numel() and int(pos.max()) >= capacity:
        b = int(pos.argmax())
        raise ValueError(f"positions: expected positions below max_pages * page_size = {capacity} (the table's "
                         f"width), got {int(pos[b])} for request {b}")
    col = pos.clamp_min(0) // page_size
    page = block_table.gather(1, col[:, None]).squeeze(1).long()
    unallocated = (pos >= 0) & (page < 0)
    if bool(unallocated.any()):
        b = int(unallocated.nonzero()[0, 0])
        raise ValueError(f"block_table: expected a page id >= 0 for position {int(pos[b])} of request {b}, "
                         f"got block_table[{b}, {int(col[b])}] = {int(page[b])} (an unallocated page)")
    return torch.where(pos >= 0, page * page_size + pos.clamp_min(0) % page_size, torch.full_like(pos, -1))
