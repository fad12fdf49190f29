"""Benchmark mla_decode against the best peer kernel on the anchor cases.

Usage (from the repository root, on an sm_90a GPU, after ``mla-variants build``):

    python benchmarks/bench.py                      # every anchor case, 50 cold reps each
    python benchmarks/bench.py --quick --limit 8    # smoke test
    python benchmarks/bench.py --heads 128 --page 64 --batch 1,8 --check
    python benchmarks/bench.py --anchors PATH --json out.json --num-kv-splits 4
    python benchmarks/bench.py --plot roofline.png   # also draw the run on the H200 roofline
    python benchmarks/bench.py --from-json docs/bench/consolidation-after.json --plot roofline.png  # no GPU
    python benchmarks/bench.py --mode bf16_q2 --q-len 4 --vs-q1   # the q_len-2 cases' shapes at q_len 4
    python benchmarks/bench.py --mode bf16_q2 --varlen 1,2,3,4    # q_lens mixed per request (varlen)

Cases come from ``<repo>/../shared/anchors-h200.json`` (or ``<repo>/shared/``, or ``--anchors PATH``): each holds num_heads,
batch, page_size, the exact seq_lens and the best peer's cold and CUDA-graph times. Without that file
the same grid is generated here (heads {16,32,64,128} x batch {1,8,32,128} x seq {1024,4096,16384} x
page {1,16,64,128}, plus ragged batches), with no peer numbers to compare against.

Timing follows the anchors' method:
  cold  : before each call the L2 is flushed by reading a 512 MiB buffer; the call alone is timed
          between two CUDA events; median of --reps (default 50) after warm-up. A ~0.5 ms GPU spin
          queued after the flush keeps the host's launch cost out of the measured interval.
  graph : 20 back-to-back calls captured in one CUDA graph (outputs, workspace and num_kv_splits fixed
          beforehand so nothing allocates during capture); each replay is timed with CUDA events and
          the median replay time / 20 is reported.
  code-warm (--code-warm, a diagnostic): as cold, but after each flush an untimed call of the same
          kernels (same heads, page size, dtype and split count) on a separate one-request case of
          64 keys per split brings their instructions back into L2, so cold minus code-warm is what
          fetching the kernels' code from DRAM costs a cold call (its inputs and outputs stay cold).
Each case's KV pool is filled on the device (random values, pages randomly permuted over one pool,
NaN in every cache slot no request uses), so building even the 2.4 GB cases takes milliseconds.

Derived numbers (from the cold time): TB/s = (sum(seq_lens) * 576 + q + out elements) * element size
/ time; TFLOP/s = 2 * sum(seq_lens) * heads * q_len * (576 + 512) / time, each also as a percentage of
the ceilings measured with the anchors (HBM read 4.463 TB/s, bf16 matmul 785.9 TFLOP/s by default).
"peer/ours" > 1 means this library is faster than the best peer.

Serving modes without peer times (the peers' q_len is the case's own):
  --q-len N  runs the selected cases' shapes at q_len N (1-8); with --vs-q1 each case is also timed at
             q_len 1, and "q1 ratio" = cold time at N / cold time at 1.
  --varlen L runs each case with request b's q_len = L[b % len(L)] through mla_decode_varlen (max_q_len
             = max(L)), and times the same case at each uniform q_len of L. The sum-of-work model is
             T_model = sum over q in L of (requests with q_len q / batch) x T_uniform(q): each request
             costs its share of a uniform batch of its q_len. "varlen ratio" = T_varlen / T_model.

Results (rows, summary and environment) are written to --json, by default
``<repo>/bench-results/bench-<timestamp>.json``.

--plot OUT.png draws the cases on a roofline (matplotlib, the optional extra: pip install -e ".[plot]"):
achieved TFLOP/s and HBM TB/s of ours and of the best peer's cold time against arithmetic intensity
(the FLOPs and bytes above), under the run's ceilings and the H200 datasheet's (4.8 TB/s, 989 TFLOP/s
dense bf16). With --from-json RESULTS.json it draws a recorded run instead of
running one, on any machine.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # use this checkout's package (and its generated/ + build/)

import torch  # noqa: E402

from mla_variants import (LibraryNotBuiltError, MLADecodePlan, default_num_kv_splits, is_supported, list_variants,  # noqa: E402
                          mla_decode, mla_decode_reference, mla_decode_varlen, mla_decode_varlen_reference,
                          workspace_size)
from mla_variants.testing import FP8_FAST_TOLERANCE, FP8_TOLERANCE, compare  # noqa: E402
from codegen.variant import call_dtype  # noqa: E402

HEAD_DIM = 576        # kv_lora_rank 512 + qk_rope_head_dim 64
V_DIM = 512
SOFTMAX_SCALE = (128 + 64) ** -0.5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}  # the cache dtype
K_SCALE = 0.5  # fp8 mode: the cache holds real / K_SCALE (q and out bf16)
FP8_MODE = "exact"  # --fp8-mode: how an fp8 cache is multiplied (mla_decode's fp8_mode; main sets it)
TMA_MODE = "auto"  # --tma: how the 64-row kernels load whole pages (mla_decode's tma; main sets it)
DEFAULT_CEILINGS = {"read_tbps": 4.463, "bf16_matmul_tflops": 785.9}
FLUSH_BYTES = 512 << 20
SPIN_CYCLES = 1_000_000  # ~0.5 ms at the H200's clock, queued after each flush (see L2Flush)
GRAPH_CALLS = 20      # calls captured per CUDA graph
EXTRA_PAGES = 3       # unused (NaN) pages in each pool
CHECK_FULL_TOKENS = 1 << 20   # --check: every request when sum(seq_lens) <= this, else a subset
CHECK_SUBSET = 8


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------

def default_anchors_path(name: str = "anchors-h200.json") -> Path:
    """<repo>/../shared/<name>, else <repo>/shared/<name> (a copy next to the code)."""
    candidates = [REPO.parent / "shared" / name, REPO / "shared" / name]
    return next((c for c in candidates if c.is_file()), candidates[0])


def default_anchors_name(dtype: str, mode: str | None) -> str:
    """The team's anchors file for a run: fp8 caches and any q_len-2+ mode live in the modes file."""
    modes = dtype == "fp8_e4m3" or (mode is not None and mode != "bf16_q1")
    return "anchors-h200-modes.json" if modes else "anchors-h200.json"


def generated_grid(seed: int = 0) -> list[dict]:
    """The anchor grid without peer numbers; ragged batches (normal around the mean, sd 25%, >= 1)
    for heads {16, 128} x batch 32 x seq 4096 at every page size, as in the anchors."""
    cases = []
    for heads in (16, 32, 64, 128):
        for batch in (1, 8, 32, 128):
            for seq in (1024, 4096, 16384):
                for page in (1, 16, 64, 128):
                    cases.append(dict(num_heads=heads, batch=batch, seq_mean=seq, page_size=page,
                                      ragged=False, seq_lens=[seq] * batch))
    for heads in (16, 128):
        rng = random.Random(seed * 1000 + heads)
        batch, seq = 32, 4096
        lens = [max(1, round(rng.gauss(seq, 0.25 * seq))) for _ in range(batch)]
        for page in (1, 16, 64, 128):
            cases.append(dict(num_heads=heads, batch=batch, seq_mean=seq, page_size=page,
                              ragged=True, seq_lens=list(lens)))
    return cases


