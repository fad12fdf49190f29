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

import struct
from typing import NamedTuple

from codegen.variant import FP8_FAST, ST_MAX_HEADS, PathFacts, call_dtype

from . import _binding
from .api import choose_launches, workspace_size
from .dispatch import VariantNotCompiledError
from .fp8 import FP8_DTYPE
from .launching import current_stream, launch, pack, sm_count
from .splits import fast_pieces, num_kv_splits_for
from .validation import MAX_KV_SPLITS, MAX_Q_LEN, Q_DTYPES, Call, check_disjoint, check_tensor, check_workspace, fail, \
    fp8_token, shown, validate

# The balanced schedule's fixed cost of a segment (a request's run of tiles on one CTA: its Q load,
# the pipeline's refill and its epilogue), in 64-key tiles of the kernel that runs it; the schedule
# kernel cuts the batch's tiles + this overhead per segment into equal runs. The fast fp8 kernel's
# tiles are cheaper and its epilogue dearer (docs/design.md section 7).
SCHEDULE_OVERHEAD_TILES = 3
SCHEDULE_OVERHEAD_TILES_FP8_FAST = 8

_STREAM = struct.Struct("@Q")


class ScheduledStep(NamedTuple):
    """What :meth:`MLADecodePlan.run` launches after the last :meth:`MLADecodePlan.schedule` (a diagnostic).

    batch: the scheduled batch. cut: "balanced" or "uniform" (:meth:`MLADecodePlan.scheduled_cut`).
    ctas: the CTAs a row block the schedule was cut for (the plan's sched_ctas); 0 for one request, which
    runs the uniform split with num_kv_splits splits (0 otherwise). per_segment: the launch runs one CTA
    per segment of the schedule (the transposed path, at most batch + ctas - 1 a row block) rather than
    one per run of tiles (codegen.variant.PathFacts.runs_segments)."""
    batch: int
    cut: str
    ctas: int
    num_kv_splits: int
    per_segment: bool


