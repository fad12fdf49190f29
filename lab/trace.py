"""Where the time of each CTA goes inside the decode kernel: a per-CTA phase trace (a diagnostic build).

    CUDAFLAGS=-DMLA_TRACE=1 mla-variants build --filter 'h128_p64_bf16*' --build-dir /tmp/bt --generated-dir /tmp/gt
    MLA_VARIANTS_GENERATED=/tmp/gt python lab/trace.py --heads 128 --page 64 --batch 128 --seq 1024

Takes the same case filters as benchmarks/bench.py. In a trace build (templates/mla/trace.cuh) every
decode CTA stamps %globaltimer into its own words of a buffer the library owns; this script clears it
before each call and reads it after (mla_variants_trace_clear / _read). Each case is called --reps
times cold (L2 flushed, as bench.py times a call; --code-warm: with the kernels' code brought back
into L2 after the flush, as bench.py --code-warm; --hot: no flush, the same call having run just
before, so its data, code and parameters are as warm as they get: cold minus hot per phase is what
that phase waits for memory or instruction fetch). Phases per CTA (us; medians over all CTAs of all
calls, with the 10th and 90th percentile):

  start    : CTA entry -> producer thread 0 past the barrier set-up (seq_lens load, barrier init,
             register handover; Q's copies may already be in flight by then)
  q        : CTA entry -> Q in shared memory, as the first math thread sees it
  loop     : Q -> the first math warpgroup's main loop is done (also per tile: loop / tiles)
  lag      : the first math warpgroup's loop done -> the last one's (what the merge waits for;
             negative when the last warpgroup had no tile and left its loop at once)
  merge    : the later of the two loop ends -> merged (row sums exchanged, the transposed path's
             O^T merged in shared memory), as the first math thread sees it
  store    : merged -> past the first math thread's stores (normalise, out / lse or workspace rows)
  epilogue : main loop done -> past the first math thread's stores (lag + merge + store)
  cta      : CTA entry -> past the stores
  producer : CTA entry -> producer thread 0 done (its own copies landed; TMA tiles: issued)
  spread   : CTA entry - the earliest entry of the call (when a CTA started: launch order and waves)
  end      : past the CTA's stores - the earliest entry of the call (its max over CTAs is the kernel's span)
  wave     : CTAs that entered after another CTA on the same SM had finished (second and later waves)

With --balanced the call is MLADecodePlan.run after MLADecodePlan.schedule (the balanced schedule, as
bench.py --balanced): its CTAs cover several requests each; they stamp entry, the producer's start and
end, the last stores, their tiles and their segments (requests with tiles), so besides the phases (no
q or loop for them) a least-squares fit of each CTA's time over its tiles and segments gives the
per-tile rate, the cost of a segment and the fixed cost: the terms of the schedule's cost model
(templates/mla/schedule.cuh). A 64-row 16-bit CTA with two or more segments with tiles also stamps
its second such segment's phases (trace.cuh kTraceSeg*), reported as:

  seg_q_lead  : the producer issued the segment's Q -> the first segment's stores done (positive: Q
                was on its way before the math warps needed it)
  seg_q_wait  : the first segment's stores done -> the segment's Q in shared memory
  seg_loop    : Q -> the first math warpgroup's loop done (seg_loop_per_tile: over the segment's tiles)
  seg_lag, seg_merge, seg_store : as lag, merge and store, for this segment
  seg_total   : the first segment's stores done -> the second's

A build without MLA_TRACE has no stamps; the script then says so. A case runs only where its call
is one launch of a variant compiled for exactly its head count (no masked rows, no head groups), so
that the CTA indices decode to the kernel's row blocks; the rows per CTA come from the launch's own
facts (the library's plan: launch.facts.launch_rows), not from a copy of the kernel's path choice.
"""
from __future__ import annotations

import ctypes
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench.py (which puts this checkout first)
import bench  # noqa: E402  (benchmarks/bench.py: the benchmark's case loading, inputs and L2 flush)
import torch  # noqa: E402

from mla_variants import _binding  # noqa: E402

SLOTS = 16                # 64-bit words per CTA (templates/mla/trace.cuh kTraceSlots; TraceSlot below)
(ENTRY, PRODUCER_START, Q_LANDED, LOOP_DONE, STORED, PRODUCER_DONE, INFO, SEGMENTS, LOOP_DONE_LAST, MERGED,
 SEG_PREV_END, SEG_Q_ISSUED, SEG_END, SEG_TILES) = range(14)