def load_cases(args) -> tuple[list[dict], dict, str | None]:
    """(cases, anchor metadata, anchors path or None when the grid was generated)."""
    path = Path(args.anchors) if args.anchors else default_anchors_path(default_anchors_name(args.dtype, args.mode))
    if path.is_file():
        data = json.loads(path.read_text())
        cases = []
        # A file of several modes (anchors-h200-modes.json) keeps the cases of --mode, by default the
        # one matching --dtype at q_len 1 (fp8_q1 for fp8_e4m3, else bf16_q1).
        mode = args.mode or ("fp8_q1" if args.dtype == "fp8_e4m3" else "bf16_q1")
        if args.mode not in (None, "bf16_q1") and not any(c.get("mode") == args.mode for c in data["cases"]):
            sys.exit(f"--mode {args.mode}: {path} has no case of that mode (modes there: "
                     f"{sorted({c['mode'] for c in data['cases'] if 'mode' in c}) or 'none'})")
        for c in data["cases"]:
            if "mode" in c and c["mode"] != mode:
                continue
            if "kv_dtype" in c and (c["kv_dtype"] == "fp8") != (args.dtype == "fp8_e4m3"):
                sys.exit(f"--dtype {args.dtype}: {path}'s {mode} cases have a {c['kv_dtype']} cache "
                         f"(their peer times would not compare)")
            c = dict(c)
            c.setdefault("seq_lens", [c["seq_mean"]] * c["batch"])
            cases.append(c)
        meta = {k: v for k, v in data.items() if k != "cases"}
        return cases, meta, str(path)
    if args.anchors:
        sys.exit(f"--anchors {path}: no such file")
    if args.mode not in (None, "bf16_q1"):
        sys.exit(f"--mode {args.mode}: no anchors file at {path} (the generated grid has q_len 1 only)")
    print(f"note: no anchors file at {path}; generating the grid (no peer numbers)", flush=True)
    return generated_grid(), {}, None


def cases_q_len(cases: list[dict], meta: dict) -> int:
    """The q_len of a run: each case's own "q_len" (the modes file gives it per case), else the
    anchors file's top-level one, else 1 (also for no cases). A run measures one q_len (1 to 8); cases
    that mix them, or a value out of range, exit with a message."""
    q_lens = {c.get("q_len", meta.get("q_len", 1)) for c in cases} or {meta.get("q_len", 1)}
    bad = [q for q in q_lens if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 8]
    if bad:
        sys.exit(f"anchors: q_len must be an int from 1 to 8, got {bad[0]!r}")
    if len(q_lens) != 1:
        sys.exit(f"the selected cases mix q_len {sorted(q_lens)}: select one --mode")
    return q_lens.pop()


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def select_cases(cases: list[dict], args) -> list[dict]:
    keep = []
    for c in cases:
        if args.heads and c["num_heads"] not in args.heads:
            continue
        if args.batch and c["batch"] not in args.batch:
            continue
        if args.seq and c["seq_mean"] not in args.seq:
            continue
        if args.page and c["page_size"] not in args.page:
            continue
        if args.ragged is not None and bool(c.get("ragged")) != args.ragged:
            continue
        keep.append(c)
    return keep[: args.limit] if args.limit else keep


# ------------------------------------------------------------------------------------------------
# Inputs, built on the device
# ------------------------------------------------------------------------------------------------

class KVPool:
    """One flat device buffer reused by every case (grown when a case needs more): a case views its
    first num_pages * page_size rows as [num_pages, page_size, 576] and refills them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf: torch.Tensor | None = None

    def view(self, num_pages: int, page_size: int, dtype: torch.dtype) -> torch.Tensor:
        rows = num_pages * page_size
        if self.buf is None or self.buf.dtype != dtype or self.buf.shape[0] < rows:
            self.buf = None  # free the old pool before allocating the larger one
            self.buf = torch.empty(rows, HEAD_DIM, dtype=dtype, device=self.device)
        return self.buf[:rows].view(num_pages, page_size, HEAD_DIM)


def build_inputs(pool: KVPool, seq_lens: list[int], num_heads: int, page_size: int, q_len: int,
                 dtype: torch.dtype, gen: torch.Generator) -> dict:
    """q, kv_cache, block_table and seq_lens for one case. Pages are a random permutation of the pool;
    unused pages and the slots past each request's last token are NaN; table entries past a
    request's last page are 0 (never read)."""
    device = pool.device
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    pages_per = (lens + page_size - 1) // page_size
    width = max(int(pages_per.max()), 1)
    used_pages = int(pages_per.sum())
    num_pages = used_pages + EXTRA_PAGES
    batch = len(seq_lens)

    kv = pool.view(num_pages, page_size, dtype)
    fp8 = dtype == torch.float8_e4m3fn
    if fp8:  # real N(0, 0.1^2) values stored as real / K_SCALE, written in chunks through bf16
        flat = kv.view(-1, HEAD_DIM)
        for start in range(0, flat.shape[0], 1 << 20):
            chunk = flat[start:start + (1 << 20)]
            chunk.copy_(torch.empty(chunk.shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.1 / K_SCALE, generator=gen))
    else:
        kv.normal_(0.0, 0.1, generator=gen)
    nan_of = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    nan = 0x7F if fp8 else float("nan")  # the e4m3 NaN byte
    perm = torch.randperm(num_pages, device=device, generator=gen)

    pages_dev = pages_per.to(device)
    starts = torch.cumsum(pages_dev, 0) - pages_dev
    col = torch.arange(width, device=device)
    in_use = col[None, :] < pages_dev[:, None]
    idx = (starts[:, None] + col[None, :]).clamp_(max=num_pages - 1)
    block_table = torch.where(in_use, perm[idx], torch.zeros_like(idx)).to(torch.int32).contiguous()
    del idx, in_use

    # Poison: the extra pages, and the tail of each request's last page.
    nan_of(kv)[perm[used_pages:]] = nan
    rem = (lens % page_size).to(device)
    has_tail = (rem > 0) & (pages_dev > 0)
    if bool(has_tail.any()):
        last = block_table.gather(1, (pages_dev - 1).clamp(min=0)[:, None]).squeeze(1).long()
        slot = torch.arange(page_size, device=device)
        tail = has_tail[:, None] & (slot[None, :] >= rem[:, None])
        nan_of(kv)[last[:, None].expand(batch, page_size)[tail], slot.expand(batch, page_size)[tail]] = nan

    q_dtype = torch.bfloat16 if fp8 else dtype
    q = torch.empty(batch, q_len, num_heads, HEAD_DIM, dtype=q_dtype, device=device).normal_(0.0, 0.1, generator=gen)
    return dict(q=q, kv_cache=kv, block_table=block_table,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

class L2Flush:
    """Reads a 512 MiB buffer (a sum: read-dominated, one scalar written) to evict the 50 MB L2, then
    queues a short GPU spin (no memory traffic) so the GPU is still busy when the timed call is
    launched: the Python cost of preparing the launch then never shows up in the kernel's time."""

    def __init__(self, device: torch.device):
        self.buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        torch.sum(self.buf)
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SPIN_CYCLES)
        else:  # no spin kernel in this torch: a second read keeps the GPU busy as well
            torch.sum(self.buf)


def time_cold(fn, flush: L2Flush, reps: int, warmup: int, after_flush=None) -> float:
    """Median microseconds of fn() with the L2 flushed before each call; after_flush (untimed) runs
    between the flush and the timed call (--code-warm: a small call that fetches the kernels' code)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        if after_flush is not None:
            after_flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def time_graph(fn, replays: int, warmup: int) -> float:
    """Median microseconds per call of GRAPH_CALLS back-to-back calls replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream before capture (torch docs)
        for _ in range(max(warmup, 2)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()  # one untimed replay
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    t = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)) / GRAPH_CALLS
    del graph
    return t