class MLADecodePlan:
    """A decode plan for batches of up to `max_batch` requests.

    Args:
      max_batch: the largest batch `run` will see (e.g. the largest CUDA-graph batch size).
      num_heads, page_size, q_len: fixed for the plan; dtype: the dtype of q and out, torch.bfloat16 or
        torch.float16.
      kv_dtype: the cache's dtype: None (the default) for a cache in `dtype`, or torch.float8_e4m3fn for
        an fp8 cache (with dtype torch.bfloat16; `run` then takes k_scale, as :func:`mla_variants.mla_decode`).
      fp8_mode: for an fp8 cache, "exact" (default) or "fast" (fp8 tensor-core math), as in
        :func:`mla_variants.mla_decode`; every step of the plan runs that mode.
      max_seq_len: the longest sequence the engine serves (for the split heuristic and the kernel choice;
        only speed depends on it).
      num_kv_splits: force the split count (1..256); default :func:`mla_variants.default_num_kv_splits` for max_batch.
      device: the CUDA device (default: the current one).
      workspace: an optional caller-owned device tensor of at least :attr:`workspace_bytes` bytes
        (:func:`mla_variants.workspace_size`; a balanced plan needs more, see `balanced`); otherwise the
        plan allocates one now.
      balanced: allow the balanced schedule (:meth:`schedule`; opt-in, max_batch <= 2**20). Such a plan's
        workspace_bytes also holds max_batch + sched_ctas partial results per row (:attr:`balanced` is
        False, and nothing grows, when the plan cannot balance: an fp8 cache in fp8_mode="exact" above 32
        heads, a 16-bit cache at 32 heads or fewer with more than 32 query rows a request (q_len x
        num_heads: the 64-row kernel of such variants has no scheduled form), several head groups, no
        split variant).

    Attributes: num_kv_splits (chosen once), launches (the variants and head groups every step runs),
    workspace and workspace_bytes (its size: :func:`mla_variants.workspace_size` for max_batch, or for a
    plan that balances the larger of that and (max_batch + sched_ctas) * q_len * num_heads * 513 * 4),
    balanced (whether :meth:`schedule` applies), sched_ctas (CTAs per query-row block of the
    schedule: SMs // row blocks; 0 when not balanced) and default_overhead_tiles (:meth:`schedule`'s
    overhead_tiles when none is given: SCHEDULE_OVERHEAD_TILES_FP8_FAST for fp8 fast mode's kernel, else
    SCHEDULE_OVERHEAD_TILES).

    Raises MLAInputError for bad arguments, VariantNotCompiledError if no compiled variant serves them,
    LibraryNotBuiltError if nothing was built.
    """

    def __init__(self, max_batch: int, num_heads: int, page_size: int, *, q_len: int = 1,
                 dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None, max_seq_len: int = 131072,
                 num_kv_splits: int | None = None, device: torch.device | str | int | None = None,
                 workspace: torch.Tensor | None = None, balanced: bool = False, fp8_mode: str = "exact"):
        for name, v, lo, hi in (("max_batch", max_batch, 1, 2**31 - 1), ("num_heads", num_heads, 1, 2**20),
                                ("page_size", page_size, 1, 2**20), ("q_len", q_len, 1, MAX_Q_LEN),
                                ("max_seq_len", max_seq_len, 1, 2**31 - 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                fail(name, f"an int from {lo} to {hi}", shown(v))
        if dtype not in Q_DTYPES:
            fail("dtype", "torch.bfloat16 or torch.float16", dtype)
        if kv_dtype is FP8_DTYPE and dtype is not torch.bfloat16:
            fail("dtype", "torch.bfloat16 with kv_dtype torch.float8_e4m3fn (q and out are bf16)", dtype)
        if kv_dtype is not None and kv_dtype is not dtype and kv_dtype is not FP8_DTYPE:
            fail("kv_dtype", f"None, {dtype} (the dtype of q) or torch.float8_e4m3fn", kv_dtype)
        if not torch.cuda.is_available():
            fail("device", "a CUDA device (MLADecodePlan launches kernels)", "no CUDA device on this machine")
        try:
            self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        except (RuntimeError, TypeError, ValueError, OverflowError):
            fail("device", "None, a torch.device, a device string such as 'cuda:0' or a CUDA device index", shown(device))
        if self.device.type != "cuda":
            fail("device", "a CUDA device", self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.index >= torch.cuda.device_count():
            fail("device", f"a CUDA device index below {torch.cuda.device_count()} (this machine's GPUs)", self.device)
        if num_kv_splits is not None and (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
                                          or not 1 <= num_kv_splits <= MAX_KV_SPLITS):
            fail("num_kv_splits", f"an int from 1 to {MAX_KV_SPLITS}", shown(num_kv_splits))
        self.max_batch, self.num_heads, self.page_size, self.q_len, self.dtype = max_batch, num_heads, page_size, q_len, dtype
        self.max_seq_len, self._forced_splits = max_seq_len, num_kv_splits
        self.kv_dtype = kv_dtype or dtype
        shape = Call.of_shape(max_batch, num_heads, q_len, page_size, dtype, self.device.index, -(-max_seq_len // page_size),
                               self.kv_dtype)
        shape.key_dtype = fp8_token(fp8_mode, self.kv_dtype)
        self.fp8_mode = fp8_mode
        self.launches, self.num_kv_splits = choose_launches(_binding.library(), shape, num_kv_splits, max_seq_len)
        self.workspace_bytes = workspace_size(max_batch, max(l.num_heads for l in self.launches), q_len, self.num_kv_splits)
        # The balanced schedule (schedule()): one launch of a split variant whose facts allow it (the 64-row
        # path of a 16-bit cache, or fp8 fast mode above 32 heads). Where no 64-row split variant of the
        # call's dtype has one (exact fp8), nothing is looked up, so nothing is JIT-built for it.
        if not isinstance(balanced, bool):
            fail("balanced", "a bool", shown(balanced))
        if balanced and max_batch > 2**20:
            fail("max_batch", "at most 2**20 with balanced=True", max_batch)
        self._balanced_asked = balanced
        self._sched_launches, self.sched_ctas, self._sched_batch = None, 0, 0
        self._sched_segments = False  # whether the scheduled launch reads the segment table (runs_segments)
        self.default_overhead_tiles = SCHEDULE_OVERHEAD_TILES  # schedule()'s overhead_tiles when not given
        # One schedule buffer per batch size scheduled: run(batch) (and a graph captured at that batch)
        # only ever reads the buffer made for its own batch.
        self._schedules: dict[int, torch.Tensor] = {}
        # A quick test before any lookup (which may JIT-build): the call's own head count, or a 64-row
        # variant that masks it (MLA_VARIANTS_JIT=0); the launched variant's facts decide below.
        call_key = call_dtype(shape.key_dtype, num_heads)
        if balanced and (PathFacts.of(num_heads, page_size, call_key, True).balances(num_heads * q_len)
                         or PathFacts.of(ST_MAX_HEADS + 1, page_size, call_key, True).balanced_schedule):
            try:
                sl = _binding.library().plan(num_heads, page_size, shape.key_dtype, True)
            except VariantNotCompiledError:
                sl = None
            if sl is not None and len(sl) == 1 and sl[0].facts.balances(sl[0].key[0] * q_len):
                if sl[0].key[2] == FP8_FAST:
                    self.default_overhead_tiles = SCHEDULE_OVERHEAD_TILES_FP8_FAST
                m_blocks = -(-sl[0].key[0] * q_len // sl[0].facts.rows_for(sl[0].key[0] * q_len))
                self._sched_launches = sl
                self._sched_segments = sl[0].facts.runs_segments(sl[0].key[0] * q_len)
                self.sched_ctas = max(1, sm_count(self.device.index) // m_blocks)
                # A step of one request runs the uniform split on the same variant (schedule()), split as
                # mla_decode would split it.
                one = num_kv_splits_for(sl[0].facts, 1, num_heads, q_len, max_seq_len, sm_count(self.device.index),
                                        variant_heads=sl[0].key[0])
                if sl[0].key[2] == FP8_FAST:
                    one = fast_pieces(sl[0].facts, one, 1, num_heads, q_len, max_seq_len, variant_heads=sl[0].key[0])
                self._one_request_splits = num_kv_splits or one
                # max_batch + sched_ctas pieces of partial results per row (workspace_size's per-split size).
                self.workspace_bytes = max(self.workspace_bytes,
                                           workspace_size(1, num_heads, q_len, max_batch + self.sched_ctas))
        if workspace is None:
            workspace = torch.empty(max(self.workspace_bytes, 16), dtype=torch.uint8, device=self.device)
        else:
            check_workspace(workspace, self.workspace_bytes, self.device, "MLADecodePlan.workspace_bytes")
        self.workspace = workspace

    @property
    def balanced(self) -> bool:
        """Whether :meth:`schedule` applies to this plan: made with balanced=True and one split variant whose
        launch has a scheduled form: the 64-row path with a 16-bit cache, the transposed path (at most 32
        heads and 32 query rows a request; one CTA per segment), or fp8_mode="fast" (the fast kernel's own
        scheduled instantiation; exact fp8 above 32 heads has none)."""
        return self._sched_launches is not None

    def schedule(self, seq_lens: torch.Tensor, *, max_seq_len: int | None = None,
                 overhead_tiles: int | None = None) -> bool:
        """Balance the next decode steps' work over the GPU for these seq_lens (call once per step, after
        seq_lens changed, before the step's layers call :meth:`run`): one small kernel on the current
        stream (graph capturable, no host synchronization) cuts the batch's 64-key tiles, plus
        `overhead_tiles` per segment (default: SCHEDULE_OVERHEAD_TILES, or SCHEDULE_OVERHEAD_TILES_FP8_FAST
        for fp8 fast mode), into equal runs, one per CTA, crossing request boundaries, so that
        neither a long request in a ragged batch nor a short batch leaves SMs idle (FlashMLA's
        get_mla_metadata and FlashInfer's plan do the same once per step). The kernel also prices the
        uniform split of this batch laid out on the same CTAs and keeps that cut instead when the balanced
        one is not clearly cheaper (templates/mla/schedule.cuh: busiest CTA's tiles + overhead per
        segment + a cost per shared-request piece); :meth:`scheduled_cut` tells which. From then on :meth:`run`
        launches that schedule (so does a step made by :meth:`bind`), with the batch len(seq_lens); a request whose tile count (ceil(seq_len /
        64)) differs at run time from the scheduled one gets NaN output, never a wrong finite one.

        seq_lens: int32 [batch] on the plan's device, batch <= max_batch. max_seq_len: the longest
        sequence a block_table row addresses (default: no bound; a larger seq_len counts 0 tiles here and
        gets NaN in run). Returns False (and changes nothing) for a balanced=True plan that cannot
        balance (see :attr:`balanced`). A batch of one request keeps the uniform split (its pieces are
        already equal): no kernel runs, and run and scheduled_cut treat the step as the uniform cut. The
        first call for a batch size allocates that size's schedule buffer, so make it before capturing a
        CUDA graph (a warm-up step does). Raises MLAInputError for a bad seq_lens,
        max_seq_len or overhead_tiles, a plan made without balanced=True, or a first call for a batch
        size during graph capture."""
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
            fail("seq_lens", "an int32 tensor [batch]", type(seq_lens).__name__ if not isinstance(seq_lens, torch.Tensor)
                  else f"{seq_lens.dtype} tensor of shape {tuple(seq_lens.shape)}")
        check_tensor("seq_lens", seq_lens, 1)  # dense, not a lazily negated view (as run checks it)
        if seq_lens.device != self.device or not seq_lens.is_contiguous():
            fail("seq_lens", f"a contiguous tensor on {self.device}", f"device {seq_lens.device}, strides {seq_lens.stride()}")
        batch = seq_lens.shape[0]
        if not 1 <= batch <= self.max_batch:
            fail("seq_lens", f"1 to max_batch={self.max_batch} requests", batch)
        if overhead_tiles is None:
            overhead_tiles = self.default_overhead_tiles
        if isinstance(overhead_tiles, bool) or not isinstance(overhead_tiles, int) or not 1 <= overhead_tiles <= 1 << 20:
            fail("overhead_tiles", "an int from 1 to 2**20", shown(overhead_tiles))
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or not 0 <= max_seq_len <= 2**31 - 1):
            fail("max_seq_len", "None or an int from 0 to 2**31 - 1", shown(max_seq_len))
        if not self._balanced_asked:
            fail("balanced", "a plan made with MLADecodePlan(..., balanced=True) to call schedule()", "balanced=False")
        if not self.balanced:
            return False
        if batch == 1:  # one request: the uniform split's pieces are already equal; no schedule kernel
            self._schedules[1] = None
            self._sched_batch = 1
            return True
        buf = self._schedules.get(batch)
        if buf is None:
            if torch.cuda.is_current_stream_capturing():
                fail("seq_lens", "a batch size scheduled once before graph capture (its buffer is allocated then)",
                      f"a first schedule() for batch {batch} during capture")
            n = _binding.library().cdll.mla_variants_schedule_ints(batch, self.sched_ctas)
            buf = self._schedules[batch] = torch.zeros(n, dtype=torch.int32, device=self.device)
        limit = 2**31 - 1 if max_seq_len is None else max_seq_len
        splits = self._forced_splits or num_kv_splits_for(self._sched_launches[0].facts, batch, self.num_heads,
                                                          self.q_len, min(self.max_seq_len, limit),
                                                          sm_count(self.device.index),
                                                          variant_heads=self._sched_launches[0].key[0])
        lib = _binding.library()
        with torch.cuda.device(self.device):
            code = lib.cdll.mla_variants_schedule(seq_lens.data_ptr(), batch, limit, self.sched_ctas, overhead_tiles,
                                                  splits, int(self._sched_segments), buf.data_ptr(),
                                                  current_stream(self.device.index))
        if code:
            lib.raise_for(code, "the balanced schedule kernel")
        self._sched_batch = batch
        return True

    def _check_scheduled_batch(self, batch: int) -> None:
        """A step after schedule() must have the scheduled batch (its schedule buffer describes that batch)."""
        if batch != self._sched_batch:
            fail("seq_lens", f"the batch of the last MLADecodePlan.schedule call ({self._sched_batch} requests)",
                  f"{batch} requests: call schedule(seq_lens) for this step first")

    def scheduled_cut(self) -> str | None:
        """Which cut the last :meth:`schedule` kept: "balanced" or "uniform" (the uniform split on the
        scheduled CTAs), None before any; reads the device (synchronizes: for diagnostics, not the step)."""
        if not self._sched_batch:
            return None
        if self._schedules[self._sched_batch] is None:
            return "uniform"
        offset = _binding.library().cdll.mla_variants_schedule_kind_offset(self._sched_batch, self.sched_ctas)
        return "uniform" if int(self._schedules[self._sched_batch][offset].item()) else "balanced"

    def scheduled_step(self) -> ScheduledStep | None:
        """What :meth:`run` launches after the last :meth:`schedule` (None before any): a
        :class:`ScheduledStep`. Reads the device like :meth:`scheduled_cut` (for diagnostics and
        benchmarks, not the step)."""
        if not self._sched_batch:
            return None
        if self._schedules[self._sched_batch] is None:  # one request: the uniform split, no schedule kernel
            return ScheduledStep(1, "uniform", 0, self._one_request_splits, False)
        return ScheduledStep(self._sched_batch, self.scheduled_cut(), self.sched_ctas, 0, self._sched_segments)

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

        After :meth:`schedule`, run launches the balanced schedule and the batch must be the scheduled one.

        Raises MLAInputError for any argument mla_decode would reject, for out/lse missing, for a
        num_heads/page_size/q_len/dtype/kv_dtype other than the plan's, batch > max_batch or another device,
        a batch other than the last schedule()'s; RuntimeError with the CUDA error if a launch fails."""
        c = self._check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        if c.batch:
            self._launch(c)
        return out, lse

    def _launch(self, c) -> None:
        """Launch a validated step: on the schedule made for its batch once :meth:`schedule` ran, else the
        plan's uniform split."""
        if self._sched_batch:
            self._check_scheduled_batch(c.batch)
            buf = self._schedules[c.batch]
            if buf is None:  # one request (schedule()): the uniform split
                launch(c, self._sched_launches, self._one_request_splits, self.workspace, self.workspace_bytes,
                       max_seq_len=self.max_seq_len)
            else:
                launch(c, self._sched_launches, 1, self.workspace, self.workspace_bytes, buf.data_ptr(),
                       self.sched_ctas)
        else:
            launch(c, self.launches, self.num_kv_splits, self.workspace, self.workspace_bytes,
                   max_seq_len=self.max_seq_len)

    def run_varlen(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   softmax_scale: float, *, query_start_loc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   k_scale=None):
        """One step with a different q_len per request (mla_variants/varlen.py), up to the plan's q_len.

        q: [total_q_tokens, num_heads, 576] (or the pair) in the plan's dtype, request b's tokens at rows
        query_start_loc[b] .. query_start_loc[b + 1] - 1; query_start_loc: [batch + 1] int32 on the
        device (0 first, non-decreasing, at most total_q_tokens last; a request's q_len 0..plan.q_len);
        out: [total_q_tokens, num_heads, 512]; lse: [num_heads, total_q_tokens] fp32; the rest as
        :meth:`run`. The kernels read the packed layout themselves (the plan's uniform launch with
        q_len rows per request), so nothing is allocated and a captured graph follows new
        query_start_loc and seq_lens values. A request longer than the plan's q_len, tokens past
        query_start_loc[-1], and every token of a malformed query_start_loc get NaN rows. Returns (out, lse).
        Raises what :meth:`run` raises, and MLAInputError for a malformed varlen argument."""
        from .varlen import native_call
        if out is None or lse is None:
            fail("out" if out is None else "lse", "a preallocated tensor (MLADecodePlan.run_varlen allocates nothing)", None)
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype is not self.kv_dtype:
            fail("kv_cache", f"{self.kv_dtype} (this plan's kv_dtype)", kv_cache.dtype)
        first = q[0] if isinstance(q, (tuple, list)) and len(q) == 2 else q
        if isinstance(first, torch.Tensor) and first.dim() == 3 and (
                first.shape[1] != self.num_heads or first.dtype != self.dtype or first.device != self.device):
            fail("q", f"[total_q_tokens, num_heads={self.num_heads}, ...] {self.dtype} on {self.device} (this plan's)",
                 f"num_heads={first.shape[1]}, {first.dtype} on {first.device}")
        if query_start_loc is not None and isinstance(query_start_loc, torch.Tensor) and query_start_loc.dim() == 1 \
                and query_start_loc.shape[0] - 1 > self.max_batch:
            fail("query_start_loc", f"at most max_batch + 1 = {self.max_batch + 1} entries", query_start_loc.shape[0])
        c = native_call(q, kv_cache, block_table, seq_lens, softmax_scale, query_start_loc, self.q_len, out, lse,
                        k_scale, inputs=(("workspace", self.workspace),))
        if c.page_size != self.page_size:
            fail("kv_cache", f"page_size={self.page_size} (this plan's)", c.page_size)
        if c.total_q_tokens:
            self._launch(c)
        return out, lse

    def bind(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
             *, out: torch.Tensor, lse: torch.Tensor, k_scale=None) -> "BoundDecode":
        """Validate these exact tensors once and return a callable that launches the step with them.

        For engines that keep static buffers (the same q, block_table, seq_lens, out and lse every
        step, updated in place): calling the result costs one stream lookup and one C call per head
        group, the least host time an eager step can have. The tensors are held (kept alive) by the
        returned object; do not resize or reallocate them while it is in use. Same arguments, shapes and
        errors as :meth:`run`; a float k_scale is fixed at bind time (pass a device tensor to change it
        between steps); calling the result raises RuntimeError with the CUDA error if a launch fails. A
        bound step follows :meth:`schedule` as :meth:`run` does (same batch rule)."""
        c = self._check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale)
        return BoundDecode(self, c)

    def _check(self, q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, k_scale):
        if out is None or lse is None:
            fail("out" if out is None else "lse", "a preallocated tensor (MLADecodePlan.run allocates nothing)", None)
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype is not self.kv_dtype:
            fail("kv_cache", f"{self.kv_dtype} (this plan's kv_dtype)", kv_cache.dtype)
        c = validate(q, kv_cache, block_table, seq_lens, softmax_scale, None, out, lse, k_scale)
        check_disjoint(c, not isinstance(q, torch.Tensor), k_scale,
                        (("out", out), ("lse", lse), ("workspace (the plan's)", self.workspace)))
        if (c.num_heads, c.page_size, c.q_len, c.dtype) != (self.num_heads, self.page_size, self.q_len, self.dtype):
            fail("q/kv_cache", f"num_heads={self.num_heads}, page_size={self.page_size}, q_len={self.q_len}, "
                                f"dtype={self.dtype} (this plan's)",
                  f"num_heads={c.num_heads}, page_size={c.page_size}, q_len={c.q_len}, dtype={c.dtype}")
        if c.batch > self.max_batch:
            fail("q", f"batch <= the plan's max_batch={self.max_batch}", c.batch)
        if c.device_index != self.device.index:
            fail("q", f"a tensor on the plan's device {self.device}", c.device)
        return c

    def __repr__(self) -> str:
        return (f"MLADecodePlan(max_batch={self.max_batch}, num_heads={self.num_heads}, page_size={self.page_size}, "
                f"q_len={self.q_len}, dtype={self.dtype}, kv_dtype={self.kv_dtype}, fp8_mode={self.fp8_mode!r}, "
                f"num_kv_splits={self.num_kv_splits}, "
                f"launches={[l.symbol for l in self.launches]}, workspace_bytes={self.workspace_bytes})")


class BoundDecode:
    """One decode step with fixed tensors (from :meth:`MLADecodePlan.bind`); call it to launch."""

    def __init__(self, plan: MLADecodePlan, call):
        self.plan, self._call = plan, call          # holds every tensor the packed pointers refer to
        self.out, self.lse = call.out, call.lse
        lib = _binding.library()
        packed = pack(call, plan.launches, plan.num_kv_splits, plan.workspace, plan.workspace_bytes, 0,
                       max_seq_len=plan.max_seq_len)
        # the stream is the struct's last field: keep the rest, append the current stream per call
        self._launches = [(lib.launcher(symbol), args[:-8]) for symbol, args in packed] if call.batch else []
        # The same step on the balanced schedule, used while the plan holds one for this batch
        # (MLADecodePlan.schedule); packed on first use, once that batch's schedule buffer exists.
        self._sched_launches = None
        self._batch = call.batch
        self._device = call.device_index
        self._lib = lib

    def __call__(self):
        """Launch on the current stream; returns (out, lse)."""
        if self._device != torch.cuda.current_device():
            with torch.cuda.device(self._device):
                return self()
        tail = _STREAM.pack(current_stream(self._device))
        launches = self._launches
        if self._batch and self.plan._sched_batch:
            self.plan._check_scheduled_batch(self._batch)
            if self._sched_launches is None:
                plan = self.plan
                buf = plan._schedules[self._batch]
                packed = (pack(self._call, plan._sched_launches, plan._one_request_splits, plan.workspace,
                               plan.workspace_bytes, 0, max_seq_len=plan.max_seq_len) if buf is None else
                          pack(self._call, plan._sched_launches, 1, plan.workspace, plan.workspace_bytes, 0,
                               buf.data_ptr(), plan.sched_ctas))
                self._sched_launches = [(self._lib.launcher(symbol), args[:-8]) for symbol, args in packed]
            launches = self._sched_launches
        for fn, head in launches:
            code = fn(head + tail)
            if code:
                self._lib.raise_for(code, "a bound MLA decode launch")
        return self.out, self.lse
