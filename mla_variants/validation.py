"""Validation of a decode call: every argument is checked before anything is launched, and a bad one
raises :class:`MLAInputError` naming the argument, what was expected and what was given. The result is
a :class:`Call`: the validated call reduced to the sizes, raw pointers and strides the launcher packs
(launching.py).

The common valid call takes :func:`fast_validate` (a few attribute reads); anything else, or anything
wrong, goes through :func:`validate`, which re-checks every argument and raises the precise error.
"""
from __future__ import annotations

import math
import numbers

import torch

from codegen.variant import FP8_FAST as FP8_FAST_KEY  # the fast mode's variants.yaml dtype token

from .fp8 import FP8_DTYPE, FP32_MAX, FP32_TINY

KV_LORA_RANK = 512  # latent values per cache row (V is the first 512 of K's 576)
QK_ROPE_HEAD_DIM = 64
HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
MAX_Q_LEN = 8
MAX_KV_SPLITS = 256

Q_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # q dtypes (and their caches' dtype token)
FP8_KEY = "fp8_e4m3"  # the variants.yaml dtype token of fp8 caches (q and out bf16)
DTYPE_TOKEN = {**Q_DTYPES, FP8_DTYPE: FP8_KEY}  # a cache's torch dtype -> the dispatch key's dtype token
DTYPE_TOKENS = (*DTYPE_TOKEN.values(), FP8_FAST_KEY)  # every dispatch dtype token (is_supported & co.)
FP8_MODES = ("exact", "fast")  # fp8_mode: how a float8_e4m3fn cache is multiplied
MAX_SOFTMAX_SCALE = 1e30  # the kernel multiplies by scale * log2(e) in fp32
MIN_SOFTMAX_SCALE = FP32_TINY  # below fp32's smallest normal the kernel's scale would be denormal or 0
SOFTMAX_SCALE_RANGE = f"a finite positive float (at least {MIN_SOFTMAX_SCALE:.3g} and at most {MAX_SOFTMAX_SCALE:g}, " \
                      "so that scale * log2(e) is a normal fp32)"
K_SCALE_MAX = FP32_MAX / 256  # k_scale travels as fp32; the fp8 kernel divides it by its 2^-8 q prescale in fp32


class MLAInputError(ValueError):
    """A decode argument is wrong; the message names the argument, what was expected and what was given."""


def fail(arg: str, expected: str, got) -> None:
    raise MLAInputError(f"{arg}: expected {expected}, got {got}")


SHOWN_MAX = 200  # characters of a value's repr in an error message


def shown(v) -> str:
    """repr(v) for an error message, at most SHOWN_MAX characters; a tensor (also inside a tuple or list)
    by its dtype, shape and device; an int too long for repr (Python refuses ints of more than 4300
    digits as text) by its size, and a value whose repr raises by its type, so the caller still gets
    MLAInputError, not the repr's own error."""
    if isinstance(v, torch.Tensor):  # its kind, not its values
        return f"a {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}"
    if isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v):
        return f"a {type(v).__name__} of {', '.join(shown(t) for t in v)}"
    try:
        text = repr(v)
    except ValueError:
        return f"an int of {v.bit_length()} bits" if isinstance(v, int) else f"a {type(v).__name__}"
    except Exception:  # a __repr__ that raises: the type still says what was given
        return f"a value of type {type(v).__name__} (its repr() raised)"
    return text if len(text) <= SHOWN_MAX else f"{text[:SHOWN_MAX - 3]}..."