def host_overhead_us(inputs: dict, num_kv_splits: int, n: int = 300, rounds: int = 3) -> dict:
    """Host time of one eager mla_decode call (issue only: no synchronization inside the loop);
    the best of `rounds` averages over n calls."""
    args = (inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], SOFTMAX_SCALE)
    batch, q_len, heads, _ = inputs["q"].shape
    out = torch.empty(batch, q_len, heads, V_DIM, dtype=inputs["q"].dtype, device=inputs["q"].device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=out.device)
    ws = torch.empty(max(workspace_size(batch, heads, q_len, num_kv_splits), 16), dtype=torch.uint8, device=out.device)
    plan = MLADecodePlan(batch, heads, inputs["kv_cache"].shape[1], q_len=q_len, dtype=inputs["q"].dtype,
                         num_kv_splits=num_kv_splits)
    result = {}
    for name, fn, kw in (("default_args", mla_decode, {}),
                         ("preallocated", mla_decode, dict(num_kv_splits=num_kv_splits, out=out, lse=lse, workspace=ws)),
                         ("plan_run", plan.run, dict(out=out, lse=lse)),
                         ("bound", plan.bind(*args, out=out, lse=lse), None)):
        call = (lambda: fn()) if kw is None else (lambda: fn(*args, **kw))
        for _ in range(20):
            call()
        best = math.inf
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
        result[name] = best / n * 1e6
    return result


# ------------------------------------------------------------------------------------------------
# One case
# ------------------------------------------------------------------------------------------------

def case_k_scale(inputs: dict) -> float | None:
    """K_SCALE for an fp8 cache (build_inputs stores real / K_SCALE), else None."""
    return K_SCALE if inputs["kv_cache"].dtype == torch.float8_e4m3fn else None


def fp8_kwargs(inputs: dict) -> dict:
    """The fp8 arguments of a decode call on the inputs: k_scale and --fp8-mode for an fp8 cache, none else."""
    k_scale = case_k_scale(inputs)
    return {} if k_scale is None else {"k_scale": k_scale, "fp8_mode": FP8_MODE}


def variant_dtype(args, num_heads: int | None = None) -> str:
    """The variants.yaml dtype token the run's calls dispatch to: --dtype, or fp8_e4m3_fast for
    --dtype fp8_e4m3 --fp8-mode fast (what support checks, split choices and the records use); with
    num_heads, the token of the variants a call of that many heads runs (codegen.variant.call_dtype:
    fast calls of at most 32 heads run fp8_e4m3)."""
    token = "fp8_e4m3_fast" if args.dtype == "fp8_e4m3" and args.fp8_mode == "fast" else args.dtype
    return token if num_heads is None else call_dtype(token, num_heads)


def case_tolerance(inputs: dict) -> dict:
    """compare()'s bounds for the inputs' cache dtype and --fp8-mode."""
    if inputs["kv_cache"].dtype != torch.float8_e4m3fn:
        return {}
    return FP8_FAST_TOLERANCE if FP8_MODE == "fast" else FP8_TOLERANCE


def decode_call(inputs: dict, splits: int):
    """One mla_decode call on a case's inputs with `splits` splits, its out, lse and workspace allocated
    once here (nothing allocates per call, so the call can be timed and captured in a CUDA graph).
    Returns (call, out, lse)."""
    batch, q_len, heads, _ = inputs["q"].shape
    device = inputs["q"].device
    out = torch.empty(batch, q_len, heads, V_DIM, dtype=inputs["q"].dtype, device=device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=device)
    ws = torch.empty(max(workspace_size(batch, heads, q_len, splits), 16), dtype=torch.uint8, device=device)
    kw = fp8_kwargs(inputs)
    if TMA_MODE != "auto":
        kw["tma"] = TMA_MODE

    def call():
        mla_decode(inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], SOFTMAX_SCALE,
                   num_kv_splits=splits, out=out, lse=lse, workspace=ws, **kw)
    return call, out, lse


def balanced_call(inputs: dict, out: torch.Tensor, lse: torch.Tensor, num_kv_splits: int | None = None,
                  overhead_tiles: int | None = None):
    """The serving path of --balanced: an MLADecodePlan with balanced=True for the case, its schedule
    made once (MLADecodePlan.schedule; not part of the timed call, as the peers' get_mla_metadata /
    plan are not), then plan.run into out / lse. Returns (call, plan, schedule), where schedule()
    remakes the schedule, or (call, plan, None) when the schedule does not serve the case (the plan
    then runs the uniform split)."""
    q, page = inputs["q"], inputs["kv_cache"].shape[1]
    batch, q_len, heads, _ = q.shape
    max_keys = inputs["block_table"].shape[1] * page  # what a block_table row addresses
    plan = MLADecodePlan(batch, heads, page, q_len=q_len, dtype=q.dtype, kv_dtype=inputs["kv_cache"].dtype,
                         max_seq_len=max_keys, num_kv_splits=num_kv_splits, balanced=True,
                         fp8_mode=fp8_kwargs(inputs).get("fp8_mode", "exact"))
    kw = {} if overhead_tiles is None else {"overhead_tiles": overhead_tiles}

    def schedule():
        return plan.schedule(inputs["seq_lens"], max_seq_len=max_keys, **kw)

    k_scale = case_k_scale(inputs)

    def call():
        plan.run(inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], SOFTMAX_SCALE,
                 out=out, lse=lse, k_scale=k_scale)
    return call, plan, (schedule if schedule() else None)


def schedule_label(step):
    """What a scheduled plan's step launches (MLADecodePlan.scheduled_step()), for the results'
    num_kv_splits field: "b66" / "u66" (the balanced or the uniform-equivalent cut on 66 CTAs a row
    block), or the split count of a one-request step, which keeps the uniform split (MLADecodePlan.schedule)."""
    return step.num_kv_splits if step.batch == 1 else f"{step.cut[0]}{step.ctas}"


def code_warm_call(case: dict, splits: int, dtype: torch.dtype, q_len: int, gen: torch.Generator):
    """--code-warm: a call that runs the same kernels as the case (same heads, page size, dtype and
    split count, so the same decode, combine and head-group launches) on a separate one-request case
    of 64 keys per split, in its own small buffers (nothing of the timed case's data enters L2)."""
    inputs = build_inputs(KVPool(torch.device("cuda", torch.cuda.current_device())), [64 * splits], case["num_heads"],
                          case["page_size"], q_len, dtype, gen)
    return decode_call(inputs, splits)[0]


def max_errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> dict:
    """The largest |out - reference| over all elements and |lse - reference| over the rows whose reference
    lse is finite (the anchors' peers_err is the same out measure per peer); NaN or inf where out is not finite."""
    diff = (out.float() - ref_out.float()).abs()
    finite = torch.isfinite(ref_lse)
    lse_diff = (lse.float()[finite] - ref_lse.float()[finite]).abs()
    return {"max_abs_err": float(diff.max()) if diff.numel() else 0.0,
            "lse_max_abs_err": float(lse_diff.max()) if lse_diff.numel() else 0.0}


def check_case(inputs: dict, out: torch.Tensor, lse: torch.Tensor) -> tuple[list[str], dict]:
    """Compare with the fp32 reference: every request when the case is small, else a spread subset.
    Returns (compare()'s problems, max_errors() of the compared requests)."""
    lens = inputs["seq_lens"]
    batch = lens.shape[0]
    if int(lens.sum()) <= CHECK_FULL_TOKENS or batch <= CHECK_SUBSET:
        idx = torch.arange(batch, device=lens.device)
    else:
        idx = torch.linspace(0, batch - 1, CHECK_SUBSET, device=lens.device).round().long().unique()
    fp8 = inputs["kv_cache"].dtype == torch.float8_e4m3fn
    ref_out, ref_lse = mla_decode_reference(inputs["q"][idx], inputs["kv_cache"], inputs["block_table"][idx],
                                            lens[idx], SOFTMAX_SCALE, k_scale=K_SCALE if fp8 else None)
    return (compare(out[idx], lse[idx], ref_out, ref_lse, **case_tolerance(inputs)),
            max_errors(out[idx], lse[idx], ref_out, ref_lse))


