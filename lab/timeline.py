"""Where the time of one cold call goes: the decode kernel, the gap to the combine kernel, the combine.

    python lab/timeline.py --page 64 --batch 1,32 --seq 1024 [--dtype fp8_e4m3] [--reps 20]

Takes the same case filters as benchmarks/bench.py (anchor cases, --heads/--batch/--seq/--page/--ragged,
--dtype, --num-kv-splits). Each case is called --reps times the way bench.py times a cold call (L2
flushed by a 512 MiB read, then a GPU spin, then the call), under torch.profiler, and the CUDA kernel
records of each call are read back from the profiler's device timeline:

  lead    : start of the decode kernel - end of the spin kernel before it (launch latency while the
            GPU was busy: what remains of the launch once the host is off the critical path)
  decode  : duration of mla_decode_kernel (mla_decode_fp8_fast_kernel in fp8 fast mode)
  gap     : start of the combine kernel - end of the decode kernel (split calls only)
  combine : duration of the combine kernel (mla_combine_warp_kernel or mla_combine_wide_kernel, or mla_combine_scheduled_kernel after
            MLADecodePlan.schedule; split calls only)
  total   : end of the last kernel of the call - end of the spin (comparable to bench.py's cold time)

Medians over the calls are printed, one row per case. The kernel durations come from CUPTI, so they
do not include the CUDA-event overhead bench.py has; compare totals with bench.py's cold column to see
how much that is.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench.py (which puts this checkout first)
import bench  # noqa: E402  (benchmarks/bench.py: the benchmark's case loading, inputs and L2 flush)
import torch  # noqa: E402

DECODE, COMBINE = "mla_decode", "mla_combine"  # mla_decode_{,fp8_fast_}kernel, mla_combine_{warp,wide,scheduled}_kernel


def split_calls(kernels: list[tuple[str, float, float]]) -> list[dict]:
    """Group a device timeline into calls. kernels: (name, start_us, end_us) of every CUDA kernel in
    launch order. A call is the run of mla_decode/mla_combine kernels after a spin kernel (the L2
    flush's last kernel, whose name contains "spin"; a second flush read stands in for it in torch
    builds without torch.cuda._sleep). Returns per call: lead, decode, gap, combine (None when the
    call had no combine), total, all in microseconds."""
    calls: list[dict] = []
    prev_end: float | None = None  # end of the last non-decode kernel before the current call
    current: dict | None = None
    for name, start, end in kernels:
        if DECODE in name:
            current = {"lead": start - prev_end if prev_end is not None else None, "decode": end - start,
                       "gap": None, "combine": None, "_start": prev_end, "_end": end}
            calls.append(current)
        elif COMBINE in name and current is not None:
            current["gap"] = start - current["_end"]
            current["combine"] = end - start
            current["_end"] = end
        else:  # flush or spin: the next decode kernel starts a new call
            current = None
            prev_end = end
    for c in calls:
        c["total"] = c["_end"] - c["_start"] if c["_start"] is not None else None
        del c["_start"], c["_end"]
    return calls


def _device_kernels(prof) -> list[tuple[str, float, float]]:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    out.sort(key=lambda k: k[1])
    return out


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    setup = bench.tool_setup(argv, __doc__, "timeline")
    if setup is None:
        return 1
    args, cases, q_len, dtype, sm_count = setup
    device = torch.device("cuda")
    pool, flush = bench.KVPool(device), bench.L2Flush(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    print(f"{'heads':>5} {'batch':>5} {'seq':>6} {'page':>4} {'rag':>3} {'splits':>6} "
          f"{'lead':>6} {'decode':>8} {'gap':>6} {'combine':>8} {'total':>8}  (us, median of {args.reps})")
    for case in cases:
        splits = bench.case_splits(case, args, q_len, sm_count)
        heads, page, seq_lens = case["num_heads"], case["page_size"], case["seq_lens"]
        inputs = bench.build_inputs(pool, seq_lens, heads, page, q_len, dtype, gen)
        batch = len(seq_lens)
        call, out, lse = bench.decode_call(inputs, splits)
        if args.balanced:  # MLADecodePlan.run after schedule() (as bench.py --balanced)
            call, plan, schedule = bench.balanced_call(inputs, out, lse, args.num_kv_splits, args.schedule_overhead)
            if schedule is not None:
                splits = bench.schedule_label(plan.scheduled_step())

        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                flush()
                call()
            torch.cuda.synchronize()
        calls = split_calls(_device_kernels(prof))
        if not calls:
            print(f"no {DECODE} records in the profile (is CUPTI available?)", file=sys.stderr)
            return 1
        cells = [_median(c[k] for c in calls) for k in ("lead", "decode", "gap", "combine", "total")]
        fmt = lambda v, w: f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{heads:>5} {batch:>5} {case['seq_mean']:>6} {page:>4} {'y' if case['ragged'] else 'n':>3} "
              f"{splits:>6} {fmt(cells[0], 6)} {fmt(cells[1], 8)} {fmt(cells[2], 6)} {fmt(cells[3], 8)} "
              f"{fmt(cells[4], 8)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
