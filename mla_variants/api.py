"""mla_decode: one MLA decode step over a paged latent KV cache, dispatched to a compiled variant.

Math: for each request b, query token i and head h, with keys j < seq_lens[b] - (q_len - 1 - i)
(causal, bottom-right aligned; all keys when q_len == 1):
    s_j   = softmax_scale * <q[b, i, h, :576], kv[j, :576]>
    lse   = log(sum_j exp(s_j))                       (natural log; -inf when no key is visible)
    out   = sum_j exp(s_j - lse) * kv[j, :512]        (0 when no key is visible)
which is multi-head latent attention with the absorbed up-projections (DeepSeek-V2, arXiv:2405.04434,
section 2.1) computed with the online softmax of FlashAttention-2 (arXiv:2307.08691) and split-KV
log-sum-exp merging (flash-decoding).

One call: validation.py checks the arguments, dispatch.py picks the variants (from the build's
manifest), splits.py the split count, launching.py packs and launches.
"""
from __future__ import annotations

import torch

from . import _binding, launching
from .dispatch import is_supported as table_supports
from .launching import sm_count
from .splits import choose
from .validation import (DTYPE_TOKEN, DTYPE_TOKENS, KV_LORA_RANK, Call, apply_fp8_mode, check_disjoint, check_workspace,
                         check_workspace_tensor, debug_check, fail, shown, validate)