def the_launch(num_heads: int, page_size: int, dtype: str, split: bool):
    """The one launch of the loaded library that serves a call (its plan), or None when the call is
    not one launch of a variant compiled for exactly num_heads heads (masked rows or head groups would
    not decode to the kernel's row blocks) or no variant serves it."""
    try:
        launches = _binding.library().plan(num_heads, page_size, dtype, split)
    except LookupError:
        return None
    return launches[0] if len(launches) == 1 and launches[0].key[0] == num_heads else None


def rows_per_cta(launch, max_seq_len: int | None = None, num_kv_splits: int = 1, q_len: int = 1) -> int:
    """Query rows per CTA of the kernel a launch (an entry of the library's plan) runs: the variant's
    own rows for q_len (launch.facts.rows_for), or, given the launcher's bound (max_seq_len) and the
    split count, launch.facts.launch_rows: its second kernel's rows when every split is short."""
    q_rows = launch.key[0] * q_len
    if max_seq_len is None:
        return launch.facts.rows_for(q_rows)
    return launch.facts.launch_rows(max_seq_len, num_kv_splits, q_rows)


def cta_records(words: torch.Tensor, m_blocks: int, grid_x: int) -> list[dict]:
    """The stamps of one launch: words int64 [CTAs, SLOTS], CTA (x, y) at row x + grid_x y. x = m_block +
    m_blocks * unit, where unit is the request (uniform launch; y its split) or the schedule's CTA
    (balanced). Returns one dict per CTA that stamped (entry != 0)."""
    out = []
    for i, row in enumerate(words.cpu().tolist()):
        if row[ENTRY] == 0:
            continue
        x, y = i % grid_x, i // grid_x
        out.append({"unit": x // m_blocks, "m_block": x % m_blocks, "split": y, "stamps": [int(v) for v in row],
                    "sm": (row[INFO] >> 32) & 0xffffffff, "tiles": row[INFO] & 0xffffffff, "segments": row[SEGMENTS]})
    return out


class TraceBuffer:
    """The trace buffer of the loaded library (exports.cu): clear before a call, read after it, and
    switch stamping off around calls that must not overwrite it (the --code-warm call)."""

    def __init__(self):
        cdll = _binding.library().cdll
        try:
            self._bytes, self._read, self._clear, self._enable = (
                cdll.mla_variants_trace_bytes, cdll.mla_variants_trace_read, cdll.mla_variants_trace_clear,
                cdll.mla_variants_trace_enable)
        except AttributeError:  # a library built before the trace existed
            self.capacity = 0
            return
        self._bytes.restype = ctypes.c_int64
        self._read.argtypes, self._read.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int
        self._clear.restype = ctypes.c_int
        self._enable.argtypes, self._enable.restype = [ctypes.c_int], ctypes.c_int
        self.capacity = int(self._bytes()) // (SLOTS * 8)  # CTAs (allocates the buffer); 0: not a trace build

    def enable(self, on: bool) -> None:
        code = self._enable(1 if on else 0)
        if code:
            raise RuntimeError(f"mla_variants_trace_enable failed (CUDA error {code})")

    def clear(self) -> None:
        code = self._clear()
        if code:
            raise RuntimeError(f"mla_variants_trace_clear failed (CUDA error {code})")

    def read(self, ctas: int) -> torch.Tensor:
        words = torch.zeros(min(ctas, self.capacity), SLOTS, dtype=torch.int64)
        code = self._read(words.data_ptr(), words.numel() * 8)
        if code:
            raise RuntimeError(f"mla_variants_trace_read failed (CUDA error {code})")
        return words


def fit_cost(rows: list[dict]) -> dict | None:
    """Least squares of each CTA's time (entry -> stored, us) = fixed + per_tile * tiles + per_segment *
    segments over the given phase rows (scheduled CTAs); None with fewer than 4 CTAs or when tiles and
    segments do not vary independently."""
    pts = [(r["tiles"], r["segments"], r["cta"]) for r in rows if r.get("cta") is not None and r.get("segments") is not None]
    if len(pts) < 4:
        return None
    a = torch.tensor([[1.0, t, g] for t, g, _ in pts], dtype=torch.float64)
    y = torch.tensor([[c] for _, _, c in pts], dtype=torch.float64)
    if int(torch.linalg.matrix_rank(a)) < 3:
        return None
    coef = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    resid = (a @ torch.tensor(coef, dtype=torch.float64)[:, None] - y).flatten()
    return {"fixed_us": coef[0], "per_tile_us": coef[1], "per_segment_us": coef[2],
            "rms_residual_us": float(resid.pow(2).mean().sqrt()), "n": len(pts)}


