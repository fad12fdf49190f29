"""mla_decode: one MLA decode step over a paged latent KV cache, dispatched to a compiled variant.

Math: for each request b, query token i and head h, with keys j < seq_lens[b] - (q_len - 1 - i)
(causal, bottom-right aligned; all keys when q_len == 1):
    s_j   = softmax_scale * <q[b, i, h, :576], kv[j, :576]>
    lse   = log(sum_j exp(s_j))                       (natural log; -inf when no key is visible)
    out   = sum_j exp(s_j - lse) * kv[j, :512]        (0 when no key is visible)
which is multi-head latent attention with the absorbed up-projections (DeepSeek-V2, arXiv:2405.04434,
section 2.1) computed with the online softmax of FlashAttention-2 (arXiv:2307.08691) and split-KV
log-sum-exp merging (flash-decoding).
"""
from __future__ import annotations

import math
import numbers
from functools import lru_cache

import torch

from . import _binding
from .dispatch import VariantNotCompiledError
from .dispatch import is_supported as _table_supports
from .fp8 import FP8_DTYPE, FP32_MAX as _FLT_MAX, FP32_TINY as _FLT_MIN

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
MAX_Q_LEN = 8
MAX_KV_SPLITS = 256
HEURISTIC_MAX_SPLITS = 64  # default_num_kv_splits never picks more (measured, docs/perf-notes.md)
BLOCK_N = 64  # keys per kernel tile; a split covers whole tiles
BLOCK_M = 64  # query rows per CTA of the 64-row kernel path
# Variants with at most this many heads run the transposed kernel path (MLA_ST, MLA_ST32), which
# gathers with cp.async only (no TMA) and runs no balanced schedule: 16-bit caches, fp8 caches.
ST_MAX_HEADS = 32
ST_MAX_HEADS_FP8 = 32  # fp8 at 17..32 heads: the register path with 32 rows, two math warpgroups


def _uses_st(num_heads: int, fp8: bool = False) -> bool:
    """Whether a variant of num_heads heads runs the transposed path in the default build
    (templates/mla/constants.cuh kUseSt); fp8: an fp8_e4m3 cache."""
    return num_heads <= (ST_MAX_HEADS_FP8 if fp8 else ST_MAX_HEADS)


def _rows_per_cta(num_heads: int, fp8: bool = False) -> int:
    """Query rows (q_len x heads) one CTA covers (constants.cuh kRowBlock): the transposed path takes
    blocks of 8 rows for up to 8 heads, 16 for 9..16 and 32 for 17..32; the 64-row
    path BLOCK_M. Estimated from the call's head count; a build with -DMLA_ST=0 (or -DMLA_ST32=0)
    launches 64-row blocks."""
    if not _uses_st(num_heads, fp8):
        return BLOCK_M
    return 8 if num_heads <= 8 else 16 if num_heads <= 16 else 32


ST32_MIN_KEYS = 1024  # constants.cuh MLA_ST32_MIN_KEYS: shorter splits of 17..32 heads run the 64-row kernel