def workspace_size(batch: int, num_heads: int, q_len: int, num_kv_splits: int) -> int:
    """Bytes of split-KV workspace one call needs: num_kv_splits * batch * q_len * num_heads * (512 + 1)
    fp32 values, 4 bytes each (per split: the normalised partial output and its lse). 0 when
    num_kv_splits == 1. num_heads is the head count the call launches: a count that runs masked on a
    larger compiled one (MLA_VARIANTS_JIT=0) needs that larger count's size (MLADecodePlan sizes its
    own workspace right). batch >= 0; num_heads, q_len, num_kv_splits >= 1 (ints).
    Raises MLAInputError naming the argument otherwise."""
    for name, v in (("batch", batch), ("num_heads", num_heads), ("q_len", q_len), ("num_kv_splits", num_kv_splits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "batch" else 1):
            fail(name, "a non-negative int" if name == "batch" else "a positive int", shown(v))
    if num_kv_splits == 1:
        return 0
    return num_kv_splits * batch * q_len * num_heads * (KV_LORA_RANK + 1) * 4


def mla_decode(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
               *, num_kv_splits: int | None = None, max_seq_len: int | None = None, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, workspace: torch.Tensor | None = None, debug: bool = False,
               k_scale=None, tma: str = "auto", fp8_mode: str = "exact"):
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
      num_kv_splits: force the split count (1..256); default :func:`mla_variants.default_num_kv_splits`.
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
      fp8_mode: float8_e4m3fn caches only: "exact" (default; the fp8_e4m3 variants, fp16 tensor-core
        math on exactly widened cache values, as described under k_scale) or "fast" (the fp8_e4m3_fast
        variants, fp8 tensor-core math: each query row is rounded to e4m3 with its own power-of-2 scale
        and P to e4m3 times 2^8, accumulation in fp32; docs/design.md 3.3 has the error model and
        README the tolerance); at 32 heads or fewer "fast" runs the fp8_e4m3 variants, and a launch whose
        splits hold at most 128 keys runs the exact short-split kernel; both give exact mode's results
        (codegen.variant.call_dtype, PathFacts). "fast" with a 16-bit cache is an MLAInputError naming fp8_mode.
      out, lse, workspace: when given, must not share memory with q, kv_cache, block_table, seq_lens,
        k_scale or each other (MLAInputError otherwise).
      tma: how kernels that load whole 64-token pages by TMA (the 64-row kernels at page sizes that are
        multiples of 64) load them: "auto" (default) by TMA where the cache's tensor map can be encoded,
        else by cp.async; "off" always by cp.async; "require" fails (RuntimeError, CUDA error 801,
        cudaErrorNotSupported) where such a kernel cannot encode the map. Launches whose kernel has no
        TMA path (the transposed path, other page sizes, the fp8 short-split kernel) ignore it; the
        variant's path facts (mla_variants._binding.library().facts) say which kernels have one. The
        results are the same bits either way; "off" and "require" are for tests and measurements.
    Returns:
      (out [batch, q_len, num_heads, 512] in q's dtype, lse [batch, num_heads, q_len] fp32, natural log).

    Raises:
      MLAInputError (a ValueError) naming the argument for any wrong shape, dtype, device, stride or value;
      VariantNotCompiledError when no compiled variant serves (page_size, dtype); LibraryNotBuiltError
      when the kernels were never built; RuntimeError carrying the CUDA error when a launch fails.
    """
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or not 1 <= max_seq_len <= 2**31 - 1):
        fail("max_seq_len", "None or an int from 1 to 2**31 - 1 (an upper bound of seq_lens)", shown(max_seq_len))
    if debug is not False and debug is not True:
        fail("debug", "a bool", shown(debug))
    tma_code = launching.tma_mode(tma)
    c = validate(q, kv_cache, block_table, seq_lens, softmax_scale, num_kv_splits, out, lse, k_scale)
    apply_fp8_mode(c, fp8_mode)
    if workspace is not None:
        check_workspace_tensor(workspace, c.device)
    if out is not None or lse is not None or workspace is not None:
        check_disjoint(c, not isinstance(q, torch.Tensor), k_scale, (("out", out), ("lse", lse), ("workspace", workspace)))
    if c.out is None:
        c.out = torch.empty((c.batch, c.q_len, c.num_heads, KV_LORA_RANK), dtype=c.dtype, device=c.device)
    if c.lse is None:
        c.lse = torch.empty((c.batch, c.num_heads, c.q_len), dtype=torch.float32, device=c.device)
    if c.batch == 0:
        return c.out, c.lse
    run_validated(c, num_kv_splits, max_seq_len, debug, workspace, tma_code)
    return c.out, c.lse


def run_validated(c: Call, num_kv_splits: int | None, max_seq_len: int | None, debug: bool,
                  workspace: torch.Tensor | None = None, tma_code: int = 0) -> None:
    """Launch a validated call of at least one request (mla_decode, mla_decode_varlen): its launches and
    split count (choose_launches), debug's host checks of block_table and seq_lens, the workspace
    (allocated here, or the caller's, checked against the size the launches need), the launch."""
    launches, num_kv_splits = choose_launches(_binding.library(), c, num_kv_splits, max_seq_len)
    if debug:
        debug_check(c.kv_cache, c.block_table, c.seq_lens, c.page_size)
    need = workspace_size(c.batch, max(l.num_heads for l in launches), c.q_len, num_kv_splits)
    if need:
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.uint8, device=c.device)
        else:
            check_workspace(workspace, need, c.device,
                             f"workspace_size(batch={c.batch}, num_heads, q_len={c.q_len}, num_kv_splits={num_kv_splits})")
    launching.launch(c, launches, num_kv_splits, workspace, need, max_seq_len=max_seq_len or 0, tma=tma_code)


def choose_launches(lib, c: Call, num_kv_splits: int | None, max_seq_len: int | None):
    """(launches, num_kv_splits) for a validated call: a forced split count must be served as asked, else
    splits.choose (the heuristic on the split variant's path facts)."""
    if num_kv_splits is not None:
        return lib.plan(c.num_heads, c.page_size, c.key_dtype, num_kv_splits > 1), num_kv_splits
    capacity = c.max_pages * c.page_size  # the launcher bounds max_seq_len by it too
    bound = capacity if max_seq_len is None else min(max_seq_len, capacity)
    return choose(lib, c.num_heads, c.page_size, c.key_dtype, c.batch, c.q_len, bound, sm_count(c.device_index))


def list_variants() -> list[tuple[int, int, str, bool]]:
    """The compiled (num_heads, page_size, dtype, split) keys of the loaded library (the AOT build plus
    the JIT-built variants this process has loaded), sorted. Raises LibraryNotBuiltError when nothing
    was built and the JIT is off."""
    return sorted(_binding.library().table)


def is_supported(num_heads: int, page_size: int, dtype, split: bool = False) -> bool:
    """Whether a call with these parameters can be served by the variants loaded now, without compiling
    (dtype: torch dtype or 'bf16'/'fp16'/'fp8_e4m3'/'fp8_e4m3_fast', where torch.float8_e4m3fn means the
    exact fp8 cache variants and 'fp8_e4m3_fast' the fast ones; masked head counts and head groups count
    as served). With the JIT on (the default), a call that this says False for compiles its variant on
    first use instead of failing. Raises MLAInputError for num_heads or page_size that is not an int from
    1 to 2**20 (MLADecodePlan's bounds), a split that is not a bool, or a dtype that is none of these;
    LibraryNotBuiltError when nothing was built and the JIT is off. A variant ensure_variant built into
    the cache counts once a call of this process has loaded it."""
    for name, v in (("num_heads", num_heads), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**20:
            fail(name, "an int from 1 to 2**20", shown(v))
    if not isinstance(split, bool):
        fail("split", "a bool", shown(split))
    key = DTYPE_TOKEN.get(dtype, dtype) if isinstance(dtype, (torch.dtype, str)) else None
    if key not in DTYPE_TOKENS:
        fail("dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn or 'bf16'/'fp16'/'fp8_e4m3'/'fp8_e4m3_fast'",
             shown(dtype))
    return table_supports(_binding.library().table, num_heads, page_size, key, split)