SEG_KEYS = ("seg_q_lead", "seg_q_wait", "seg_loop", "seg_loop_per_tile", "seg_lag", "seg_merge", "seg_store",
            "seg_total", "seg_tiles")


def phases(records: list[dict]) -> list[dict]:
    """Per CTA of one call: the phase durations of the module docstring (us; None where a stamp is
    missing, e.g. no Q for a CTA without tiles) and whether it ran in a later wave on its SM."""
    if not records:
        return []
    t0 = min(r["stamps"][ENTRY] for r in records)
    by_sm: dict[int, list[dict]] = {}
    for r in records:
        by_sm.setdefault(r["sm"], []).append(r)
    later = set()
    for group in by_sm.values():
        for r in group:
            if any(o is not r and 0 < o["stamps"][STORED] <= r["stamps"][ENTRY] for o in group):
                later.add(id(r))
    res = []
    for r in records:
        s = r["stamps"]

        def d(a, b):
            return (s[b] - s[a]) / 1e3 if s[a] and s[b] else None

        seg = {k: None for k in SEG_KEYS}
        if s[SEG_TILES]:  # a scheduled CTA's second segment (the module docstring): its own phases
            seg.update(seg_q_lead=d(SEG_Q_ISSUED, SEG_PREV_END), seg_q_wait=d(SEG_PREV_END, Q_LANDED),
                       seg_loop=d(Q_LANDED, LOOP_DONE), seg_lag=d(LOOP_DONE, LOOP_DONE_LAST),
                       seg_merge=(s[MERGED] - max(s[LOOP_DONE], s[LOOP_DONE_LAST])) / 1e3
                       if s[MERGED] and s[LOOP_DONE] and s[LOOP_DONE_LAST] else None,
                       seg_store=d(MERGED, SEG_END), seg_total=d(SEG_PREV_END, SEG_END), seg_tiles=s[SEG_TILES])
            if seg["seg_loop"] is not None:
                seg["seg_loop_per_tile"] = seg["seg_loop"] / s[SEG_TILES]
            s = s[:Q_LANDED] + [0, 0] + s[STORED:LOOP_DONE_LAST] + [0, 0] + s[MERGED + 1:]  # not the CTA's phases
        loop = d(Q_LANDED, LOOP_DONE)
        res.append({**seg, "start": d(ENTRY, PRODUCER_START), "q": d(ENTRY, Q_LANDED), "loop": loop,
                    "loop_per_tile": loop / r["tiles"] if loop is not None and r["tiles"] else None,
                    "lag": d(LOOP_DONE, LOOP_DONE_LAST),
                    "merge": (s[MERGED] - max(s[LOOP_DONE], s[LOOP_DONE_LAST])) / 1e3
                    if s[MERGED] and s[LOOP_DONE] and s[LOOP_DONE_LAST] else None,
                    "store": d(MERGED, STORED), "epilogue": d(LOOP_DONE, STORED), "cta": d(ENTRY, STORED), "producer": d(ENTRY, PRODUCER_DONE),
                    "spread": (s[ENTRY] - t0) / 1e3,
                    "end": (s[STORED] - t0) / 1e3 if s[STORED] else None, "tiles": r["tiles"], "segments": r.get("segments"),
                    "later_wave": id(r) in later})
    return res


def summarize(rows: list[dict]) -> dict:
    """Median, 10th and 90th percentile of each phase over CTAs, for all CTAs and by wave."""
    def stats(xs):
        xs = sorted(x for x in xs if x is not None)
        if not xs:
            return None
        pick = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
        return {"median": statistics.median(xs), "p10": pick(0.1), "p90": pick(0.9), "max": xs[-1], "n": len(xs)}
    keys = ("start", "q", "loop", "loop_per_tile", "lag", "merge", "store", "epilogue", "cta", "producer", "spread",
            "end") + SEG_KEYS
    result = {"all": {k: stats(r[k] for r in rows) for k in keys}}
    for name, want in (("first_wave", False), ("later_waves", True)):
        sub = [r for r in rows if r["later_wave"] == want]
        if sub:
            result[name] = {k: stats(r[k] for r in sub) for k in keys}
    return result