def _split_keys(max_seq_len: int, num_kv_splits: int) -> int:
    """The most keys one split can get (launch.cuh short_split_keys): whole 64-key tiles per split."""
    tiles = -(-max_seq_len // BLOCK_N)
    return -(-tiles // num_kv_splits) * BLOCK_N


def _launch_rows(num_heads: int, fp8: bool, max_seq_len: int, num_kv_splits: int) -> int:
    """Query rows per CTA of the kernel a launch runs (launch.cuh): _rows_per_cta, except that a
    17..32-head 16-bit launch whose splits are all shorter than ST32_MIN_KEYS runs its 64-row kernel.
    max_seq_len: the bound the launcher sees (the caller's, at most the block table's capacity)."""
    rows = _rows_per_cta(num_heads, fp8)
    if rows == 32 and not fp8 and _split_keys(max_seq_len, num_kv_splits) < ST32_MIN_KEYS:
        return BLOCK_M
    return rows

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # q dtypes (and their caches' dtype token)
FP8_KEY = "fp8_e4m3"  # the variants.yaml dtype token of fp8 caches (q and out bf16)
_KEY_OF = {**_DTYPES, FP8_DTYPE: FP8_KEY}  # a torch dtype or token -> the dispatch key's dtype token
_MAX_SCALE = 1e30  # the kernel multiplies by scale * log2(e) in fp32
_K_SCALE_MAX = _FLT_MAX / 256  # k_scale travels as fp32 (fp8.FP32_TINY.._MAX); the fp8 kernel divides k_scale by its 2^-8 q prescale in fp32


class MLAInputError(ValueError):
    """A decode argument is wrong; the message names the argument, what was expected and what was given."""


def _fail(arg: str, expected: str, got) -> None:
    raise MLAInputError(f"{arg}: expected {expected}, got {got}")


def _shown(v) -> str:
    """repr(v) for an error message; an int too long for repr (Python refuses ints of more than 4300
    digits as text) is shown by its size, so the caller still gets MLAInputError, not ValueError."""
    try:
        return repr(v)
    except ValueError:
        return f"an int of {v.bit_length()} bits" if isinstance(v, int) else f"a {type(v).__name__}"


def workspace_size(batch: int, num_heads: int, q_len: int, num_kv_splits: int) -> int:
    """Bytes of split-KV workspace one call needs: num_kv_splits * batch * q_len * num_heads * (512 + 1)
    fp32 values, 4 bytes each (per split: the normalised partial output and its lse). 0 when
    num_kv_splits == 1. batch >= 0; num_heads, q_len, num_kv_splits >= 1 (ints).
    Raises MLAInputError naming the argument otherwise."""
    for name, v in (("batch", batch), ("num_heads", num_heads), ("q_len", q_len), ("num_kv_splits", num_kv_splits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "batch" else 1):
            _fail(name, "a non-negative int" if name == "batch" else "a positive int", _shown(v))
    if num_kv_splits == 1:
        return 0
    return num_kv_splits * batch * q_len * num_heads * (KV_LORA_RANK + 1) * 4


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_kv_splits(batch: int, num_heads: int, q_len: int, max_seq_len: int, num_sms: int, *,
                          fp8: bool = False) -> int:
    """The split heuristic (flash-decoding's idea: split the keys when the batch alone cannot fill
    the GPU): split only when the unsplit grid leaves SMs idle.

    batch >= 0 requests, num_heads and q_len of the call, max_seq_len in tokens (the longest sequence
    the call may see; block_table's width times page_size when the caller gives nothing better),
    num_sms the GPU's multiprocessor count. The unsplit grid is estimated as
    batch * ceil(num_heads * q_len / rows) CTAs with rows = 64 query rows per CTA, or 32 for 17..32
    heads (with a 16-bit cache 64 again when the pieces this gives are shorter than 1024 keys, since
    such launches run the 64-row kernel; fp8=True, an fp8_e4m3 cache, keeps 32), 16 for
    9..16 heads and 8 for up to 8 (the kernel's transposed path), one CTA per SM at a time (a call served by
    a larger compiled head count launches the CTAs of that count). If that fills the SMs, return 1. Otherwise return as
    many pieces as fill the SMs once, at most ceil(max_seq_len / 64) // 2 (128 keys per piece for a
    request of max_seq_len: the two 64-key tiles one round of the kernel's two math warpgroups takes;
    shorter requests get shorter pieces, since the kernel cuts each request's own keys into this many
    equal runs of 64-key tiles), or ceil(max_seq_len / 64) for a single request (batch 1: one tile per
    piece, since its combine is small), and at most HEURISTIC_MAX_SPLITS (64: beyond it the combine
    costs more than the finer split saves); never less than 1. Measured on an H200 in
    docs/perf-notes.md ("split heuristic", v3.21 for batch 1). All arguments are ints (not bools):
    batch and max_seq_len >= 0, the others >= 1;
    raises MLAInputError naming the argument otherwise.
    """
    for name, v in (("batch", batch), ("num_heads", num_heads), ("q_len", q_len), ("max_seq_len", max_seq_len),
                    ("num_sms", num_sms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name in ("batch", "max_seq_len") else 1):
            _fail(name, "a non-negative int" if name in ("batch", "max_seq_len") else "a positive int", _shown(v))
    if not isinstance(fp8, bool):
        _fail("fp8", "a bool", _shown(fp8))
    return _default_splits(batch, num_heads, q_len, max_seq_len, num_sms, fp8)


def _default_splits(batch: int, num_heads: int, q_len: int, max_seq_len: int, num_sms: int, fp8: bool = False) -> int:
    """default_num_kv_splits on arguments already known to be in range (the per-call path). A 17..32-head
    16-bit call whose pieces come out shorter than ST32_MIN_KEYS runs the 64-row kernel (fewer CTAs at
    q_len > 1), so the count is taken again for 64-row CTAs; its pieces are then shorter still."""
    rows = _rows_per_cta(num_heads, fp8)
    n = _splits_for_rows(batch, num_heads * q_len, rows, max_seq_len, num_sms)
    if _launch_rows(num_heads, fp8, max_seq_len, n) != rows:  # the 64-row kernel runs these pieces
        n = _splits_for_rows(batch, num_heads * q_len, BLOCK_M, max_seq_len, num_sms)
    return n


def _splits_for_rows(batch: int, rows_per_req: int, rows: int, max_seq_len: int, num_sms: int) -> int:
    """The heuristic's count for CTAs of `rows` query rows (default_num_kv_splits)."""
    ctas = batch * -(-rows_per_req // rows)
    if ctas == 0 or ctas >= num_sms:
        return 1
    by_sms = num_sms // ctas
    tiles = -(-max_seq_len // BLOCK_N)  # integer ceil: any int, however large
    by_len = max(1, tiles if batch == 1 else tiles // 2)
    return max(1, min(by_sms, by_len, HEURISTIC_MAX_SPLITS))


def _check_tensor(arg: str, t, dims: int, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(arg, "a torch.Tensor", type(t).__name__)
    if t.layout is not torch.strided or t.is_nested:
        _fail(arg, "a dense (strided) tensor", f"layout {t.layout}{' (nested)' if t.is_nested else ''}")
    if t.dim() != dims:
        _fail(arg, f"a {dims}-d tensor", f"shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        want = " or ".join(str(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
        _fail(arg, f"dtype {want}", t.dtype)
    if device is not None and t.device != device:
        _fail(arg, f"a tensor on {device} (where q is)", t.device)
    if t.is_neg():  # the kernel reads and writes the memory, which holds the un-negated values
        _fail(arg, "a tensor whose memory holds its values (call .resolve_neg() first)",
              "a lazily negated view (is_neg() is True)")


def _check_layout(arg: str, t: torch.Tensor, align_elems: int) -> None:
    """The kernel reads and writes vectors: last dim contiguous, other strides and the base aligned."""
    stride = t.stride()
    if stride[-1] != 1 and t.shape[-1] > 1:
        _fail(arg, "a contiguous last dimension (stride 1)", f"strides {tuple(stride)}")
    bad = [s for s, n in zip(stride[:-1], t.shape[:-1]) if n > 1 and (s % align_elems or s < 0)]
    if bad or t.data_ptr() % (align_elems * t.element_size()):
        align = align_elems * t.element_size()
        _fail(arg, f"non-negative strides that are multiples of {align_elems} elements and a {align}-byte aligned start",
              f"strides {tuple(stride)}, data_ptr % {align} = {t.data_ptr() % align}")


def _check_no_overlap(arg: str, t: torch.Tensor) -> None:
    """Every element of an output must be its own memory (no stride-0 or overlapping dimensions)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            _fail(arg, "a tensor whose elements do not overlap (no expanded or overlapping dimensions)",
                  f"shape {tuple(t.shape)}, strides {tuple(t.stride())}")
        span = st * (n - 1) + span


def _byte_span(t: torch.Tensor):
    """(first, end) bytes that a strided tensor's elements can occupy (non-negative strides), or None when empty."""
    p = t.data_ptr()
    if t.is_contiguous():
        n = t.nbytes
        return (p, p + n) if n else None
    if t.numel() == 0:
        return None
    extent = 1
    for n, st in zip(t.shape, t.stride()):
        if n > 1:
            extent += (n - 1) * st
    return p, p + extent * t.element_size()


def _check_disjoint(c: "_Call", q_pair: bool, k_scale, outputs) -> None:
    """Caller-provided outputs (name, tensor or None: out, lse, workspace) must not share memory with an
    input or with each other: the kernel writes them while it reads the inputs, and the combine reads the
    workspace while it writes out. Conservative, as torch's out= checks: byte ranges that overlap count,
    whether or not an element is shared. The inputs' ranges come from the validated call's pointers,
    shapes and strides (a few integer operations: this runs on every MLADecodePlan.run)."""
    if c.batch == 0:
        return
    b1, l1, h1 = c.batch - 1, c.q_len - 1, c.num_heads - 1
    qn, qp, kv = c.qn_st, c.qp_st, c.kv_st
    kv_elem = 1 if c.kv_cache.dtype is FP8_DTYPE else 2
    spans = [("q_nope" if q_pair else "q", c.qn_ptr, c.qn_ptr + 2 * (b1 * qn[0] + l1 * qn[1] + h1 * qn[2] + KV_LORA_RANK)),
             ("q_pe" if q_pair else "q", c.qp_ptr, c.qp_ptr + 2 * (b1 * qp[0] + l1 * qp[1] + h1 * qp[2] + QK_ROPE_HEAD_DIM)),
             ("kv_cache", c.kv_ptr,
              c.kv_ptr + kv_elem * ((c.kv_cache.shape[0] - 1) * kv[0] + (c.page_size - 1) * kv[1] + HEAD_DIM)),
             ("block_table", c.bt_ptr, c.bt_ptr + 4 * (b1 * c.bt_st + c.max_pages)),
             ("seq_lens", c.sl_ptr, c.sl_ptr + 4 * c.batch)]
    if k_scale is not None and isinstance(k_scale, torch.Tensor):
        spans.append(("k_scale", k_scale.data_ptr(), k_scale.data_ptr() + 4))
    for name, t in outputs:
        if t is None:
            continue
        if t.is_contiguous():  # _byte_span's common case, inlined: this runs on every call
            first = t.data_ptr()
            end = first + t.nbytes
            if end == first:
                continue
        else:
            s = _byte_span(t)
            if s is None:
                continue
            first, end = s
        for other, lo, hi in spans:
            if first < hi and lo < end:
                _fail(name, f"memory of its own, not overlapping {other}",
                      f"bytes [{first:#x}, {end:#x}), overlapping {other}'s [{lo:#x}, {hi:#x})")
        spans.append((name, first, end))


class _Call:
    """A validated decode call, reduced to what the launcher needs: sizes, raw pointers and strides."""

    __slots__ = ("batch", "q_len", "num_heads", "page_size", "dtype", "device_index", "qn_ptr", "qn_st", "qp_ptr",
                 "qp_st", "kv_ptr", "kv_st", "bt_ptr", "bt_st", "max_pages", "sl_ptr", "scale", "out", "lse",
                 "kv_cache", "block_table", "seq_lens", "key_dtype", "k_scale", "k_scale_ptr", "k_scale_tensor")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    @classmethod
    def of_shape(cls, batch: int, num_heads: int, q_len: int, page_size: int, dtype: torch.dtype, device_index: int,
                 max_pages: int, kv_dtype: torch.dtype | None = None) -> "_Call":
        """A call known by its shape only (what MLADecodePlan dispatches on before any tensor exists);
        dtype is a q dtype (bf16/fp16); kv_dtype the cache's (default: dtype) selects the variants."""
        c = cls()
        c.batch, c.num_heads, c.q_len, c.page_size, c.dtype = batch, num_heads, q_len, page_size, dtype
        c.device_index, c.max_pages, c.key_dtype = device_index, max_pages, _KEY_OF[kv_dtype or dtype]
        return c


def _set_scale(c: _Call, kv_cache, k_scale) -> None:
    """The dispatch dtype token and the k_scale fields of the launch (already validated)."""
    if kv_cache.dtype is FP8_DTYPE:
        c.key_dtype = FP8_KEY
        if isinstance(k_scale, torch.Tensor):  # read by the kernel (also a Parameter or other subclass)
            c.k_scale, c.k_scale_ptr, c.k_scale_tensor = 0.0, k_scale.data_ptr(), k_scale
        else:
            c.k_scale, c.k_scale_ptr, c.k_scale_tensor = float(k_scale), 0, None
    else:
        c.key_dtype, c.k_scale, c.k_scale_ptr, c.k_scale_tensor = _DTYPES[c.dtype], 0.0, 0, None


def _k_scale_ok_fast(k_scale, dev: int, softmax_scale: float) -> bool:
    if type(k_scale) is float:
        return _FLT_MIN <= k_scale <= _K_SCALE_MAX and softmax_scale * k_scale < _MAX_SCALE
    return (isinstance(k_scale, torch.Tensor) and k_scale.layout is torch.strided and k_scale.dtype is torch.float32
            and k_scale.numel() == 1 and k_scale.get_device() == dev and k_scale.data_ptr() % 4 == 0
            and not k_scale.is_nested and not k_scale.is_neg())


def _check_k_scale(k_scale, kv_cache, device, softmax_scale) -> None:
    """k_scale must come with an fp8 cache, and only with one: a positive float from fp32's smallest
    normal value to fp32's largest / 256 (the kernel divides it by its 2^-8 q prescale), with
    softmax_scale * k_scale <= 1e30 so the fp32 score scale stays finite; or a 1-element float32 strided
    tensor on the cache's device (read by the kernel, so a CUDA graph sees it change; its value is the
    caller's to keep in that range). Call it after softmax_scale is checked."""
    if kv_cache.dtype is not FP8_DTYPE:
        if k_scale is not None:
            _fail("k_scale", f"None for a {kv_cache.dtype} kv_cache (k_scale dequantizes float8_e4m3fn caches only)",
                  _shown(k_scale))
        return
    if k_scale is None:
        _fail("k_scale", "the dequantization scale of the float8_e4m3fn kv_cache (cache value x k_scale = real value)",
              "None")
    if isinstance(k_scale, torch.Tensor):
        if (k_scale.dtype is not torch.float32 or k_scale.numel() != 1 or k_scale.device != device
                or k_scale.layout is not torch.strided or k_scale.is_nested):
            _fail("k_scale", f"a positive float or a 1-element float32 (strided) tensor on {device}",
                  f"a {k_scale.dtype} {k_scale.layout} tensor of shape {tuple(k_scale.shape)} on {k_scale.device}")
        if k_scale.is_neg():  # a lazily negated view: the kernel would read the un-negated memory
            _fail("k_scale", "a tensor whose memory holds its value (call .resolve_neg() first)",
                  "a lazily negated view (is_neg() is True)")
        return
    try:
        ok = not isinstance(k_scale, bool) and isinstance(k_scale, numbers.Real) and 0.0 < float(k_scale) < math.inf
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        _fail("k_scale", "a positive finite float or a 1-element float32 tensor", _shown(k_scale))
    if not _FLT_MIN <= float(k_scale) <= _K_SCALE_MAX:
        _fail("k_scale", f"a value in [{_FLT_MIN:.3g}, {_K_SCALE_MAX:.3g}] (fp32's normal range, less the "
                         "kernel's 2^8 q prescale)", _shown(k_scale))
    product = float(softmax_scale) * float(k_scale)
    if not product <= _MAX_SCALE:
        _fail("k_scale", f"softmax_scale * k_scale <= {_MAX_SCALE:g} (the kernel's fp32 score scale)",
              f"k_scale {k_scale!r} with softmax_scale {softmax_scale!r}")


def _fill(c: _Call, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, out, lse, dev: int) -> _Call:
    c.batch, c.q_len, c.num_heads = q_nope.shape[0], q_nope.shape[1], q_nope.shape[2]
    c.page_size, c.dtype, c.device_index = kv_cache.shape[1], q_nope.dtype, dev
    c.qn_ptr, c.qn_st = q_nope.data_ptr(), q_nope.stride()
    c.qp_ptr, c.qp_st = q_pe.data_ptr(), q_pe.stride()
    c.kv_ptr, c.kv_st = kv_cache.data_ptr(), kv_cache.stride()
    c.bt_ptr, c.bt_st, c.max_pages = block_table.data_ptr(), block_table.stride(0), block_table.shape[1]
    c.sl_ptr, c.scale, c.out, c.lse = seq_lens.data_ptr(), float(softmax_scale), out, lse
    c.kv_cache, c.block_table, c.seq_lens = kv_cache, block_table, seq_lens
    return c


def _fast_validate(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale=None) -> _Call | None:
    """The common, valid call checked with a few cheap attribute reads; None sends the call through
    :func:`_validate`, which re-checks everything and raises the precise error (or accepts an unusual
    but valid layout, e.g. an odd stride on a size-1 dimension)."""
    try:
        if type(q) is torch.Tensor:
            qs, st, dtype = q.shape, q.stride(), q.dtype
            if len(qs) != 4 or qs[3] != HEAD_DIM:
                return None
            q_nope = q_pe = q
            qp_off = KV_LORA_RANK * 2
            qp_st = st
        elif type(q) in (tuple, list) and len(q) == 2:  # _validate accepts no other sequence
            q_nope, q_pe = q
            qs, st, dtype = q_nope.shape, q_nope.stride(), q_nope.dtype
            ps, qp_st = q_pe.shape, q_pe.stride()
            if len(qs) != 4 or qs[3] != KV_LORA_RANK or len(ps) != 4 or ps[3] != QK_ROPE_HEAD_DIM or ps[:3] != qs[:3] \
                    or q_pe.dtype is not dtype or q_pe.get_device() != q_nope.get_device():
                return None
            qp_off = 0
        else:
            return None
        batch, q_len, heads = qs[0], qs[1], qs[2]
        dev = q_nope.get_device()
        if dtype not in _DTYPES or dev < 0 or not 1 <= q_len <= MAX_Q_LEN or heads < 1 or batch < 1:
            return None
        ks, kst = kv_cache.shape, kv_cache.stride()
        bs, bst = block_table.shape, block_table.stride()
        if kv_cache.dtype is FP8_DTYPE:  # 1-byte values: 16-element strides keep rows 16-byte aligned
            if (dtype is not torch.bfloat16 or kst[0] % 16 or kst[1] % 16 or type(softmax_scale) is not float
                    or not _k_scale_ok_fast(k_scale, dev, softmax_scale)):
                return None
        elif kv_cache.dtype is not dtype or k_scale is not None:
            return None
        if (len(ks) != 3 or ks[2] != HEAD_DIM or ks[0] < 1 or ks[1] < 1
                or kv_cache.get_device() != dev or kst[2] != 1 or kst[0] % 8 or kst[1] % 8 or kst[0] < 0 or kst[1] < 0
                or len(bs) != 2 or bs[0] != batch or bs[1] < 1 or bst[1] != 1 or bst[0] < 0
                or block_table.dtype is not torch.int32 or block_table.get_device() != dev
                or seq_lens.shape != (batch,) or seq_lens.dtype is not torch.int32 or seq_lens.get_device() != dev
                or seq_lens.stride()[0] != 1
                or st[3] != 1 or qp_st[3] != 1 or min(st[:3]) < 0 or min(qp_st[:3]) < 0
                or (st[0] | st[1] | st[2] | qp_st[0] | qp_st[1] | qp_st[2]) % 8):
            return None
        if type(softmax_scale) is not float or not 0.0 < softmax_scale <= _MAX_SCALE:
            return None
        if out is not None:
            o_st = out.stride()
            if (out.shape != (batch, q_len, heads, KV_LORA_RANK) or out.dtype is not dtype or out.get_device() != dev
                    or o_st[3] != 1 or (o_st[0] | o_st[1] | o_st[2]) % 4 or min(o_st) < 0
                    or not (o_st[2] >= KV_LORA_RANK and o_st[1] >= heads * o_st[2] and o_st[0] >= q_len * o_st[1])):
                return None
        if lse is not None and (lse.shape != (batch, heads, q_len) or lse.dtype is not torch.float32
                                or lse.get_device() != dev or not lse.is_contiguous()):
            return None
        if (q_nope.is_neg() or q_pe.is_neg() or kv_cache.is_neg() or block_table.is_neg() or seq_lens.is_neg()
                or (out is not None and out.is_neg()) or (lse is not None and lse.is_neg())):
            return None  # a lazily negated view: _validate names it
        c = _Call()
        c.qn_ptr = q_nope.data_ptr()
        c.qp_ptr = c.qn_ptr + qp_off if qp_off else q_pe.data_ptr()
        c.kv_ptr = kv_cache.data_ptr()
        if (c.qn_ptr | c.qp_ptr | c.kv_ptr) % 16 or (out is not None and out.data_ptr() % 8):
            return None
        c.batch, c.q_len, c.num_heads, c.page_size, c.dtype, c.device_index = batch, q_len, heads, ks[1], dtype, dev
        c.qn_st, c.qp_st, c.kv_st = st, qp_st, kst
        c.bt_ptr, c.bt_st, c.max_pages = block_table.data_ptr(), bst[0], bs[1]
        c.sl_ptr, c.scale, c.out, c.lse = seq_lens.data_ptr(), softmax_scale, out, lse
        c.kv_cache, c.block_table, c.seq_lens = kv_cache, block_table, seq_lens
        _set_scale(c, kv_cache, k_scale)
        return c
    except (TypeError, ValueError, AttributeError, IndexError, RuntimeError):
        # RuntimeError: torch's own, e.g. .stride() of a sparse-CSR or nested tensor; _validate names it.
        return None


def _validate(q, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse, k_scale=None) -> _Call:
    """Check every argument (raising MLAInputError naming it) and return the call; out/lse may stay None."""
    num_kv_splits_bad = num_kv_splits is not None and (
        isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_KV_SPLITS)
    if not num_kv_splits_bad:
        fast = _fast_validate(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        if fast is not None:
            return fast
    # -- q ---------------------------------------------------------------------------------------
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            _fail("q", "a tensor or the pair (q_nope, q_pe)", f"a sequence of {len(q)} items")
        q_nope, q_pe = q
        _check_tensor("q_nope", q_nope, 4, tuple(_DTYPES))
        _check_tensor("q_pe", q_pe, 4, q_nope.dtype, q_nope.device)
        if q_nope.shape[-1] != KV_LORA_RANK:
            _fail("q_nope", f"last dimension {KV_LORA_RANK} (kv_lora_rank)", f"shape {tuple(q_nope.shape)}")
        if q_pe.shape[-1] != QK_ROPE_HEAD_DIM:
            _fail("q_pe", f"last dimension {QK_ROPE_HEAD_DIM} (qk_rope_head_dim)", f"shape {tuple(q_pe.shape)}")
        if q_pe.shape[:3] != q_nope.shape[:3]:
            _fail("q_pe", f"leading shape {tuple(q_nope.shape[:3])} (as q_nope)", f"{tuple(q_pe.shape[:3])}")
        q_arg = ("q_nope", "q_pe")
    else:
        _check_tensor("q", q, 4, tuple(_DTYPES))
        if q.shape[-1] != HEAD_DIM:
            _fail("q", f"last dimension {HEAD_DIM} (kv_lora_rank 512 + qk_rope_head_dim 64)", f"shape {tuple(q.shape)}")
        q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
        q_arg = ("q", "q")
    batch, q_len, num_heads, _ = q_nope.shape
    dtype, device = q_nope.dtype, q_nope.device
    if not 1 <= q_len <= MAX_Q_LEN:
        _fail("q", f"q_len (dim 1) from 1 to {MAX_Q_LEN}", q_len)
    if num_heads < 1:
        _fail("q", "num_heads (dim 2) >= 1", num_heads)

    # -- cache and metadata --------------------------------------------------------------------
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype is FP8_DTYPE
    if fp8 and dtype is not torch.bfloat16:
        _fail(q_arg[0], "bf16 with a float8_e4m3fn kv_cache (q and out are bf16)", dtype)
    _check_tensor("kv_cache", kv_cache, 3, (dtype, FP8_DTYPE) if dtype is torch.bfloat16 else dtype, device)
    if kv_cache.shape[-1] != HEAD_DIM:
        _fail("kv_cache", f"shape [num_pages, page_size, {HEAD_DIM}]", f"shape {tuple(kv_cache.shape)}")
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if num_pages < 1 or page_size < 1:
        _fail("kv_cache", "at least one page of at least one token", f"shape {tuple(kv_cache.shape)}")
    _check_tensor("block_table", block_table, 2, torch.int32, device)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        _fail("block_table", f"shape [batch={batch}, max_pages_per_seq >= 1]", f"shape {tuple(block_table.shape)}")
    if block_table.stride(-1) != 1 or block_table.stride(0) < 0:
        _fail("block_table", "a contiguous last dimension", f"strides {tuple(block_table.stride())}")
    _check_tensor("seq_lens", seq_lens, 1, torch.int32, device)
    if seq_lens.shape[0] != batch or not seq_lens.is_contiguous():
        _fail("seq_lens", f"a contiguous tensor of shape [batch={batch}]", f"shape {tuple(seq_lens.shape)}, strides {tuple(seq_lens.stride())}")
    try:
        scale_ok = not isinstance(softmax_scale, bool) and 0.0 < float(softmax_scale) <= _MAX_SCALE
    except (TypeError, ValueError, OverflowError):
        scale_ok = False
    if not scale_ok or not isinstance(softmax_scale, (int, float)):
        _fail("softmax_scale", f"a finite positive float (at most {_MAX_SCALE:g}, so that scale * log2(e) fits fp32)",
              _shown(softmax_scale))
    _check_k_scale(k_scale, kv_cache, device, softmax_scale)

    # -- outputs -------------------------------------------------------------------------------
    if out is not None:
        _check_tensor("out", out, 4, dtype, device)
        if tuple(out.shape) != (batch, q_len, num_heads, KV_LORA_RANK):
            _fail("out", f"shape {(batch, q_len, num_heads, KV_LORA_RANK)}", f"shape {tuple(out.shape)}")
        _check_layout("out", out, 4)
        _check_no_overlap("out", out)
    if lse is not None:
        _check_tensor("lse", lse, 3, torch.float32, device)
        if tuple(lse.shape) != (batch, num_heads, q_len):
            _fail("lse", f"shape {(batch, num_heads, q_len)}", f"shape {tuple(lse.shape)}")
        if min(lse.stride(), default=0) < 0:
            _fail("lse", "non-negative strides", f"strides {tuple(lse.stride())}")
        _check_no_overlap("lse", lse)
    if num_kv_splits_bad:
        _fail("num_kv_splits", f"an int from 1 to {MAX_KV_SPLITS}", _shown(num_kv_splits))
    if device.type != "cuda":
        _fail("q", "a CUDA tensor", f"a tensor on {device}")
    if batch:
        _check_layout(q_arg[0], q_nope, 8)
        _check_layout(q_arg[1], q_pe, 8)
        _check_layout("kv_cache", kv_cache, 16 if fp8 else 8)
    c = _fill(_Call(), q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, out, lse, device.index)
    _set_scale(c, kv_cache, k_scale)
    return c


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _pack(c: _Call, launches, num_kv_splits: int, workspace: torch.Tensor | None, workspace_bytes: int,
          stream: int, schedule: int = 0, sched_ctas: int = 0, max_seq_len: int = 0) -> list[tuple[str, bytes]]:
    """One packed MlaDecodeArgs per launch (head group): [(launcher symbol, struct bytes)]. schedule: the
    device address of a balanced schedule (MLADecodePlan.schedule) for sched_ctas CTAs per row block, or 0.
    max_seq_len: the caller's bound of seq_lens (0: none), from which the launcher picks a variant's
    second kernel for short splits (fp8; 17..32 heads' 64-row one; templates/mla/launch.cuh)."""
    o, ls = c.out, c.lse
    o_ptr, o_st, l_ptr, l_st = o.data_ptr(), o.stride(), ls.data_ptr(), ls.stride()
    qn_st, qp_st = c.qn_st, c.qp_st
    ws_ptr = workspace.data_ptr() if workspace_bytes else 0
    return [(l.symbol, _binding.pack_args(
        c.batch, c.q_len, l.num_heads, c.max_pages, num_kv_splits, max_seq_len,
        c.qn_ptr + l.head_start * qn_st[2] * 2, qn_st[0], qn_st[1], qn_st[2],
        c.qp_ptr + l.head_start * qp_st[2] * 2, qp_st[0], qp_st[1], qp_st[2],
        c.kv_ptr, c.kv_st[0], c.kv_st[1], c.k_scale, c.k_scale_ptr, c.bt_ptr, c.bt_st, c.sl_ptr, c.scale,
        o_ptr + l.head_start * o_st[2] * 2, o_st[0], o_st[1], o_st[2],
        l_ptr + l.head_start * l_st[1] * 4, l_st[0], l_st[1], l_st[2],
        ws_ptr, workspace_bytes, schedule, sched_ctas, stream)) for l in launches]


def _launch(c: _Call, launches, num_kv_splits: int, workspace: torch.Tensor | None, workspace_bytes: int,
            schedule: int = 0, sched_ctas: int = 0, max_seq_len: int = 0) -> None:
    """Call the compiled launchers on the current stream of the tensors' device."""
    if c.device_index != torch.cuda.current_device():  # launch on the tensors' device, not the current one
        with torch.cuda.device(c.device_index):
            return _launch(c, launches, num_kv_splits, workspace, workspace_bytes, schedule, sched_ctas, max_seq_len)
    lib = _binding.library()
    for symbol, packed in _pack(c, launches, num_kv_splits, workspace, workspace_bytes, _current_stream(c.device_index),
                                schedule, sched_ctas, max_seq_len):
        lib.launch(symbol, packed)


def _check_workspace_tensor(workspace, device: torch.device) -> None:
    """A caller's workspace is a dense tensor on the call's device (before anything reads its bytes)."""
    if not isinstance(workspace, torch.Tensor) or workspace.get_device() != device.index:
        _fail("workspace", f"a tensor on {device}", type(workspace).__name__ if not isinstance(workspace, torch.Tensor) else workspace.device)
    if workspace.layout is not torch.strided or workspace.is_nested:
        _fail("workspace", "a dense (strided) tensor", f"layout {workspace.layout}{' (nested)' if workspace.is_nested else ''}")


def _check_workspace(workspace, need: int, device, what: str) -> None:
    _check_workspace_tensor(workspace, device)
    nbytes = workspace.numel() * workspace.element_size()
    if not workspace.is_contiguous() or nbytes < need or workspace.data_ptr() % 16:
        _fail("workspace", f"a contiguous, 16-byte aligned tensor of at least {need} bytes ({what})",
              f"{nbytes} bytes, contiguous={workspace.is_contiguous()}, data_ptr % 16 = {workspace.data_ptr() % 16}")


def mla_decode(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
               *, num_kv_splits: int | None = None, max_seq_len: int | None = None, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, workspace: torch.Tensor | None = None, debug: bool = False,
               k_scale=None):
    """One MLA decode step over a paged latent KV cache.

    Args:
      q: [batch, q_len, num_heads, 576] bf16/fp16 (576 = kv_lora_rank 512 + qk_rope_head_dim 64), or the
        pair (q_nope [batch, q_len, num_heads, 512], q_pe [batch, q_len, num_heads, 64]) read in place.
        Last dimension contiguous, other strides multiples of 8 elements. q_len 1..8; for q_len > 1 the
        mask is causal and bottom-right aligned (query i sees the first seq_len - (q_len - 1 - i) keys).
      kv_cache: [num_pages, page_size, 576], q's dtype and device; K is the whole row, V its first 512
        values. Any page/token stride that is a multiple of 8 elements (a view into a larger buffer works).
        Or float8_e4m3fn (fp8_e4m3 variants) with bf16 q: a cache value times k_scale is the real value
        (write one with mla_variants.fp8.write_kv_cache); strides then multiples of 16 elements.
      block_table: [batch, max_pages_per_seq] int32; entries past a request's last page are never read.
      seq_lens: [batch] int32 on q's device; 0 is legal (out 0, lse -inf). A request whose seq_len is
        negative or exceeds max_pages_per_seq * page_size gets NaN out and lse (debug=True raises instead).
      softmax_scale: positive float multiplying q.k (DeepSeek: (128 + 64) ** -0.5 times the YaRN factor).
      num_kv_splits: force the split count (1..256); default :func:`default_num_kv_splits`.
      max_seq_len: upper bound of seq_lens for the split heuristic and the kernel choice (default: the
        block table's capacity). Only speed depends on it: a longer request is still computed exactly.
      out: optional preallocated [batch, q_len, num_heads, 512] in q's dtype (last dim contiguous).
      lse: optional preallocated [batch, num_heads, q_len] fp32.
      workspace: optional device tensor of at least :func:`workspace_size` bytes for split-KV; when absent
        and splits are used, one is allocated for this call.
      debug: check seq_lens and the used block_table entries against the cache before launching
        (a device-side check plus one synchronization).
      k_scale: float8_e4m3fn caches only (required there): the per-tensor dequantization scale, a
        positive float (fp32's normal range, at most fp32's max / 256) or a 1-element float32 tensor on
        the cache's device, which the kernel reads at run time (so a captured CUDA graph follows its
        value; its value is not checked). A float is passed by value: a captured graph keeps the float
        it was captured with.
        Scores use q . (cache x k_scale) and the output sums p x (cache x k_scale); the tensor cores
        run in fp16 (every e4m3 value is exact in fp16; q is rounded to fp16 after a 2^-8 scaling, so
        with an fp8 cache q must stay below 2^24 in magnitude: larger values overflow to inf and give
        NaN/inf rows; q's values are not checked).
      out, lse, workspace: when given, must not share memory with q, kv_cache, block_table, seq_lens,
        k_scale or each other (MLAInputError otherwise).
    Returns:
      (out [batch, q_len, num_heads, 512] in q's dtype, lse [batch, num_heads, q_len] fp32, natural log).

    Raises:
      MLAInputError (a ValueError) naming the argument for any wrong shape, dtype, device, stride or value;
      VariantNotCompiledError when no compiled variant serves (page_size, dtype); LibraryNotBuiltError
      when the kernels were never built; RuntimeError carrying the CUDA error when a launch fails.
    """
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or not 1 <= max_seq_len <= 2**31 - 1):
        _fail("max_seq_len", "None or an int from 1 to 2**31 - 1 (an upper bound of seq_lens)", _shown(max_seq_len))
    if debug is not False and debug is not True:
        _fail("debug", "a bool", _shown(debug))
    c = _validate(q, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse, k_scale)
    if workspace is not None:
        _check_workspace_tensor(workspace, c.device)
    if out is not None or lse is not None or workspace is not None:
        _check_disjoint(c, not isinstance(q, torch.Tensor), k_scale, (("out", out), ("lse", lse), ("workspace", workspace)))
    if c.out is None:
        c.out = torch.empty((c.batch, c.q_len, c.num_heads, KV_LORA_RANK), dtype=c.dtype, device=c.device)
    if c.lse is None:
        c.lse = torch.empty((c.batch, c.num_heads, c.q_len), dtype=torch.float32, device=c.device)
    if c.batch == 0:
        return c.out, c.lse
    lib = _binding.library()
    launches, num_kv_splits = _choose(lib, c, num_kv_splits, max_seq_len)
    if debug:
        _debug_check(kv_cache, block_table, seq_lens, c.page_size)
    need = workspace_size(c.batch, max(l.num_heads for l in launches), c.q_len, num_kv_splits)
    if need:
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.uint8, device=c.device)
        else:
            _check_workspace(workspace, need, c.device,
                             f"workspace_size(batch={c.batch}, num_heads, q_len={c.q_len}, num_kv_splits={num_kv_splits})")
    _launch(c, launches, num_kv_splits, workspace, need, max_seq_len=max_seq_len or 0)
    return c.out, c.lse


def _choose(lib, c: _Call, num_kv_splits: int | None, max_seq_len: int | None):
    """(launches, num_kv_splits): a forced split count must be served as asked; the heuristic's choice
    falls back to one split when the build has no split variant for this (page_size, dtype)."""
    dtype = c.key_dtype
    if num_kv_splits is not None:
        return lib.plan(c.num_heads, c.page_size, dtype, num_kv_splits > 1), num_kv_splits
    capacity = c.max_pages * c.page_size  # launch.cuh short_split_keys bounds max_seq_len by it too
    bound = capacity if max_seq_len is None else min(max_seq_len, capacity)
    n = _default_splits(c.batch, c.num_heads, c.q_len, bound, _sm_count(c.device_index), dtype == FP8_KEY)
    if n > 1:
        try:
            return lib.plan(c.num_heads, c.page_size, dtype, True), n
        except VariantNotCompiledError:
            pass
    return lib.plan(c.num_heads, c.page_size, dtype, False), 1


def _debug_check(kv_cache, block_table, seq_lens, page_size: int) -> None:
    """Opt-in checks on the device, then one synchronization: seq_lens within [0, capacity] and every
    block_table entry a request uses inside [0, num_pages)."""
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.long()
    bad_len = (lens < 0) | (lens > capacity)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    bad_page = used & ((block_table < 0) | (block_table >= kv_cache.shape[0]))
    flags = torch.stack([bad_len.any(), bad_page.any()]).tolist()  # the one synchronization
    if flags[0]:
        b = int(bad_len.nonzero()[0, 0])
        _fail("seq_lens", f"values in [0, max_pages_per_seq * page_size = {capacity}]", f"{int(lens[b])} for request {b}")
    if flags[1]:
        b, j = (int(x) for x in bad_page.nonzero()[0])
        _fail("block_table", f"page ids in [0, num_pages = {kv_cache.shape[0]}) for the pages a request uses",
              f"block_table[{b}, {j}] = {int(block_table[b, j])}")


def list_variants() -> list[tuple[int, int, str, bool]]:
    """The compiled (num_heads, page_size, dtype, split) keys of the loaded library, sorted.
    Raises LibraryNotBuiltError when nothing was built."""
    return sorted(_binding.library().table)


def is_supported(num_heads: int, page_size: int, dtype, split: bool = False) -> bool:
    """Whether a call with these parameters can be served by the built library (dtype: torch dtype or
    'bf16'/'fp16'/'fp8_e4m3', where torch.float8_e4m3fn means the fp8 cache variants; masked head
    counts and head groups count as served). Raises MLAInputError for num_heads or page_size that is not
    an int from 1 to 2**20 (MLADecodePlan's bounds), a split that is not a bool, or a dtype that is none
    of these; LibraryNotBuiltError when nothing was built."""
    for name, v in (("num_heads", num_heads), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**20:
            _fail(name, "an int from 1 to 2**20", _shown(v))
    if not isinstance(split, bool):
        _fail("split", "a bool", _shown(split))
    key = _KEY_OF.get(dtype, dtype) if isinstance(dtype, (torch.dtype, str)) else None
    if key not in _KEY_OF.values():
        _fail("dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn or 'bf16'/'fp16'/'fp8_e4m3'", _shown(dtype))
    return _table_supports(_binding.library().table, num_heads, page_size, key, split)