def check_tensor(arg: str, t, dims: int, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        fail(arg, "a torch.Tensor", type(t).__name__)
    if t.layout is not torch.strided or t.is_nested:
        fail(arg, "a dense (strided) tensor", f"layout {t.layout}{' (nested)' if t.is_nested else ''}")
    if t.dim() != dims:
        fail(arg, f"a {dims}-d tensor", f"shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        want = " or ".join(str(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
        fail(arg, f"dtype {want}", t.dtype)
    if device is not None and t.device != device:
        fail(arg, f"a tensor on {device} (where q is)", t.device)
    if t.is_neg():  # the kernel reads and writes the memory, which holds the un-negated values
        fail(arg, "a tensor whose memory holds its values (call .resolve_neg() first)",
              "a lazily negated view (is_neg() is True)")


def check_layout(arg: str, t: torch.Tensor, align_elems: int) -> None:
    """The kernel reads and writes vectors: last dim contiguous, other strides and the base aligned."""
    stride = t.stride()
    if stride[-1] != 1 and t.shape[-1] > 1:
        fail(arg, "a contiguous last dimension (stride 1)", f"strides {tuple(stride)}")
    bad = [s for s, n in zip(stride[:-1], t.shape[:-1]) if n > 1 and (s % align_elems or s < 0)]
    if bad or t.data_ptr() % (align_elems * t.element_size()):
        align = align_elems * t.element_size()
        fail(arg, f"non-negative strides that are multiples of {align_elems} elements and a {align}-byte aligned start",
              f"strides {tuple(stride)}, data_ptr % {align} = {t.data_ptr() % align}")


def check_no_overlap(arg: str, t: torch.Tensor) -> None:
    """Every element of an output must be its own memory (no stride-0 or overlapping dimensions)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            fail(arg, "a tensor whose elements do not overlap (no expanded or overlapping dimensions)",
                  f"shape {tuple(t.shape)}, strides {tuple(t.stride())}")
        span = st * (n - 1) + span


def byte_span(t: torch.Tensor):
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


def check_disjoint(c: "Call", q_pair: bool, k_scale, outputs) -> None:
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
        if t.is_contiguous():  # byte_span's common case, inlined: this runs on every call
            first = t.data_ptr()
            end = first + t.nbytes
            if end == first:
                continue
        else:
            s = byte_span(t)
            if s is None:
                continue
            first, end = s
        for other, lo, hi in spans:
            if first < hi and lo < end:
                fail(name, f"memory of its own, not overlapping {other}",
                      f"bytes [{first:#x}, {end:#x}), overlapping {other}'s [{lo:#x}, {hi:#x})")
        spans.append((name, first, end))


class Call:
    """A validated decode call, reduced to what the launcher needs: sizes, raw pointers and strides."""

    __slots__ = ("batch", "q_len", "num_heads", "page_size", "dtype", "device_index", "qn_ptr", "qn_st", "qp_ptr",
                 "qp_st", "kv_ptr", "kv_st", "bt_ptr", "bt_st", "max_pages", "sl_ptr", "scale", "out", "lse",
                 "kv_cache", "block_table", "seq_lens", "key_dtype", "k_scale", "k_scale_ptr", "k_scale_tensor",
                 "loc_ptr", "total_q_tokens")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    @classmethod
    def of_shape(cls, batch: int, num_heads: int, q_len: int, page_size: int, dtype: torch.dtype, device_index: int,
                 max_pages: int, kv_dtype: torch.dtype | None = None) -> "Call":
        """A call known by its shape only (what MLADecodePlan dispatches on before any tensor exists);
        dtype is a q dtype (bf16/fp16); kv_dtype the cache's (default: dtype) selects the variants."""
        c = cls()
        c.batch, c.num_heads, c.q_len, c.page_size, c.dtype = batch, num_heads, q_len, page_size, dtype
        c.device_index, c.max_pages, c.key_dtype = device_index, max_pages, DTYPE_TOKEN[kv_dtype or dtype]
        c.loc_ptr, c.total_q_tokens = 0, 0
        return c


def set_scale(c: Call, kv_cache, k_scale) -> None:
    """The dispatch dtype token and the k_scale fields of the launch (already validated)."""
    if kv_cache.dtype is FP8_DTYPE:
        c.key_dtype = FP8_KEY
        if isinstance(k_scale, torch.Tensor):  # read by the kernel (also a Parameter or other subclass)
            c.k_scale, c.k_scale_ptr, c.k_scale_tensor = 0.0, k_scale.data_ptr(), k_scale
        else:
            c.k_scale, c.k_scale_ptr, c.k_scale_tensor = float(k_scale), 0, None
    else:
        c.key_dtype, c.k_scale, c.k_scale_ptr, c.k_scale_tensor = Q_DTYPES[c.dtype], 0.0, 0, None


def fp8_token(fp8_mode, kv_dtype: torch.dtype) -> str | None:
    """The dispatch dtype token of a cache of kv_dtype under fp8_mode: "exact" (the default; an fp8 cache
    runs fp8_e4m3 variants, fp16 math on exactly widened values) or "fast" (fp8_e4m3_fast variants, fp8
    tensor-core math; float8_e4m3fn caches only). MLAInputError naming fp8_mode otherwise."""
    if type(fp8_mode) is not str or fp8_mode not in FP8_MODES:
        fail("fp8_mode", "'exact' or 'fast'", shown(fp8_mode))
    if fp8_mode == "fast":
        if kv_dtype is not FP8_DTYPE:
            fail("fp8_mode", f"'exact' with a {kv_dtype} kv_cache ('fast' is fp8 tensor-core math on a "
                             "float8_e4m3fn cache)", "'fast'")
        return FP8_FAST_KEY
    return DTYPE_TOKEN.get(kv_dtype)  # None for a dtype no variant has (the cache's own check names it)


def apply_fp8_mode(c: Call, fp8_mode) -> None:
    """Set a validated call's dispatch dtype token for fp8_mode (:func:`fp8_token`)."""
    if type(fp8_mode) is str and fp8_mode == "exact":  # the common call: the token set_scale chose
        return
    c.key_dtype = fp8_token(fp8_mode, c.kv_cache.dtype)


def _k_scale_ok_fast(k_scale, dev: int, softmax_scale: float) -> bool:
    if type(k_scale) is float:
        return FP32_TINY <= k_scale <= K_SCALE_MAX and MIN_SOFTMAX_SCALE <= softmax_scale * k_scale < MAX_SOFTMAX_SCALE
    return (isinstance(k_scale, torch.Tensor) and k_scale.layout is torch.strided and k_scale.dtype is torch.float32
            and k_scale.numel() == 1 and k_scale.get_device() == dev and k_scale.data_ptr() % 4 == 0
            and not k_scale.is_nested and not k_scale.is_neg())


def check_k_scale(k_scale, kv_cache, device, softmax_scale) -> None:
    """k_scale must come with an fp8 cache, and only with one: a positive float from fp32's smallest
    normal value to fp32's largest / 256 (the kernel divides it by its 2^-8 q prescale), with
    softmax_scale * k_scale from 1.18e-38 to 1e30 so the fp32 score scale is a normal number; or a
    1-element float32 strided tensor on the cache's device (read by the kernel, so a CUDA graph sees it
    change; its value is the caller's to keep in that range). Call it after softmax_scale is checked."""
    if kv_cache.dtype is not FP8_DTYPE:
        if k_scale is not None:
            fail("k_scale", f"None for a {kv_cache.dtype} kv_cache (k_scale dequantizes float8_e4m3fn caches only)",
                  shown(k_scale))
        return
    if k_scale is None:
        fail("k_scale", "the dequantization scale of the float8_e4m3fn kv_cache (cache value x k_scale = real value)",
              "None")
    if isinstance(k_scale, torch.Tensor):
        if (k_scale.dtype is not torch.float32 or k_scale.numel() != 1 or k_scale.device != device
                or k_scale.layout is not torch.strided or k_scale.is_nested):
            fail("k_scale", f"a positive float or a 1-element float32 (strided) tensor on {device}",
                  f"a {k_scale.dtype} {k_scale.layout} tensor of shape {tuple(k_scale.shape)} on {k_scale.device}")
        if k_scale.is_neg():  # a lazily negated view: the kernel would read the un-negated memory
            fail("k_scale", "a tensor whose memory holds its value (call .resolve_neg() first)",
                  "a lazily negated view (is_neg() is True)")
        return
    try:
        ok = not isinstance(k_scale, bool) and isinstance(k_scale, numbers.Real) and 0.0 < float(k_scale) < math.inf
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        fail("k_scale", "a positive finite float or a 1-element float32 tensor", shown(k_scale))
    if not FP32_TINY <= float(k_scale) <= K_SCALE_MAX:
        fail("k_scale", f"a value in [{FP32_TINY:.3g}, {K_SCALE_MAX:.3g}] (fp32's normal range, less the "
                         "kernel's 2^8 q prescale)", shown(k_scale))
    product = float(softmax_scale) * float(k_scale)
    if not MIN_SOFTMAX_SCALE <= product <= MAX_SOFTMAX_SCALE:
        fail("k_scale", f"softmax_scale * k_scale from {MIN_SOFTMAX_SCALE:.3g} to {MAX_SOFTMAX_SCALE:g} (the kernel's "
                         "fp32 score scale, a normal fp32)", f"k_scale {k_scale!r} with softmax_scale {softmax_scale!r}")


def fill_call(c: Call, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, out, lse, dev: int) -> Call:
    c.batch, c.q_len, c.num_heads = q_nope.shape[0], q_nope.shape[1], q_nope.shape[2]
    c.page_size, c.dtype, c.device_index = kv_cache.shape[1], q_nope.dtype, dev
    c.qn_ptr, c.qn_st = q_nope.data_ptr(), q_nope.stride()
    c.qp_ptr, c.qp_st = q_pe.data_ptr(), q_pe.stride()
    c.kv_ptr, c.kv_st = kv_cache.data_ptr(), kv_cache.stride()
    c.bt_ptr, c.bt_st, c.max_pages = block_table.data_ptr(), block_table.stride(0), block_table.shape[1]
    c.sl_ptr, c.scale, c.out, c.lse = seq_lens.data_ptr(), float(softmax_scale), out, lse
    c.kv_cache, c.block_table, c.seq_lens = kv_cache, block_table, seq_lens
    c.loc_ptr, c.total_q_tokens = 0, 0  # a uniform batch (varlen.py sets them)
    return c


def fast_validate(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale=None) -> Call | None:
    """The common, valid call checked with a few cheap attribute reads; None sends the call through
    :func:`validate`, which re-checks everything and raises the precise error (or accepts an unusual
    but valid layout, e.g. an odd stride on a size-1 dimension)."""
    try:
        if type(q) is torch.Tensor:
            qs, st, dtype = q.shape, q.stride(), q.dtype
            if len(qs) != 4 or qs[3] != HEAD_DIM:
                return None
            q_nope = q_pe = q
            qp_off = KV_LORA_RANK * 2
            qp_st = st
        elif type(q) in (tuple, list) and len(q) == 2:  # validate accepts no other sequence
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
        if dtype not in Q_DTYPES or dev < 0 or not 1 <= q_len <= MAX_Q_LEN or heads < 1 or batch < 1:
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
        if type(softmax_scale) is not float or not MIN_SOFTMAX_SCALE <= softmax_scale <= MAX_SOFTMAX_SCALE:
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
            return None  # a lazily negated view: validate names it
        c = Call()
        c.loc_ptr, c.total_q_tokens = 0, 0
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
        set_scale(c, kv_cache, k_scale)
        return c
    except (TypeError, ValueError, AttributeError, IndexError, RuntimeError):
        # RuntimeError: torch's own, e.g. .stride() of a sparse-CSR or nested tensor; validate names it.
        return None


def softmax_scale_ok(softmax_scale) -> bool:
    """The one softmax_scale rule (mla_decode, the references, the ops' fakes): a real number (int, float,
    a numpy scalar), not a bool or a tensor, with MIN_SOFTMAX_SCALE <= value <= MAX_SOFTMAX_SCALE (beyond
    them the kernel's fp32 score scale overflows or loses its precision)."""
    try:
        return (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, (bool, torch.Tensor))
                and MIN_SOFTMAX_SCALE <= float(softmax_scale) <= MAX_SOFTMAX_SCALE)
    except OverflowError:
        return False


def check_cache_shape(kv_cache: torch.Tensor) -> None:
    """A 3-d kv_cache's shape: [num_pages >= 1, page_size >= 1, 576] (the eager calls and the ops' fakes)."""
    if kv_cache.shape[-1] != HEAD_DIM:
        fail("kv_cache", f"shape [num_pages, page_size, {HEAD_DIM}]", f"shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        fail("kv_cache", "at least one page of at least one token", f"shape {tuple(kv_cache.shape)}")


def check_cache(kv_cache, block_table, seq_lens, softmax_scale, k_scale, batch: int, dtype, device, q_arg: str) -> bool:
    """The cache and metadata arguments of a call whose q (named q_arg) has `batch` requests of `dtype` on
    `device` (MLAInputError naming the argument otherwise); returns whether the cache is fp8."""
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype is FP8_DTYPE
    if fp8 and dtype is not torch.bfloat16:
        fail(q_arg, "bf16 with a float8_e4m3fn kv_cache (q and out are bf16)", dtype)
    check_tensor("kv_cache", kv_cache, 3, (dtype, FP8_DTYPE) if dtype is torch.bfloat16 else dtype, device)
    check_cache_shape(kv_cache)
    check_tensor("block_table", block_table, 2, torch.int32, device)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        fail("block_table", f"shape [batch={batch}, max_pages_per_seq >= 1]", f"shape {tuple(block_table.shape)}")
    if block_table.stride(-1) != 1 or block_table.stride(0) < 0:
        fail("block_table", "a contiguous last dimension", f"strides {tuple(block_table.stride())}")
    check_tensor("seq_lens", seq_lens, 1, torch.int32, device)
    if seq_lens.shape[0] != batch or not seq_lens.is_contiguous():
        fail("seq_lens", f"a contiguous tensor of shape [batch={batch}]", f"shape {tuple(seq_lens.shape)}, strides {tuple(seq_lens.stride())}")
    if not softmax_scale_ok(softmax_scale):
        fail("softmax_scale", SOFTMAX_SCALE_RANGE, shown(softmax_scale))
    check_k_scale(k_scale, kv_cache, device, softmax_scale)
    return fp8


def validate(q, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse, k_scale=None) -> Call:
    """Check every argument (raising MLAInputError naming it) and return the call; out/lse may stay None."""
    num_kv_splits_bad = num_kv_splits is not None and (
        isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_KV_SPLITS)
    if not num_kv_splits_bad:
        fast = fast_validate(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        if fast is not None:
            return fast
    # -- q ---------------------------------------------------------------------------------------
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            fail("q", "a tensor or the pair (q_nope, q_pe)", f"a sequence of {len(q)} items")
        q_nope, q_pe = q
        check_tensor("q_nope", q_nope, 4, tuple(Q_DTYPES))
        check_tensor("q_pe", q_pe, 4, q_nope.dtype, q_nope.device)
        if q_nope.shape[-1] != KV_LORA_RANK:
            fail("q_nope", f"last dimension {KV_LORA_RANK} (kv_lora_rank)", f"shape {tuple(q_nope.shape)}")
        if q_pe.shape[-1] != QK_ROPE_HEAD_DIM:
            fail("q_pe", f"last dimension {QK_ROPE_HEAD_DIM} (qk_rope_head_dim)", f"shape {tuple(q_pe.shape)}")
        if q_pe.shape[:3] != q_nope.shape[:3]:
            fail("q_pe", f"leading shape {tuple(q_nope.shape[:3])} (as q_nope)", f"{tuple(q_pe.shape[:3])}")
        q_arg = ("q_nope", "q_pe")
    else:
        check_tensor("q", q, 4, tuple(Q_DTYPES))
        if q.shape[-1] != HEAD_DIM:
            fail("q", f"last dimension {HEAD_DIM} (kv_lora_rank 512 + qk_rope_head_dim 64)", f"shape {tuple(q.shape)}")
        q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
        q_arg = ("q", "q")
    batch, q_len, num_heads, _ = q_nope.shape
    dtype, device = q_nope.dtype, q_nope.device
    if not 1 <= q_len <= MAX_Q_LEN:
        fail("q", f"q_len (dim 1) from 1 to {MAX_Q_LEN}", q_len)
    if num_heads < 1:
        fail("q", "num_heads (dim 2) >= 1", num_heads)

    fp8 = check_cache(kv_cache, block_table, seq_lens, softmax_scale, k_scale, batch, dtype, device, q_arg[0])

    # -- outputs -------------------------------------------------------------------------------
    if out is not None:
        check_tensor("out", out, 4, dtype, device)
        if tuple(out.shape) != (batch, q_len, num_heads, KV_LORA_RANK):
            fail("out", f"shape {(batch, q_len, num_heads, KV_LORA_RANK)}", f"shape {tuple(out.shape)}")
        check_layout("out", out, 4)
        check_no_overlap("out", out)
    if lse is not None:
        check_tensor("lse", lse, 3, torch.float32, device)
        if tuple(lse.shape) != (batch, num_heads, q_len):
            fail("lse", f"shape {(batch, num_heads, q_len)}", f"shape {tuple(lse.shape)}")
        if min(lse.stride(), default=0) < 0:
            fail("lse", "non-negative strides", f"strides {tuple(lse.stride())}")
        check_no_overlap("lse", lse)
    if num_kv_splits_bad:
        fail("num_kv_splits", f"an int from 1 to {MAX_KV_SPLITS}", shown(num_kv_splits))
    if device.type != "cuda":
        fail("q", "a CUDA tensor", f"a tensor on {device}")
    if batch:
        check_layout(q_arg[0], q_nope, 8)
        check_layout(q_arg[1], q_pe, 8)
        check_layout("kv_cache", kv_cache, 16 if fp8 else 8)
    c = fill_call(Call(), q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, out, lse, device.index)
    set_scale(c, kv_cache, k_scale)
    return c


def check_workspace_tensor(workspace, device: torch.device) -> None:
    """A caller's workspace is a dense tensor on the call's device (before anything reads its bytes)."""
    if not isinstance(workspace, torch.Tensor) or workspace.get_device() != device.index:
        fail("workspace", f"a tensor on {device}", type(workspace).__name__ if not isinstance(workspace, torch.Tensor) else workspace.device)
    if workspace.layout is not torch.strided or workspace.is_nested:
        fail("workspace", "a dense (strided) tensor", f"layout {workspace.layout}{' (nested)' if workspace.is_nested else ''}")


def check_workspace(workspace, need: int, device, what: str) -> None:
    check_workspace_tensor(workspace, device)
    nbytes = workspace.numel() * workspace.element_size()
    if not workspace.is_contiguous() or nbytes < need or workspace.data_ptr() % 16:
        fail("workspace", f"a contiguous, 16-byte aligned tensor of at least {need} bytes ({what})",
              f"{nbytes} bytes, contiguous={workspace.is_contiguous()}, data_ptr % 16 = {workspace.data_ptr() % 16}")


def debug_check(kv_cache, block_table, seq_lens, page_size: int) -> None:
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
        fail("seq_lens", f"values in [0, max_pages_per_seq * page_size = {capacity}]", f"{int(lens[b])} for request {b}")
    if flags[1]:
        b, j = (int(x) for x in bad_page.nonzero()[0])
        fail("block_table", f"page ids in [0, num_pages = {kv_cache.shape[0]}) for the pages a request uses",
              f"block_table[{b}, {j}] = {int(block_table[b, j])}")
