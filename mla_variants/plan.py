"""Plan once, run every step: the serving-engine API (CUDA-graph safe, no allocation per step).

An engine makes one MLADecodePlan per (num_heads, q_len, page_size, dtype, kv_dtype) for its largest batch. The
plan chooses the variants and the split count once and owns (or is given) a workspace of fixed address
and fixed size; ``run`` validates, then only launches: no allocation, no host synchronization, no
device-to-host copy. The kernel derives each request's key range from ``seq_lens`` on the device, so a
CUDA graph captured once replays correctly while lengths grow and the real batch shrinks; padded rows
with seq_len 0 cost one early-exiting CTA each and write out 0 / lse -inf.
"""
from __future__ import annotations

import torch

from . import _binding
import struct

from .api import (_DTYPES, FP8_DTYPE, MAX_KV_SPLITS, MAX_Q_LEN, _Call, _check_workspace, _choose, _current_stream, _fail, _launch,
                  _pack, _validate, workspace_size)

_STREAM = struct.Struct("@Q")


class MLADecodePlan:
    """A decode plan for batches of up to `max_batch` requests.

    Args:
      max_batch: the largest batch `run` will see (e.g. the largest CUDA-graph batch size).
      num_heads, page_size, q_len: fixed for the plan; dtype: the dtype of q and out, torch.bfloat16 or
        torch.float16.
      kv_dtype: the cache's dtype: None (the default) for a cache in `dtype`, or torch.float8_e4m3fn for
        an fp8 cache (with dtype torch.bfloat16; `run` then takes k_scale, as :func:`mla_variants.mla_decode`).
      max_seq_len: the longest sequence the engine serves (for the split heuristic).
      num_kv_splits: force the split count (1..256); default :func:`default_num_kv_splits` for max_batch.
      device: the CUDA device (default: the current one).
      workspace: an optional caller-owned device tensor of at least :attr:`workspace_bytes` bytes
        (see :func:`mla_variants.workspace_size`); otherwise the plan allocates one now.

    Attributes: num_kv_splits (chosen once), launches (the variants and head groups every step runs),
    workspace and workspace_bytes (its size, :func:`mla_variants.workspace_size` for max_batch).

    Raises MLAInputError for bad arguments, VariantNotCompiledError if no compiled variant serves them,
    LibraryNotBuiltError if nothing was built.
    """

    def __init__(self, max_batch: int, num_heads: int, page_size: int, *, q_len: int = 1,
                 dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None, max_seq_len: int = 131072,
                 num_kv_splits: int | None = None, device: torch.device | str | int | None = None,
                 workspace: torch.Tensor | None = None):
        for name, v, lo, hi in (("max_batch", max_batch, 1, 2**31 - 1), ("num_heads", num_heads, 1, 2**20),
                                ("page_size", page_size, 1, 2**20), ("q_len", q_len, 1, MAX_Q_LEN),
                                ("max_seq_len", max_seq_len, 1, 2**31 - 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                _fail(name, f"an int from {lo} to {hi}", repr(v))
        if dtype not in _DTYPES:
            _fail("dtype", "torch.bfloat16 or torch.float16", dtype)
        if kv_dtype is FP8_DTYPE and dtype is not torch.bfloat16:
            _fail("dtype", "torch.bfloat16 with kv_dtype torch.float8_e4m3fn (q and out are bf16)", dtype)
        if kv_dtype is not None and kv_dtype is not dtype and kv_dtype is not FP8_DTYPE:
            _fail("kv_dtype", f"None, {dtype} (the dtype of q) or torch.float8_e4m3fn", kv_dtype)
        if not torch.cuda.is_available():
            _fail("device", "a CUDA device (MLADecodePlan launches kernels)", "no CUDA device on this machine")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            _fail("device", "a CUDA device", self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if num_kv_splits is not None and (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
                                          or not 1 <= num_kv_splits <= MAX_KV_SPLITS):
            _fail("num_kv_splits", f"an int from 1 to {MAX_KV_SPLITS}", repr(num_kv_splits))
        self.max_batch, self.num_heads, self.page_size, self.q_len, self.dtype = max_batch, num_heads, page_size, q_len, dtype
        self.kv_dtype = kv_dtype or dtype
        shape = _Call.of_shape(max_batch, num_heads, q_len, page_size, dtype, self.device.index, -(-max_seq_len // page_size),
                               self.kv_dtype)
        self.launches, self.num_kv_splits = _choose(_binding.library(), shape, num_kv_splits, max_seq_len)
        self.workspace_bytes = workspace_size(max_batch, max(l.num_heads for l in self.launches), q_len, self.num_kv_splits)
        if workspace is None:
            workspace = torch.empty(max(self.workspace_bytes, 16), dtype=torch.uint8, device=self.device)
        else:
            _check_workspace(workspace, self.workspace_bytes, self.device, "MLADecodePlan.workspace_bytes")
        self.workspace = workspace

    def run(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
            *, out: torch.Tensor, lse: torch.Tensor, k_scale=None):
        """Launch one decode step on the current stream; same tensors as :func:`mla_variants.mla_decode`
        (q [batch, q_len, num_heads, 576] or (q_nope, q_pe) in the plan's dtype, kv_cache
        [num_pages, page_size, 576], block_table [batch, max_pages] int32, seq_lens [batch] int32),
        batch <= max_batch, and preallocated `out` [batch, q_len, num_heads, 512] (plan dtype) and `lse`
        [batch, num_heads, q_len] fp32 (run allocates nothing). An fp8 plan's cache is float8_e4m3fn and
        k_scale is required (cache value x k_scale = real value): a positive float, or a 1-element fp32
        device tensor that the kernel reads when it runs (a captured graph follows its value). Returns
        (out, lse).

        Raises MLAInputError for any argument mla_decode would reject, for out/lse missing, for a
        num_heads/page_size/q_len/dtype/kv_dtype other than the plan's, batch > max_batch or another device;
        RuntimeError with the CUDA error if a launch fails."""
        c = self._check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        if c.batch:
            _launch(c, self.launches, self.num_kv_splits, self.workspace, self.workspace_bytes)
        return out, lse

    def bind(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
             *, out: torch.Tensor, lse: torch.Tensor, k_scale=None) -> "BoundDecode":
        """Validate these exact tensors once and return a callable that launches the step with them.

        For engines that keep static buffers (the same q, block_table, seq_lens, out and lse every
        step, updated in place): calling the result costs one stream lookup and one C call per head
        group, the least host time an eager step can have. The tensors are held (kept alive) by the
        returned object; do not resize or reallocate them while it is in use. Same arguments, shapes and
        errors as :meth:`run`; a float k_scale is fixed at bind time (pass a device tensor to change it
        between steps); calling the result raises RuntimeError with the CUDA error if a launch fails."""
        c = self._check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        return BoundDecode(self, c)

    def _check(self, q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale):
        if out is None or lse is None:
            _fail("out" if out is None else "lse", "a preallocated tensor (MLADecodePlan.run allocates nothing)", None)
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype is not self.kv_dtype:
            _fail("kv_cache", f"{self.kv_dtype} (this plan's kv_dtype)", kv_cache.dtype)
        c = _validate(q, kv_cache, block_table, seq_lens, softmax_scale, None, out, lse, k_scale)
        if (c.num_heads, c.page_size, c.q_len, c.dtype) != (self.num_heads, self.page_size, self.q_len, self.dtype):
            _fail("q/kv_cache", f"num_heads={self.num_heads}, page_size={self.page_size}, q_len={self.q_len}, "
                                f"dtype={self.dtype} (this plan's)",
                  f"num_heads={c.num_heads}, page_size={c.page_size}, q_len={c.q_len}, dtype={c.dtype}")
        if c.batch > self.max_batch:
            _fail("q", f"batch <= the plan's max_batch={self.max_batch}", c.batch)
        if c.device_index != self.device.index:
            _fail("q", f"a tensor on the plan's device {self.device}", c.device)
        return c

    def __repr__(self) -> str:
        return (f"MLADecodePlan(max_batch={self.max_batch}, num_heads={self.num_heads}, page_size={self.page_size}, "
                f"q_len={self.q_len}, dtype={self.dtype}, kv_dtype={self.kv_dtype}, num_kv_splits={self.num_kv_splits}, "
                f"launches={[l.symbol for l in self.launches]}, workspace_bytes={self.workspace_bytes})")


class BoundDecode:
    """One decode step with fixed tensors (from :meth:`MLADecodePlan.bind`); call it to launch."""

    def __init__(self, plan: MLADecodePlan, call):
        self.plan, self._call = plan, call          # holds every tensor the packed pointers refer to
        self.out, self.lse = call.out, call.lse
        lib = _binding.library()
        packed = _pack(call, plan.launches, plan.num_kv_splits, plan.workspace, plan.workspace_bytes, 0)
        # the stream is the struct's last field: keep the rest, append the current stream per call
        self._launches = [(lib.launcher(symbol), args[:-8]) for symbol, args in packed] if call.batch else []
        self._device = call.device_index
        self._lib = lib

    def __call__(self):
        """Launch on the current stream; returns (out, lse)."""
        if self._device != torch.cuda.current_device():
            with torch.cuda.device(self._device):
                return self()
        tail = _STREAM.pack(_current_stream(self._device))
        for fn, head in self._launches:
            code = fn(head + tail)
            if code:
                self._lib.raise_for(code, "a bound MLA decode launch")
        return self.out, self.lse