def case_splits(case: dict, args, q_len: int, sm_count: int) -> int:
    """--num-kv-splits, else the split count mla_decode's heuristic picks for this case by default
    (its max_seq_len defaults to the block table's capacity: widest request's pages x page_size)."""
    if args.num_kv_splits:
        return args.num_kv_splits
    page = case["page_size"]
    width = max(max(-(-n // page) for n in case["seq_lens"]), 1)
    return default_num_kv_splits(len(case["seq_lens"]), case["num_heads"], q_len, width * page, sm_count,
                                 page_size=page, kv_dtype=variant_dtype(args))


def run_case(case: dict, splits: int, args, pool: KVPool, flush: L2Flush, gen: torch.Generator,
             dtype: torch.dtype, q_len: int) -> dict:
    """Build the inputs, optionally check them, and time the cold and graph calls."""
    inputs = build_inputs(pool, case["seq_lens"], case["num_heads"], case["page_size"], q_len, dtype, gen)
    call, out, lse = decode_call(inputs, splits)
    row: dict = {"num_kv_splits": splits}
    if args.balanced:  # the serving path: MLADecodePlan.run after MLADecodePlan.schedule
        call, plan, schedule = balanced_call(inputs, out, lse, args.num_kv_splits, args.schedule_overhead)
        if schedule is not None:
            row["num_kv_splits"] = schedule_label(plan.scheduled_step())
            row["schedule_us"] = time_cold(schedule, flush, args.reps, args.warmup)
    if args.check:
        call()
        problems, errors = check_case(inputs, out, lse)
        row["check"] = "pass" if not problems else "FAIL: " + "; ".join(problems)
        row.update(errors)
    row["cold_us"] = time_cold(call, flush, args.reps, args.warmup)
    if args.code_warm:
        row["codewarm_us"] = time_cold(call, flush, args.reps, args.warmup,
                                       after_flush=code_warm_call(case, splits, dtype, q_len, gen))
    row["graph_us"] = time_graph(call, args.graph_replays, args.warmup)
    return row


def varlen_q_lens(batch: int, pattern: list[int]) -> list[int]:
    """Request b's q_len in a --varlen run: pattern[b % len(pattern)]."""
    return [pattern[b % len(pattern)] for b in range(batch)]


def varlen_model_us(q_lens: list[int], uniform_us: dict[int, float]) -> float:
    """The sum-of-work model of a varlen call: each request costs its share (1 / batch) of a uniform
    batch at its q_len, sum over q of (requests with q_len q / batch) x uniform_us[q]. A request of
    q_len 0 costs nothing."""
    batch = len(q_lens)
    return sum(uniform_us[q] * q_lens.count(q) / batch for q in set(q_lens) if q > 0)


def varlen_call(inputs: dict, q_lens: list[int], splits: int):
    """(call, out, lse, q, query_start_loc) of one mla_decode_varlen step over the uniform inputs (q_len
    max(q_lens)): request b keeps its first q_lens[b] query tokens, packed."""
    q_full = inputs["q"]
    device = q_full.device
    q = torch.cat([q_full[b, :n] for b, n in enumerate(q_lens)]).contiguous()
    loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    heads = q_full.shape[2]
    out = torch.empty(q.shape[0], heads, V_DIM, dtype=q.dtype, device=device)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32, device=device)
    kw = fp8_kwargs(inputs)
    max_q_len = max(q_lens)

    def call():
        mla_decode_varlen(q, inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], SOFTMAX_SCALE,
                          query_start_loc=loc, max_q_len=max_q_len, num_kv_splits=splits, out=out, lse=lse, **kw)
    return call, out, lse, q, loc


def run_varlen_case(case: dict, pattern: list[int], args, pool: "KVPool", flush: "L2Flush", gen: torch.Generator,
                    dtype: torch.dtype, sm_count: int, splits: int) -> dict:
    """A --varlen case: the varlen call's cold and graph times, each uniform q_len's cold time, the
    sum-of-work model and their ratio; with --check, the varlen result against the fp32 reference.
    splits: the varlen call's split count (the caller's, for the batch's longest request)."""
    q_lens = varlen_q_lens(len(case["seq_lens"]), pattern)
    row: dict = {"q_lens": pattern, "uniform_cold_us": {}}
    for q in sorted({x for x in q_lens if x > 0}):  # the model needs the q_lens this batch has
        inputs = build_inputs(pool, case["seq_lens"], case["num_heads"], case["page_size"], q, dtype, gen)
        call, _, _ = decode_call(inputs, case_splits(case, args, q, sm_count))
        row["uniform_cold_us"][q] = time_cold(call, flush, args.reps, args.warmup)
    inputs = build_inputs(pool, case["seq_lens"], case["num_heads"], case["page_size"], max(q_lens), dtype, gen)
    call, out, lse, q, loc = varlen_call(inputs, q_lens, splits)
    row["num_kv_splits"] = splits
    if args.check:
        call()
        if sum(case["seq_lens"]) <= CHECK_FULL_TOKENS:
            kw = {"k_scale": case_k_scale(inputs)} if case_k_scale(inputs) is not None else {}
            ref = mla_decode_varlen_reference(q.cpu(), inputs["kv_cache"].cpu(), inputs["block_table"].cpu(),
                                              inputs["seq_lens"].cpu(), SOFTMAX_SCALE, query_start_loc=loc.cpu(), **kw)
            problems = compare(out[None].cpu(), lse[None].cpu(), ref[0][None], ref[1][None], **case_tolerance(inputs))
            row["check"] = "pass" if not problems else "FAIL: " + "; ".join(problems)
            row.update(max_errors(out.cpu(), lse.cpu(), ref[0], ref[1]))
        else:
            row["check"] = "pass"
            row["check_note"] = f"not checked: more than {CHECK_FULL_TOKENS} keys"
    row["cold_us"] = time_cold(call, flush, args.reps, args.warmup)
    row["graph_us"] = time_graph(call, args.graph_replays, args.warmup)
    row["model_us"] = varlen_model_us(q_lens, row["uniform_cold_us"])
    row["varlen_ratio"] = row["cold_us"] / row["model_us"] if row["model_us"] else None
    return row


def element_sizes(dtype: str) -> tuple[int, int]:
    """(bytes per KV cache element, bytes per q / out element) of a --dtype or a record's variant dtype:
    an fp8 cache (exact or fast mode) has 1-byte elements and bf16 q / out, the other dtypes one size
    for all three."""
    if dtype.startswith("fp8_e4m3"):
        return 1, 2
    elem = DTYPES[dtype].itemsize
    return elem, elem


def traffic(num_heads: int, batch: int, tokens: int, q_len: int, elem: int, q_elem: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one call over `tokens` = sum(seq_lens) keys of `batch` requests. Bytes: the
    cache rows read (tokens x 576 x elem) plus q read and out written (batch x q_len x heads x
    (576 + 512) x q_elem). FLOPs: 2 x tokens x heads x q_len x (576 + 512), QK^T over 576 and PV over
    512 values per key; the causal mask of q_len > 1 is not subtracted."""
    nbytes = tokens * HEAD_DIM * elem + batch * q_len * num_heads * (HEAD_DIM + V_DIM) * q_elem
    flops = 2 * tokens * num_heads * q_len * (HEAD_DIM + V_DIM)
    return nbytes, flops


def derived(case: dict, row: dict, elem: int, q_len: int, ceilings: dict, q_elem: int) -> None:
    """Adds to row the cold call's TB/s and TFLOP/s (traffic() over row["cold_us"]), their percentages
    of the ceilings, and the peer / ours ratios. elem, q_elem: bytes per KV and q / out element."""
    nbytes, flops = traffic(case["num_heads"], len(case["seq_lens"]), sum(case["seq_lens"]), q_len, elem, q_elem)
    t = row["cold_us"] * 1e-6
    row["tbps"] = nbytes / t / 1e12
    row["pct_read"] = 100 * row["tbps"] / ceilings["read_tbps"]
    row["tflops"] = flops / t / 1e12
    row["pct_matmul"] = 100 * row["tflops"] / ceilings["bf16_matmul_tflops"]
    if case.get("best_us"):
        row["peer_ratio"] = case["best_us"] / row["cold_us"]
    if case.get("best_graph_us") and row.get("graph_us"):
        row["peer_graph_ratio"] = case["best_graph_us"] / row["graph_us"]
    peer_err = (case.get("peers_err") or {}).get(case.get("best_peer"))
    if peer_err is not None and row.get("max_abs_err") is not None:
        row["best_peer_err"] = peer_err  # the fastest peer's max abs out error on the same inputs


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------

COLUMNS = [("heads", 5), ("batch", 5), ("seq", 7), ("page", 4), ("splits", 6), ("cold us", 8), ("graph us", 8),
           ("TB/s", 5), ("%read", 5), ("TFLOP/s", 7), ("%mm", 4), ("peer us", 8), ("peer/us", 7),
           ("peer gr", 8), ("gr ratio", 8)]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_header() -> None:
    print(" ".join(name.rjust(w) for name, w in COLUMNS), flush=True)


def print_row(case: dict, row: dict) -> None:
    seq = f"{case['seq_mean']}{'v' if case.get('ragged') else ''}"
    cells = [case["num_heads"], case["batch"], seq, case["page_size"],
             f"{row['num_kv_splits']}{'' if row.get('exact_variant', True) else '*'}",
             _fmt(row.get("cold_us"), ".1f"), _fmt(row.get("graph_us"), ".1f"), _fmt(row.get("tbps"), ".2f"),
             _fmt(row.get("pct_read"), ".0f"), _fmt(row.get("tflops"), ".0f"), _fmt(row.get("pct_matmul"), ".0f"),
             _fmt(case.get("best_us"), ".1f"), _fmt(row.get("peer_ratio"), ".2f"),
             _fmt(case.get("best_graph_us"), ".1f"), _fmt(row.get("peer_graph_ratio"), ".2f")]
    line = " ".join(str(c).rjust(w) for c, (_, w) in zip(cells, COLUMNS))
    if row.get("codewarm_us") is not None:
        line += f"  code-warm {row['codewarm_us']:.1f}"
    if row.get("q1_ratio") is not None:
        line += f"  q1 {row['q1_cold_us']:.1f} us, ratio {row['q1_ratio']:.2f}"
    if row.get("varlen_ratio") is not None:
        line += f"  model {row['model_us']:.1f} us, varlen ratio {row['varlen_ratio']:.2f}"
    if row.get("max_abs_err") is not None:
        line += f"  err {row['max_abs_err']:.1e}" + (f" (peer {row['best_peer_err']:.1e})"
                                                      if row.get("best_peer_err") is not None else "")
    if row.get("check", "pass") != "pass":
        line += "  " + row["check"]
    print(line, flush=True)


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(results: list[dict]) -> dict:
    done = [r for r in results if r.get("cold_us") is not None]
    cold = [r["peer_ratio"] for r in done if r.get("peer_ratio")]
    graph = [r["peer_graph_ratio"] for r in done if r.get("peer_graph_ratio")]
    return {
        "cases_run": len(done),
        "cases_skipped": sum(1 for r in results if r.get("skipped")),
        "cases_failed": sum(1 for r in results if r.get("error") or str(r.get("check", "pass")) != "pass"),
        "geomean_peer_over_ours_cold": geomean(cold),
        "geomean_peer_over_ours_graph": geomean(graph),
        "at_or_below_peer_cold": sum(1 for x in cold if x >= 1.0),
        "at_or_below_peer_graph": sum(1 for x in graph if x >= 1.0),
        "compared_cold": len(cold),
        "compared_graph": len(graph),
        # --check against anchors that carry peers_err: cases whose max abs out error is at or below
        # the fastest peer's on the same inputs.
        "err_at_or_below_peer": sum(1 for r in done if r.get("best_peer_err") is not None
                                    and r["max_abs_err"] <= r["best_peer_err"]),
        "compared_err": sum(1 for r in done if r.get("best_peer_err") is not None),
        "max_abs_err": max((r["max_abs_err"] for r in done if r.get("max_abs_err") is not None), default=None),
        "geomean_q1_ratio": geomean([r["q1_ratio"] for r in done if r.get("q1_ratio")]),
        "max_q1_ratio": max((r["q1_ratio"] for r in done if r.get("q1_ratio")), default=None),
        "geomean_varlen_ratio": geomean([r["varlen_ratio"] for r in done if r.get("varlen_ratio")]),
        "max_varlen_ratio": max((r["varlen_ratio"] for r in done if r.get("varlen_ratio")), default=None),
    }


def tree_hash() -> str:
    """sha256 over the paths and contents of templates/, mla_variants/*.py and variants.yaml."""
    h = hashlib.sha256()
    files = sorted([*(REPO / "templates").rglob("*"), *(REPO / "mla_variants").glob("*.py"), REPO / "variants.yaml"])
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "git_commit": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"sm_{props.major}{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1))
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    # What was actually built and run, whatever git says (a copied or modified tree): a hash of the
    # kernel templates, the package and variants.yaml, comparable with `python benchmarks/bench.py --tree-hash`.
    env["tree_sha256"] = tree_hash()
    try:
        env["variants"] = [list(k) for k in list_variants()]
    except Exception:  # noqa: BLE001 - the environment record must not fail the run
        env["variants"] = None
    return env


# ------------------------------------------------------------------------------------------------
# Roofline plot (--plot; matplotlib is the optional extra "plot")
# ------------------------------------------------------------------------------------------------

# The vendor's roof, drawn dotted beside the run's measured one: NVIDIA H200 SXM datasheet, 4.8 TB/s of
# HBM3e and 989 TFLOP/s of dense bf16 tensor-core math (1979 with 2:4 sparsity).
DATASHEET_CEILINGS = {"read_tbps": 4.8, "bf16_matmul_tflops": 989.0}
PLOT_DPI = 110
PLOT_INSTALL = 'pip install matplotlib (the [plot] extra: pip install -e ".[plot]" in a checkout)'


def matplotlib_figure():
    """matplotlib's Figure class (used without pyplot: no GUI backend, no global state). Exits with the
    install command when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        sys.exit(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}")
    return Figure


def roofline_points(report: dict) -> list[dict]:
    """One point per timed case of a bench.py report (a run's, or its --json file read back), with the
    bytes and FLOPs of traffic(): num_heads, intensity (FLOP/byte), and ours_tbps, ours_tflops,
    peer_tbps, peer_tflops (TB/s and TFLOP/s of our and the best peer's cold time; the peer's None when
    the anchors have no time for the case). Skipped, failed and reference-check-failing cases are left
    out."""
    points = []
    for r in report["cases"]:
        if r.get("cold_us") is None or str(r.get("check", "pass")) != "pass":
            continue
        nbytes, flops = traffic(r["num_heads"], r["batch"], r["seq_total"], r["q_len"], *element_sizes(r["dtype"]))
        point = {"num_heads": r["num_heads"], "intensity": flops / nbytes}
        for who, us in (("ours", r["cold_us"]), ("peer", r.get("best_us"))):
            point[f"{who}_tbps"] = nbytes / us * 1e-6 if us else None
            point[f"{who}_tflops"] = flops / us * 1e-6 if us else None
        points.append(point)
    return points


def plot_roofline(report: dict, path: str, source: str) -> int:
    """Draw a bench.py report's cases on one H200's roofline into the PNG at path; returns the number
    of cases drawn (exits when there is none). Two log-log panels against arithmetic intensity
    (FLOP/byte): achieved TFLOP/s under min(read TB/s x intensity, matmul TFLOP/s), and achieved HBM
    TB/s under min(read TB/s, matmul TFLOP/s / intensity). Ours are filled circles, the best peer's
    crosses (the cold times the run compared against, from its anchors file), colored by head count.
    Roofs: solid, the ceilings the run recorded (report["ceilings"]: the anchors file's, measured on an
    H200 with the peers, else DEFAULT_CEILINGS); dotted, DATASHEET_CEILINGS. source names the run."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points = roofline_points(report)
    if not points:
        sys.exit(f"--plot: {source} has no timed case to draw")
    ceilings = {**DEFAULT_CEILINGS, **report.get("ceilings", {})}
    anchors_meta = report.get("anchors_meta") or {}
    measured = (f"measured with the anchors ({anchors_meta.get('date', 'undated')})" if "ceilings" in anchors_meta
                else "bench.py's defaults (measured with earlier anchors)")
    xs = [p["intensity"] for p in points]
    roofs = [(ceilings, "-", f"{measured}: HBM read {ceilings['read_tbps']:g} TB/s, bf16 matmul "
                             f"{ceilings['bf16_matmul_tflops']:g} TFLOP/s"),
             (DATASHEET_CEILINGS, ":", f"NVIDIA H200 SXM datasheet: HBM3e {DATASHEET_CEILINGS['read_tbps']:g} TB/s, "
                                       f"dense bf16 {DATASHEET_CEILINGS['bf16_matmul_tflops']:g} TFLOP/s")]
    ridges = [c["bf16_matmul_tflops"] / c["read_tbps"] for c, _, _ in roofs]
    x0, x1 = min(xs + ridges) / 1.6, max(xs + ridges) * 1.6

    fig = matplotlib_figure()(figsize=(13, 6.2), layout="constrained")
    ax_flops, ax_bw = fig.subplots(1, 2)
    heads = sorted({p["num_heads"] for p in points})
    colors = {h: f"C{i % 10}" for i, h in enumerate(heads)}
    for ax, metric in ((ax_flops, "tflops"), (ax_bw, "tbps")):
        for (c, style, _), ridge in zip(roofs, ridges):
            bw, peak = c["read_tbps"], c["bf16_matmul_tflops"]
            # Straight on log-log axes: the polyline through the ridge is the whole roof.
            ys = [bw * x0, peak, peak] if metric == "tflops" else [bw, bw, peak / x1]
            ax.plot([x0, ridge, x1], ys, style, color="0.25", linewidth=1.2, zorder=1)
        for who, marker in (("peer", "x"), ("ours", "o")):
            drawn = [p for p in points if p[f"{who}_{metric}"] is not None]
            ax.scatter([p["intensity"] for p in drawn], [p[f"{who}_{metric}"] for p in drawn], s=24,
                       marker=marker, c=[colors[p["num_heads"]] for p in drawn], alpha=0.7,
                       linewidths=1.0 if marker == "x" else 0.3, edgecolors=None if marker == "x" else "black",
                       zorder=2 if who == "peer" else 3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(x0, x1)
        for axis in (ax.xaxis, ax.yaxis):  # ticks at 1, 2, 5 x 10^k, written plainly
            axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", color="0.85", linewidth=0.6)
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax_flops.set_ylabel("achieved TFLOP/s (cold call)")
    ax_flops.set_title("compute: TFLOP/s")
    ax_bw.set_ylabel("achieved HBM bandwidth, TB/s (cold call)")
    ax_bw.set_title("memory: TB/s of cache rows + q + out")

    compared = [p for p in points if p["peer_tbps"] is not None]
    markers = [Line2D([], [], linestyle="", marker="o", color="0.4", markeredgecolor="black",
                      label="mla-variants (ours)")]
    if compared:
        markers.append(Line2D([], [], linestyle="", marker="x", color="0.4", label="best peer per case (anchors)"))
    groups = (markers, [Line2D([], [], linestyle="", marker="s", color=colors[h], label=f"{h} heads") for h in heads],
              [Line2D([], [], linestyle=style, color="0.25", label=label) for _, style, label in roofs])
    # Two rows, filled column by column: each group padded to whole columns with a blank entry.
    handles = [h for g in groups for h in g + [Line2D([], [], linestyle="", label=" ")] * (len(g) % 2)]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles) // 2, fontsize=8.5, frameon=False)

    env = report.get("environment") or {}
    kinds = ", ".join(sorted({f"{r['dtype']} cache, q_len {r['q_len']}" for r in report["cases"]}))
    run = f"{source}, {env.get('date', 'undated')[:10]}, commit {(env.get('git_commit') or 'unknown')[:8]}"
    if compared:  # time ratio = TB/s ratio: the bytes are the same
        run += (f"; geomean best peer / ours {geomean([p['ours_tbps'] / p['peer_tbps'] for p in compared]):.3f} "
                f"over {len(compared)} cases")
    fig.suptitle(f"MLA decode roofline, one {env.get('gpu', 'GPU')}: {kinds}, {len(points)} cases, "
                 f"cold calls (L2 flushed)\n{run}", fontsize=11)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    return len(points)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None, description: str | None = None, extra=None):
    """The benchmark's options (lab/timeline.py and lab/trace.py reuse them with their own
    description; extra(parser), when given, adds a tool's own options)."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Timing method and output: see the module docstring (benchmarks/bench.py).")
    p.add_argument("--anchors", help="anchor cases JSON (default: <repo>/../shared/anchors-h200.json, else "
                                     "<repo>/shared/anchors-h200.json; anchors-h200-modes.json instead for "
                                     "--dtype fp8_e4m3 or a --mode other than bf16_q1; "
                                     "without it the grid is generated, with no peer numbers)")
    p.add_argument("--heads", type=_int_list, help="only these head counts, e.g. 16,128")
    p.add_argument("--batch", type=_int_list, help="only these batch sizes, e.g. 1,8")
    p.add_argument("--seq", type=_int_list, help="only these mean sequence lengths, e.g. 4096")
    p.add_argument("--page", type=_int_list, help="only these page sizes, e.g. 1,64")
    p.add_argument("--ragged", action=argparse.BooleanOptionalAction, default=None,
                   help="only ragged (--ragged) or only uniform (--no-ragged) batches; default both")
    p.add_argument("--limit", type=int, help="run at most N cases (after filtering)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="cache dtype: bf16/fp16 (q and out alike) or fp8_e4m3 (q and out bf16, k_scale 0.5; "
                        "TB/s counts 1 byte per KV element; peers from the fp8_q1 cases of anchors-h200-modes.json)")
    p.add_argument("--fp8-mode", choices=("exact", "fast"), default="exact",
                   help="with --dtype fp8_e4m3: mla_decode's fp8_mode (fast: the fp8_e4m3_fast variants, fp8 "
                        "tensor-core math; --check then uses testing.FP8_FAST_TOLERANCE)")
    p.add_argument("--tma", choices=("auto", "off", "require"), default="auto",
                   help="mla_decode's tma: off times the cp.async path of kernels that load whole pages by TMA "
                        "(page sizes that are multiples of 64), so one build compares both; require fails a "
                        "launch whose tensor map cannot be encoded (default auto)")
    p.add_argument("--mode", help="with a multi-mode anchors file: the mode to run (default fp8_q1 for fp8_e4m3, else bf16_q1)")
    p.add_argument("--q-len", type=int, help="run the selected cases' shapes at this q_len (1-8; no peer times then)")
    p.add_argument("--vs-q1", action="store_true", help="also time each case at q_len 1: q1 ratio = cold(q_len) / cold(1)")
    p.add_argument("--varlen", type=_int_list, metavar="L",
                   help="q_lens per request, cycled over the batch (e.g. 1,2,3,4; 0 to 8, one at least 1): time "
                        "mla_decode_varlen against the sum-of-work model of the uniform q_lens (module docstring)")
    p.add_argument("--num-kv-splits", type=int, help="force the split count (default: the library's heuristic)")
    p.add_argument("--balanced", action="store_true",
                   help="time MLADecodePlan.run after MLADecodePlan.schedule (the balanced schedule, made once per "
                        "step and timed apart as schedule_us) instead of mla_decode")
    p.add_argument("--code-warm", action="store_true",
                   help="also time each case with its kernels' code brought back into L2 after the flush "
                        "(codewarm_us; cold minus code-warm = the cost of fetching code from DRAM)")
    p.add_argument("--schedule-overhead", type=int, help="with --balanced: the schedule's cost of a segment, in tiles (default: the plan's, "
                   "mla_variants.plan.SCHEDULE_OVERHEAD_TILES*)")
    p.add_argument("--reps", type=int, help="cold timed calls per case (default 50; 10 with --quick)")
    p.add_argument("--graph-replays", type=int, help=f"timed replays of the {GRAPH_CALLS}-call graph "
                                                     "(default 20; 10 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, for smoke tests")
    p.add_argument("--check", action="store_true",
                   help=f"verify each case against the fp32 reference (all requests when sum(seq_lens) <= "
                        f"{CHECK_FULL_TOKENS}, else {CHECK_SUBSET} requests spread over the batch) and record the "
                        f"max abs out and lse errors (against the fastest peer's error where the anchors have it)")
    p.add_argument("--json", help="result file (default: <repo>/bench-results/bench-<timestamp>.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--tree-hash", action="store_true",
                   help="print the hash of templates/, mla_variants/ and variants.yaml that a run records "
                        "(environment.tree_sha256) and exit")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    args.reps = args.reps or (10 if args.quick else 50)
    args.graph_replays = args.graph_replays or (10 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    if args.num_kv_splits is not None and not 1 <= args.num_kv_splits <= 256:
        p.error("--num-kv-splits must be from 1 to 256")
    if args.reps < 1 or args.graph_replays < 1:
        p.error("--reps and --graph-replays must be positive")
    if args.code_warm and args.balanced:
        p.error("--code-warm times mla_decode's launches; it does not combine with --balanced")
    if args.q_len is not None and not 1 <= args.q_len <= 8:
        p.error(f"--q-len must be from 1 to 8, got {args.q_len}")
    if args.varlen is not None:
        if not args.varlen or any(not 0 <= q <= 8 for q in args.varlen) or max(args.varlen) < 1:
            p.error(f"--varlen needs q_lens from 0 to 8, at least one of them >= 1, got {args.varlen}")
        if args.q_len is not None or args.vs_q1 or args.balanced or args.code_warm:
            p.error("--varlen does not combine with --q-len, --vs-q1, --balanced or --code-warm")
    if args.vs_q1 and args.balanced:
        p.error("--vs-q1 times mla_decode at q_len 1; it does not combine with --balanced")
    if args.fp8_mode == "fast" and args.dtype != "fp8_e4m3":
        p.error("--fp8-mode fast needs --dtype fp8_e4m3 (it multiplies an fp8 cache in fp8)")
    if args.tma != "auto" and (args.balanced or args.varlen):
        p.error("--tma sets mla_decode's tma; the plans of --balanced and the varlen calls of --varlen take none")
    global FP8_MODE, TMA_MODE
    FP8_MODE = args.fp8_mode
    TMA_MODE = args.tma
    return args


def tool_setup(argv, doc: str, tool: str, extra=None):
    """The shared start of the benchmark's companion tools (timeline.py, trace.py): bench.py's options
    (plus the tool's own, added by extra(parser)) under the tool's description, the GPU check, and the
    selected cases with what every tool derives from them. Returns (args, cases, q_len, dtype, sm_count):
    the run's q_len (cases_q_len), the --dtype's torch dtype and the GPU's SM count; or None after
    saying on stderr that no GPU is available."""
    args = parse_args(argv, description=doc.split("\n\n")[0], extra=extra)
    if not torch.cuda.is_available():
        print(f"no CUDA GPU available: the {tool} needs an sm_90a GPU (H100/H200)", file=sys.stderr)
        return None
    cases, meta, _ = load_cases(args)
    cases = select_cases(cases, args)
    sm_count = torch.cuda.get_device_properties(torch.device("cuda")).multi_processor_count
    return args, cases, cases_q_len(cases, meta), DTYPES[args.dtype], sm_count


def plot_options(p: argparse.ArgumentParser) -> None:
    """bench.py's own options beyond parse_args' shared ones: the roofline plot."""
    p.add_argument("--plot", metavar="OUT.png",
                   help="also draw the run on the H200 roofline into this PNG (needs matplotlib: "
                        f"{PLOT_INSTALL})")
    p.add_argument("--from-json", metavar="RESULTS.json",
                   help="with --plot: draw a recorded run (a --json file) instead of running; no GPU needed; "
                        "--heads, --batch, --seq, --page, --ragged and --limit select its cases")


def main(argv=None) -> int:
    args = parse_args(argv, extra=plot_options)
    if args.tree_hash:
        print(tree_hash())
        return 0
    if args.plot:
        matplotlib_figure()  # a missing matplotlib fails now, not after the run
    if args.from_json:
        if not args.plot:
            print("--from-json needs --plot OUT.png (it only draws a recorded run)", file=sys.stderr)
            return 2
        path = Path(args.from_json)
        if not path.is_file():
            sys.exit(f"--from-json {path}: no such file")
        report = json.loads(path.read_text())
        report["cases"] = select_cases(report["cases"], args)
        drawn = plot_roofline(report, args.plot, path.name)
        print(f"roofline of {drawn} cases of {path} written to {args.plot}")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU available: the benchmark needs an sm_90a GPU (H100/H200)", file=sys.stderr)
        return 1
    try:
        variants = list_variants()
    except LibraryNotBuiltError as e:
        print(f"{e}\nbuild first: mla-variants build   (or: python -m codegen build)", file=sys.stderr)
        return 1

    cases, meta, anchors_path = load_cases(args)
    cases = select_cases(cases, args)
    if not cases:
        print("no case matches the filters", file=sys.stderr)
        return 1
    ceilings = {**DEFAULT_CEILINGS, **meta.get("ceilings", {})}
    q_len = cases_q_len(cases, meta)
    if (args.q_len is not None and args.q_len != q_len) or args.varlen is not None:
        # The peers were measured at the cases' own q_len: no peer comparison at another one.
        cases = [{k: v for k, v in c.items() if k not in ("best_us", "best_graph_us", "best_peer", "best_graph_peer")}
                 for c in cases]
        q_len = args.q_len if args.varlen is None else max(args.varlen)
    dtype = DTYPES[args.dtype]
    elem, q_elem = element_sizes(args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment()
    sm_count = env["sm_count"]

    shape = f"varlen q_lens {args.varlen}" if args.varlen is not None else f"q_len {q_len}"
    print(f"mla-variants bench: {len(cases)} cases, {variant_dtype(args)}, {shape}, {env['gpu']} ({sm_count} SMs), "
          f"torch {env['torch']}; {len(variants)} compiled variants", flush=True)
    print(f"anchors: {anchors_path or 'none (generated grid)'}; ceilings: read {ceilings['read_tbps']} TB/s, "
          f"matmul {ceilings['bf16_matmul_tflops']} TFLOP/s; cold reps {args.reps}, graph replays "
          f"{args.graph_replays} x {GRAPH_CALLS} calls" + ("; checking against the fp32 reference" if args.check else ""),
          flush=True)
    if args.dtype == "fp16" and anchors_path:
        print("note: the peer times were measured in bf16", flush=True)

    pool = KVPool(device)
    flush = L2Flush(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    compiled = set(variants)

    # Host overhead, once: batch 1, 1024 tokens, at the first servable (heads, page) of the selection.
    first = next((c for c in cases if is_supported(c["num_heads"], c["page_size"], variant_dtype(args))), None)
    overhead = None
    if first is not None and args.dtype != "fp8_e4m3":  # plans (part of the overhead table) take bf16/fp16 only
        small = dict(num_heads=first["num_heads"], page_size=first["page_size"], seq_lens=[1024])
        splits = case_splits(small, args, q_len, sm_count)
        if is_supported(small["num_heads"], small["page_size"], variant_dtype(args), split=splits > 1):
            inputs = build_inputs(pool, small["seq_lens"], small["num_heads"], small["page_size"], q_len, dtype, gen)
            overhead = host_overhead_us(inputs, splits)
            overhead["case"] = small
            print(f"host overhead of one eager call (heads {small['num_heads']}, batch 1, seq 1024, page "
                  f"{small['page_size']}): {overhead['default_args']:.1f} us with default arguments, "
                  f"{overhead['preallocated']:.1f} us with preallocated out/lse/workspace, "
                  f"{overhead['plan_run']:.1f} us through MLADecodePlan.run, {overhead['bound']:.1f} us for a bound step "
                  f"(MLADecodePlan.bind)", flush=True)
            del inputs
    print("('*' after splits: no exact variant, served by a larger head count or head groups)", flush=True)
    print_header()

    results = []
    t_start = time.perf_counter()
    for i, case in enumerate(cases):
        heads, page, batch = case["num_heads"], case["page_size"], len(case["seq_lens"])
        rec = {k: case.get(k) for k in ("num_heads", "batch", "seq_mean", "page_size", "ragged", "best_us",
                                        "best_peer", "best_graph_us", "best_graph_peer")}
        rec.update(index=i, dtype=variant_dtype(args, heads), q_len=q_len, seq_total=sum(case["seq_lens"]))
        if args.dtype == "fp8_e4m3":
            rec["fp8_mode"] = args.fp8_mode  # the call's mode (dtype: the variants it ran, call_dtype)
        if case.get("ragged"):
            rec["seq_lens"] = case["seq_lens"]
        # A varlen case's launch: q_len = its batch's longest request, whose split count mla_decode_varlen's
        # default picks (run_varlen_case times the call with it).
        launch_q_len = q_len if args.varlen is None else max(varlen_q_lens(batch, args.varlen))
        splits = case_splits(case, args, max(launch_q_len, 1), sm_count)
        split = splits > 1
        if args.varlen is not None and not launch_q_len:
            rec["skipped"] = f"no query tokens: every request's q_len in {args.varlen[:batch]} is 0"
        elif not is_supported(heads, page, variant_dtype(args), split=split):
            rec["skipped"] = (f"not in this build: heads {heads}, page {page}, {variant_dtype(args)}, "
                              f"{'split' if split else 'nosplit'}")
        if rec.get("skipped"):
            print(f"[{i + 1}/{len(cases)}] skip {heads}h b{batch} s{case['seq_mean']} p{page}: {rec['skipped']}", flush=True)
            results.append(rec)
            continue
        try:
            if args.varlen is not None:
                row = run_varlen_case(case, args.varlen, args, pool, flush, gen, dtype, sm_count, splits)
            else:
                row = run_case(case, splits, args, pool, flush, gen, dtype, q_len)
                if args.vs_q1:
                    splits1 = case_splits(case, args, 1, sm_count)
                    q1_inputs = build_inputs(pool, case["seq_lens"], heads, page, 1, dtype, gen)
                    row["q1_cold_us"] = time_cold(decode_call(q1_inputs, splits1)[0], flush, args.reps, args.warmup)
                    row["q1_ratio"] = row["cold_us"] / row["q1_cold_us"]
                    del q1_inputs
        except (RuntimeError, ValueError, LookupError) as e:  # CUDA errors, MLAInputError, VariantNotCompiledError
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"[{i + 1}/{len(cases)}] error {heads}h b{batch} s{case['seq_mean']} p{page}: {rec['error']}", flush=True)
            results.append(rec)
            continue
        row["exact_variant"] = (heads, page, variant_dtype(args, heads), split) in compiled or (
            not split and (heads, page, variant_dtype(args, heads), True) in compiled)
        if args.varlen is None:
            derived(case, row, elem, q_len, ceilings, q_elem)
        rec.update(row)
        results.append(rec)
        print_row(case, row)
    elapsed = time.perf_counter() - t_start

    summary = summarize(results)
    print(f"\n{summary['cases_run']} cases run, {summary['cases_skipped']} skipped, {summary['cases_failed']} failed "
          f"in {elapsed:.0f} s")
    if summary["compared_cold"]:
        print(f"cold : geomean peer/ours {summary['geomean_peer_over_ours_cold']:.3f}; at or below the best peer in "
              f"{summary['at_or_below_peer_cold']} of {summary['compared_cold']} cases")
    if summary["compared_graph"]:
        print(f"graph: geomean peer/ours {summary['geomean_peer_over_ours_graph']:.3f}; at or below the best peer in "
              f"{summary['at_or_below_peer_graph']} of {summary['compared_graph']} cases")
    if summary["compared_err"]:
        print(f"error: max abs out error at or below the fastest peer's in {summary['err_at_or_below_peer']} of "
              f"{summary['compared_err']} cases (ours at most {summary['max_abs_err']:.1e})")
    if summary["geomean_q1_ratio"] is not None:
        print(f"q_len {q_len} / q_len 1 cold time: geomean {summary['geomean_q1_ratio']:.3f}, max {summary['max_q1_ratio']:.3f}")
    if summary["geomean_varlen_ratio"] is not None:
        print(f"varlen / sum-of-work model: geomean {summary['geomean_varlen_ratio']:.3f}, "
              f"max {summary['max_varlen_ratio']:.3f}")

    out_path = Path(args.json) if args.json else (
        REPO / "bench-results" / f"bench-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "environment": env,
        "args": {k: v for k, v in vars(args).items()},
        "anchors": anchors_path,
        "anchors_meta": meta,
        "ceilings": ceilings,
        "method": {"cold": f"L2 flushed by reading {FLUSH_BYTES >> 20} MiB before each call, CUDA events, "
                           f"median of {args.reps}",
                   "graph": f"{GRAPH_CALLS} calls in one CUDA graph, median of {args.graph_replays} replays / "
                            f"{GRAPH_CALLS}",
                   "inputs": "random N(0, 0.1^2) q and cache; pages randomly permuted over one pool; NaN in unused slots",
                   **({"code_warm": "as cold, plus an untimed call of the same kernels on a separate one-request "
                                    "case (64 keys per split) between the flush and the timed call"}
                      if args.code_warm else {})},
        "host_overhead_us": overhead,
        "elapsed_s": elapsed,
        "summary": summary,
        "cases": results,
    }
    out_path.write_text(json.dumps(report, indent=1))
    print(f"results written to {out_path}", flush=True)
    if args.plot:
        print(f"roofline of {plot_roofline(report, args.plot, out_path.name)} cases written to {args.plot}")
    return 1 if summary["cases_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
