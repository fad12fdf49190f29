#!/usr/bin/env python3
"""compute-sanitizer over small calls of every kernel path: the GPU check to run before calling a kernel
change done (with the GPU tests and the benchmark).

    python lab/sanitize.py [-j 8]              # memcheck, racecheck and synccheck, each call in its own process
    python lab/sanitize.py --tools racecheck   # one tool
    python lab/sanitize.py --calls [--only N]  # just run the calls (what compute-sanitizer wraps)
    python lab/sanitize.py --calls --repeat 2000  # each call 2000 times: results must be bitwise identical
    python lab/sanitize.py --tma off           # mla_decode's calls load every page by cp.async (plans keep auto)

Needs a build with the variants below (the default `mla-variants build`; a call whose variant is not
built is skipped and named). Every path runs: the transposed path at 8 / 16 / 32 rows (16-bit and fp8),
the 64-row path with cp.async and TMA pages, staged and paired epilogues, split and not, both second
kernels (the 64-row kernel of 17..32 heads on short splits, the fp8 short-split kernel), the balanced
schedule (64-row walk and transposed one CTA per segment), the fp8 fast kernel (uniform, scheduled, and scheduled on 2 CTAs so its ring wraps), q_len
2 and 4 (a transposed variant's larger row blocks), and every combine kernel (2-8, 9-16, 17-31 and 32+
splits). Calls are tiny (racecheck instruments every shared-memory access) and their results are
checked against the fp32 reference. Exit status 0 only if every tool reports 0 errors and 0 hazards
(racecheck also reports the patterns docs/performance.md lists under "racecheck", which it does not
model).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, num_heads, page_size, dtype, seq_lens, q_len, num_kv_splits, extra): extra "short" passes
# max_seq_len=1 (every split short: the variant's second kernel), "balanced" runs MLADecodePlan's schedule,
# "fast" fp8_mode="fast" (the fp8 fast kernel; "balanced-fast": its scheduled instantiation; "-wrap": the
# schedule cut for 2 CTAs per row block instead of the GPU's, so each CTA walks segments of ~18 tiles
# and its 4-stage ring wraps across them, which the full-GPU schedule of a small call never does).
CALLS = [
    ("st8-bf16-split", 8, 1, "bf16", [150, 1, 0], 1, 3, ""),
    ("st8-fp8-split", 8, 16, "fp8", [150, 70], 1, 2, ""),
    ("st16-bf16-nosplit", 16, 64, "bf16", [200, 65], 1, 1, ""),
    ("st16-fp16-split", 16, 16, "fp16", [300, 3], 1, 12, ""),
    ("st16-fp8-split", 16, 64, "fp8", [260, 64], 1, 2, ""),
    ("st32-bf16-long", 32, 1, "bf16", [2100, 1500], 1, 1, ""),
    ("st16-q2-rows32-bf16-split", 16, 16, "bf16", [300, 70], 2, 2, ""),
    ("st8-q4-rows32-fp8-split", 8, 1, "fp8", [150, 90], 4, 2, ""),
    ("st8-q2-rows16-bf16-split", 8, 64, "bf16", [200, 33], 2, 3, ""),
    ("st8-q5-masked-bf16-split", 6, 1, "bf16", [150, 3], 5, 2, ""),  # 40 rows: the 64-row kernel, 24 rows padding
    ("st16-q4-rows64-bf16-split", 16, 16, "bf16", [300, 70], 4, 2, ""),  # 64 rows: the 64-row kernel
    ("st16-q3-rows64-fp16-tma", 16, 64, "fp16", [330, 64], 3, 2, ""),  # 48 rows: the 64-row kernel, TMA pages
    ("st32-bf16-short-rows64", 32, 64, "bf16", [300, 129], 2, 3, "short"),
    ("st32-fp8-split", 32, 1, "fp8", [333, 90], 1, 2, ""),
    ("r64-bf16-p1-split", 64, 1, "bf16", [250, 64, 1], 1, 3, ""),
    ("r64-bf16-p64-nosplit-staged", 64, 64, "bf16", [260, 128], 1, 1, ""),
    ("r64-bf16-p64-split-tma", 128, 64, "bf16", [520, 200], 2, 20, ""),
    ("r64-bf16-balanced", 64, 64, "bf16", [700, 30, 0, 1100], 1, None, "balanced"),
    ("r64-fp16-p128-split-wide", 128, 128, "fp16", [2300], 1, 36, ""),
    ("r64-fp8-p64-long-tma", 64, 64, "fp8", [600, 257], 1, 2, ""),
    ("r64-fp8-p64-short", 128, 64, "fp8", [400, 100], 1, 4, "short"),
    ("r64-fp8-p1-nosplit", 128, 1, "fp8", [190, 64], 2, 1, ""),
    ("r64-fp8fast-p64-split", 128, 64, "fp8", [700, 3000], 1, 4, "fast"),
    ("r64-fp8fast-p16-balanced", 64, 16, "fp8", [700, 30, 0, 1100, 5000], 2, None, "balanced-fast"),
    ("r64-fp8fast-p64-balanced-wrap", 128, 64, "fp8", [900, 40, 1300], 1, None, "balanced-fast-wrap"),
    # The transposed path on the balanced schedule: one CTA per segment (empty trailing CTAs included).
    ("st16-bf16-balanced", 16, 1, "bf16", [700, 30, 0, 1100, 64], 1, None, "balanced"),
    ("st16-q2-rows32-fp8-balanced", 16, 64, "fp8", [900, 1, 300], 2, None, "balanced"),
]


def run_calls(only: int | None, repeat: int = 1, tma: str = "auto") -> int:
    import torch

    from mla_variants import MLADecodePlan, VariantNotCompiledError, mla_decode, mla_decode_reference
    from mla_variants.testing import FP8_FAST_TOLERANCE, FP8_TOLERANCE, compare, make_paged_case

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
    failed = 0
    for i, (name, heads, page, dt, lens, q_len, splits, extra) in enumerate(CALLS):
        if only is not None and i != only:
            continue
        g = torch.Generator().manual_seed(i)
        case = make_paged_case(lens, heads, page, q_len, dtypes[dt], generator=g)
        kw = {"k_scale": case.k_scale} if case.k_scale is not None else {}
        mode_kw = {"fp8_mode": "fast"} if "fast" in extra else {}
        out = torch.full((len(lens), q_len, heads, 512), float("nan"), dtype=case.q.dtype, device="cuda")
        lse = torch.full((len(lens), heads, q_len), float("nan"), device="cuda")
        try:
            if extra.startswith("balanced"):
                plan = MLADecodePlan(len(lens), heads, page, q_len=q_len, max_seq_len=max(lens), balanced=True,
                                     kv_dtype=case.kv_cache.dtype, **mode_kw)
                if extra.endswith("-wrap"):
                    plan.sched_ctas = 2  # fewer CTAs than the plan sized its workspace for: still fits
                plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page)

                def launch():
                    plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                             out=out, lse=lse, **kw)
            else:
                def launch():
                    mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                               num_kv_splits=splits, out=out, lse=lse, max_seq_len=1 if extra == "short" else None,
                               tma=tma, **kw, **mode_kw)
            launch()
            torch.cuda.synchronize()
        except VariantNotCompiledError as e:
            print(f"[{i}] {name}: skipped, not built ({str(e).split('.')[0]})", flush=True)
            continue
        ref = mla_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_table.cpu(), case.seq_lens.cpu(),
                                   case.softmax_scale, **kw)
        tolerance = FP8_FAST_TOLERANCE if "fast" in extra else FP8_TOLERANCE if dt == "fp8" else {}
        problems = compare(out.cpu(), lse.cpu(), *ref, **tolerance)
        if repeat > 1:
            # A real shared-memory race shows as run-to-run variation: every launch must give the same bits.
            first_out, first_lse = out.clone(), lse.clone()
            differ = 0
            for _ in range(repeat - 1):
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                launch()
                same = (out.view(torch.int16) == first_out.view(torch.int16)).all() and \
                    (lse.view(torch.int32) == first_lse.view(torch.int32)).all()
                differ += int(not bool(same))
            if differ:
                problems = (problems or []) + [f"{differ} of {repeat - 1} repeats differ bitwise from the first"]
        failed += bool(problems)
        print(f"[{i}] {name}: {'ok' if not problems else problems}", flush=True)
    return 1 if failed else 0


def _one(tool: str, only: int | None, env: dict, extra: list[str], print_limit: int = 200,
         tma: str = "auto") -> tuple[str, bool, str]:
    """compute-sanitizer `tool` over the calls (or call `only`): (its summary, clean?, the report)."""
    cmd = ["compute-sanitizer", f"--tool={tool}", f"--print-limit={print_limit}"] + extra
    if tool == "racecheck":
        cmd += ["--racecheck-report=hazard"]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--calls", "--tma", tma] + ([] if only is None else ["--only", str(only)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    text = proc.stdout + proc.stderr
    summary = re.findall(r"=+ (?:RACECHECK|ERROR) SUMMARY: .*", text)
    counts = [int(n) for line in summary for n in re.findall(r"(\d+) (?:hazards?|errors?)", line)]
    clean = proc.returncode == 0 and bool(summary) and not any(counts) and "ok" in text
    return ("; ".join(summary) or "(no summary line)") + f" (exit {proc.returncode})", clean, text


def _sites(text: str) -> list[str]:
    """The distinct (write site, read site) pairs of a racecheck report, with how often each was shown."""
    pairs: dict[str, int] = {}
    for block in text.split("hazard detected")[1:]:
        where = re.findall(r"(Write|Read) Thread \(\d+,0,0\) at .*? in ([\w./]+:\d+)", block)
        key = " vs ".join(f"{kind.lower()} {site}" for kind, site in where[:2])
        pairs[key] = pairs.get(key, 0) + 1
    return [f"{n} x {k}" for k, n in sorted(pairs.items(), key=lambda kv: -kv[1])]


def sanitize(tools: list[str], only: int | None, jobs: int, extra: list[str] = (), full: str | None = None,
             print_limit: int = 200, tma: str = "auto") -> int:
    """Each tool over each call in its own process (`jobs` at a time): a summary line per call."""
    import concurrent.futures

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    calls = [only] if only is not None else list(range(len(CALLS)))
    worst = 0
    for tool in tools:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = pool.map(lambda i: _one(tool, i, env, list(extra), print_limit, tma), calls)  # printed as they come, in order
            for i, (summary, clean, text) in zip(calls, results):
                worst = max(worst, int(not clean))
                print(f"{tool} [{i}] {CALLS[i][0]}: {summary}", flush=True)
                if full and not clean:
                    Path(full).mkdir(parents=True, exist_ok=True)
                    (Path(full) / f"{tool}-{i}.txt").write_text(text)
                if not clean:
                    sites = _sites(text)
                    print("\n".join(f"    {line}" for line in sites[:8 if print_limit else None]) if sites else text[-3000:],
                          flush=True)
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", action="store_true", help="run the calls only (under compute-sanitizer)")
    ap.add_argument("--only", type=int, default=None, help="run call N only")
    ap.add_argument("--tools", default="memcheck,racecheck,synccheck")
    ap.add_argument("--sanitizer-args", default="", help="extra compute-sanitizer options (space-separated)")
    ap.add_argument("--print-limit", type=int, default=200,
                    help="reports compute-sanitizer shows per call (0: all; then every site pair is listed)")
    ap.add_argument("--full-reports", default=None, help="write each unclean call's whole report into this folder")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --calls: launch each call N times and require bitwise identical results")
    ap.add_argument("--tma", choices=("auto", "off"), default="auto",
                    help="mla_decode's tma argument for the calls (off: pages TMA would load go by cp.async)")
    ap.add_argument("-j", "--jobs", type=int, default=8, help="sanitizer processes at a time (one call each)")
    args = ap.parse_args()
    if args.calls:
        return run_calls(args.only, args.repeat, args.tma)
    return sanitize(args.tools.split(","), args.only, args.jobs, args.sanitizer_args.split(), args.full_reports,
                    args.print_limit, args.tma)


if __name__ == "__main__":
    sys.exit(main())