def main(argv=None) -> int:
    def extra(p):
        p.add_argument("--hot", action="store_true",
                       help="no L2 flush before the traced call (the same call just ran): data and code warm")
    setup = bench.tool_setup(argv, __doc__, "trace", extra=extra)
    if setup is None:
        return 1
    args, cases, q_len, dtype, sm_count = setup
    device = torch.device("cuda")
    trace_buf = TraceBuffer()
    if trace_buf.capacity == 0:
        print("this library has no trace buffer: build it with CUDAFLAGS=-DMLA_TRACE=1 (and point "
              "MLA_VARIANTS_GENERATED at that build)", file=sys.stderr)
        return 1
    pool, flush = bench.KVPool(device), bench.L2Flush(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    report = []
    for case in cases:
        heads, page, seq_lens = case["num_heads"], case["page_size"], case["seq_lens"]
        batch = len(seq_lens)
        name = f"{heads} x {batch} x {case['seq_mean']}{' ragged' if case.get('ragged') else ''} p{page}"
        splits = bench.case_splits(case, args, q_len, sm_count)
        split = splits > 1 or args.balanced
        token = bench.variant_dtype(args, heads)  # the variants the call dispatches to (fp8 fast mode included)
        launch = the_launch(heads, page, token, split)  # the launch mla_decode (or the plan) makes
        if launch is None:
            try:
                symbols = [l.symbol for l in _binding.library().plan(heads, page, token, split)]
            except LookupError:
                symbols = []
            print(f"{name}: skipped (the call is not one launch of a {heads}-head page-{page} {token} "
                  f"variant in this build: {symbols or 'no variant'})")
            continue
        inputs = bench.build_inputs(pool, seq_lens, heads, page, q_len, dtype, gen)
        call, out, lse = bench.decode_call(inputs, splits)
        warm = bench.code_warm_call(case, splits, dtype, q_len, gen) if args.code_warm else None
        bound = inputs["block_table"].shape[1] * page  # the launcher's bound: decode_call gives no max_seq_len
        m_blocks = -(-heads * q_len // rows_per_cta(launch, bound, splits, q_len))
        grid_x, grid_y = m_blocks * batch, splits
        if args.balanced:
            call, plan, schedule = bench.balanced_call(inputs, out, lse, args.num_kv_splits, args.schedule_overhead)
            if schedule is None:
                print(f"{name}: skipped (the balanced schedule does not serve this case)")
                continue
            step = plan.scheduled_step()
            splits = bench.schedule_label(step)
            if step.batch == 1:  # one request: the uniform split
                grid_x, grid_y = m_blocks * batch, step.num_kv_splits
            elif step.per_segment:  # transposed: one CTA per segment
                grid_x, grid_y = m_blocks * (batch + step.ctas), 1
            else:
                grid_x, grid_y = m_blocks * step.ctas, 1

        if grid_x * grid_y > trace_buf.capacity:
            print(f"{name}: note: {grid_x * grid_y} CTAs, only the first {trace_buf.capacity} stamp", file=sys.stderr)
        for _ in range(args.warmup):
            call()
        rows = []
        for _ in range(args.reps):
            if args.hot:
                call()  # the traced call finds everything this one brought in
            trace_buf.clear()
            if not args.hot:
                flush()
            if warm is not None:  # the code-warm call must not stamp over the timed call's words
                trace_buf.enable(False)
                warm()
                trace_buf.enable(True)
            call()
            rows += phases(cta_records(trace_buf.read(grid_x * grid_y), m_blocks, grid_x))
        if not rows:
            print(f"{name}: no stamps (is this an MLA_TRACE=1 build?)", file=sys.stderr)
            return 1
        summary = summarize(rows)
        if args.balanced:
            summary["cost_fit"] = fit_cost(rows)
        report.append({"case": {k: case.get(k) for k in ("num_heads", "batch", "seq_mean", "page_size", "ragged")},
                       "num_kv_splits": splits, "code_warm": args.code_warm, "hot": args.hot, "summary": summary,
                       "ctas": rows})  # every CTA's phases of every call, for a look beyond the percentiles
        print(f"\n{name}, {splits} split(s), {len(rows)} CTA records over {args.reps} calls"
              f"{' (code warm)' if args.code_warm else ''}{' (hot)' if args.hot else ''}: us, median [p10, p90]")
        for group, table in summary.items():
            if group == "cost_fit":
                if table:
                    print(f"  CTA time ~ {table['fixed_us']:.2f} + {table['per_tile_us']:.3f} x tiles + "
                          f"{table['per_segment_us']:.2f} x segments us (rms residual {table['rms_residual_us']:.2f}, "
                          f"{table['n']} CTAs)")
                continue
            cells = [f"{k} {v['median']:.2f} [{v['p10']:.2f}, {v['p90']:.2f}] max {v['max']:.2f}" for k, v in table.items() if v is not None]
            print(f"  {group} ({table['cta']['n'] if table['cta'] else 0} CTAs): " + "; ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
