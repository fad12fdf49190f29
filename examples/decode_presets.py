"""One MLA decode step for each model preset of variants.yaml, checked against the fp32 reference.

Usage (from the repository root, after ``mla-variants build`` or ``mla-variants build --preset NAME``):

    python examples/decode_presets.py                     # every preset except `ci`
    python examples/decode_presets.py --preset kimi-k2    # one preset (repeatable)
    python examples/decode_presets.py --batch 64 --seed 1

For each preset (DeepSeek-V3 at TP 1/2/4/8/16, DeepSeek-V2-Lite, Kimi-K2) this builds a realistic
ragged decode batch (default 24 requests, seq_lens drawn uniformly from 200..12000 tokens, pages
randomly permuted over one pool), runs ``mla_decode`` at the first of the preset's page sizes the build
serves (bf16 preferred over fp16), compares with ``mla_decode_reference`` (fp32) and prints: heads,
page size, batch, total tokens, the num_kv_splits the library's heuristic picks, the time per call
(CUDA events, median of 20 after warm-up, L2 flushed before each call), the max abs error and
PASS/FAIL. DeepSeek-V3 TP1 also runs a multi-token-prediction step (q_len 2, causal).

A preset counts as built when the build holds a variant with exactly the preset's head count (a call
could also be served by a larger compiled head count or by head groups: --allow-fallback runs those).
Presets not built are reported with the command that builds them.

Exit status: 0 when every preset that ran passed (also when no CUDA GPU is present: nothing runs),
1 when a preset failed or the kernels were never built.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # use this checkout's package (and its generated/ + build/)

import torch  # noqa: E402

from codegen.config import load_config  # noqa: E402
from mla_variants import (LibraryNotBuiltError, default_num_kv_splits, is_supported, list_variants,  # noqa: E402
                          mla_decode, mla_decode_reference)
from mla_variants.testing import compare, make_paged_case  # noqa: E402

SOFTMAX_SCALE = (128 + 64) ** -0.5   # DeepSeek: 1 / sqrt(qk_nope_head_dim 128 + qk_rope_head_dim 64)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MTP_PRESETS = {"deepseek-v3-tp1"}    # also run one q_len 2 (multi-token prediction) step
SKIP_PRESETS = {"ci"}
FLUSH_BYTES = 512 << 20


@dataclass
class Plan:
    """What to run for one preset: the head count, and the page size / dtype the build serves
    (page_size is None when the preset is not built)."""

    name: str
    description: str
    num_heads: int
    page_size: int | None = None
    dtype: str | None = None


def build_command(preset: str | None = None) -> str:
    return "mla-variants build" + (f" --preset {preset}" if preset else "")


def plan_preset(name: str, preset, compiled: set, allow_fallback: bool) -> Plan:
    heads = preset.axes["num_heads"][0]
    plan = Plan(name, preset.description, heads)
    # bf16 first; fp8 caches are exercised by tests/test_gpu_fp8.py and `bench.py --dtype fp8_e4m3`
    dtypes = sorted((d for d in preset.axes["dtype"] if d in TORCH_DTYPES), key=lambda d: d != "bf16")
    for dtype in dtypes:
        for page in preset.axes["page_size"]:
            exact = any((heads, page, dtype, split) in compiled for split in (False, True))
            if (exact or allow_fallback) and is_supported(heads, page, dtype):
                plan.page_size, plan.dtype = page, dtype
                return plan
    return plan


def draw_seq_lens(name: str, batch: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}-{name}")
    return [rng.randint(lo, hi) for _ in range(batch)]


def time_call(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median microseconds per call: CUDA events around each call, with the L2 flushed (a 512 MiB
    read) before it, as a decode step meets its cache in a real model. The flush and a short GPU spin
    keep the GPU busy while Python prepares the launch, so the host overhead of the call is not counted."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda").zero_()
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        torch.sum(flush)
        if hasattr(torch.cuda, "_sleep"):  # keep the GPU busy while Python prepares the launch
            torch.cuda._sleep(1_000_000)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def run_step(plan: Plan, case, q_len: int, compiled: set, allow_fallback: bool, sm_count: int) -> dict:
    """One decode call on `case` (q of this q_len), timed and compared with the fp32 reference."""
    batch, heads = case.q.shape[0], case.q.shape[2]
    capacity = case.block_table.shape[1] * plan.page_size
    splits = default_num_kv_splits(batch, heads, q_len, capacity, sm_count, page_size=plan.page_size,
                                   kv_dtype=plan.dtype)  # what mla_decode picks by default
    note = ""
    split_built = (heads, plan.page_size, plan.dtype, True) in compiled or (
        allow_fallback and is_supported(heads, plan.page_size, plan.dtype, split=True))
    if splits > 1 and not split_built:
        splits, note = 1, "no split variant built: ran unsplit"
    out = torch.empty(batch, q_len, heads, 512, dtype=case.q.dtype, device=case.q.device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=case.q.device)

    def call():
        return mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                          num_kv_splits=splits, out=out, lse=lse)

    call()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    problems = compare(out, lse, ref_out, ref_lse)
    max_err = (out.float() - ref_out).abs().max().item()
    us = time_call(call)
    return dict(splits=splits, us=us, max_err=max_err, problems=problems, note=note)


ROW = "{:<18} {:>5} {:>5} {:>4} {:>5} {:>5} {:>7} {:>6} {:>9} {:>9}  {}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", help="run only this preset (repeatable); default all but `ci`")
    p.add_argument("--batch", type=int, default=24, help="requests per decode step (default 24)")
    p.add_argument("--min-seq", type=int, default=200, help="shortest request, tokens (default 200)")
    p.add_argument("--max-seq", type=int, default=12000, help="longest request, tokens (default 12000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-fallback", action="store_true",
                   help="also run presets whose head count is served only by another compiled head count")
    p.add_argument("--config", default=str(REPO / "variants.yaml"), help="variants file (default: variants.yaml)")
    args = p.parse_args(argv)
    if args.batch < 1 or not 1 <= args.min_seq <= args.max_seq:
        p.error("need --batch >= 1 and 1 <= --min-seq <= --max-seq")

    config = load_config(args.config)
    names = args.preset or [n for n in config.presets if n not in SKIP_PRESETS]
    unknown = [n for n in names if n not in config.presets]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}; presets: {', '.join(config.presets)}")

    try:
        compiled = set(list_variants())
    except LibraryNotBuiltError as e:
        print(f"the kernels are not built: {e}\nbuild them with: {build_command()}   "
              f"(or one preset: {build_command('NAME')})", file=sys.stderr)
        return 1
    except (OSError, AttributeError) as e:  # library missing a symbol of the table, or not loadable
        print(f"the build is incomplete or stale ({e}); rebuild with: {build_command()}", file=sys.stderr)
        return 1

    plans = [plan_preset(n, config.presets[n], compiled, args.allow_fallback) for n in names]

    gpu_problem = None
    if not torch.cuda.is_available():
        gpu_problem = "no CUDA GPU is available on this machine"
    elif torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        gpu_problem = f"the kernels are built for sm_90a and this GPU is sm_{major}{minor}"
    if gpu_problem:
        built = (f"The kernels are built ({len(compiled)} variants)" if compiled
                 else "No variant is built yet (calls would compile theirs on first use)")
        print(f"{built}, but {gpu_problem}: nothing to run here.")
        print("Run this example on an sm_90a GPU (H100/H200). On such a GPU it would run:")
        for plan in plans:
            what = (f"{plan.num_heads} heads, page {plan.page_size}, {plan.dtype}" if plan.page_size
                    else f"not built (run: {build_command(plan.name)})")
            print(f"  {plan.name:<18} {what}")
        return 0

    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sm_count} SMs), torch {torch.__version__}; {len(compiled)} compiled "
          f"variants; batch {args.batch}, seq_lens {args.min_seq}..{args.max_seq}; time = median of 20 calls, cold L2")
    print(ROW.format("preset", "q_len", "heads", "page", "dtype", "batch", "tokens", "splits", "us/call",
                     "max err", "result"))
    failed = 0
    for plan in plans:
        if plan.page_size is None:
            print(f"{plan.name:<18} not built (run: {build_command(plan.name)})")
            continue
        seq_lens = draw_seq_lens(plan.name, args.batch, args.min_seq, args.max_seq, args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        dtype = TORCH_DTYPES[plan.dtype]
        case = make_paged_case(seq_lens, plan.num_heads, plan.page_size, q_len=1, dtype=dtype, device="cuda",
                               softmax_scale=SOFTMAX_SCALE, generator=gen)
        for q_len in ((1, 2) if plan.name in MTP_PRESETS else (1,)):
            if q_len != case.q.shape[1]:  # same cache and pages, fresh queries for the MTP step
                q = torch.randn(args.batch, q_len, plan.num_heads, 576, generator=gen) * 0.1
                case.q = q.to(dtype).to("cuda")
            try:
                r = run_step(plan, case, q_len, compiled, args.allow_fallback, sm_count)
            except (RuntimeError, ValueError, LookupError) as e:  # launch errors, MLAInputError, VariantNotCompiledError
                failed += 1
                print(f"{plan.name:<18} q_len {q_len}: FAIL ({type(e).__name__}: {e})")
                continue
            ok = not r["problems"]
            failed += not ok
            print(ROW.format(plan.name, q_len, plan.num_heads, plan.page_size, plan.dtype, args.batch, sum(seq_lens),
                             r["splits"], f"{r['us']:.1f}", f"{r['max_err']:.2e}", "PASS" if ok else "FAIL"),
                  flush=True)
            for line in r["problems"] + ([r["note"]] if r["note"] else []):
                print(f"{'':<18}   {line}")
        del case
    print(f"\n{'all presets that ran passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
