"""The fp8 fast-mode kernel (templates/mla/fp8_fast.cuh) before it has a dtype in variants.yaml: checked
against the fp32 reference and timed against our exact fp8 kernel and the anchors' peers, through the
lab launchers in lab/fp8_fast_launch.cu (a shared object built with nvcc, --so).

Correctness: fresh random fp8 cases (NaN-poisoned slots, permuted block tables, NaN-prefilled out /
lse), max abs error of out and lse against mla_decode_reference next to our exact kernel's.
Speed: the fp8 anchor shapes of ../shared/anchors-h200-modes.json at 64 and 128 heads, cold (L2
flushed, benchmarks/bench.py time_cold), against the exact kernel and the anchors' vLLM fork.

    python3 lab/fp8_fast_check.py --so /tmp/fp8_fast.so [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mla_variants import mla_decode, mla_decode_reference, workspace_size  # noqa: E402
from mla_variants.launching import current_stream, pack  # noqa: E402
from mla_variants.testing import make_paged_case  # noqa: E402
from mla_variants.validation import validate  # noqa: E402
import bench  # noqa: E402


def fast_call(lib, q, kv, bt, sl, scale, k_scale, out, lse, splits=1):
    """One launch of the fast kernel for (num_heads, page_size) of the inputs (and the combine for
    splits > 1, its workspace allocated here); returns a callable."""
    heads, page = q.shape[2], kv.shape[1]
    fn = getattr(lib, f"fast_h{heads}_p{page}")
    c = validate(q, kv, bt, sl, scale, splits, out, lse, k_scale)
    launch = SimpleNamespace(symbol="fast", num_heads=heads, head_start=0)
    ws_bytes = workspace_size(q.shape[0], heads, q.shape[1], splits) if splits > 1 else 0
    ws = torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device=q.device)
    (_, packed), = pack(c, [launch], splits, ws, ws_bytes, current_stream(q.device.index))
    buf = ctypes.create_string_buffer(packed, len(packed))

    def call():
        code = fn(buf)  # ws stays alive with this closure
        _ = ws
        if code != 0:
            raise RuntimeError(f"fast kernel launch failed: CUDA error {code}")
    return call


def errors(out, lse, ref_out, ref_lse):
    fin = torch.isfinite(ref_lse)
    return (float((out.float() - ref_out.float()).abs().max()),
            float((lse[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0,
            bool(torch.isnan(out).any() or torch.isnan(lse).any()))


def check(lib, results, quick=False):
    for heads, page in ((128, 64),) if quick else ((128, 64), (128, 1), (64, 64)):
        for q_len in (1, 2):
            for k_scale in (1.0,) if quick else (0.0625, 1.0, 37.5):
                g = torch.Generator().manual_seed(heads + page + q_len)
                lens = [1, 200, 129, 0] if quick else [1, 700, 4100, 0, 64, 129]
                case = make_paged_case(lens, heads, page, q_len, torch.float8_e4m3fn, generator=g, k_scale=k_scale)
                ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                        case.softmax_scale, k_scale=case.k_scale)
                fo = fl = 0.0
                fnan = False
                empty_ok = True
                for splits in (1, 7):
                    out = torch.full((len(lens), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                    lse = torch.full((len(lens), heads, q_len), float("nan"), device="cuda")
                    fast_call(lib, case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                              case.k_scale, out, lse, splits)()
                    torch.cuda.synchronize()
                    o_err, l_err, has_nan = errors(out, lse, ref_out, ref_lse)
                    fo, fl, fnan = max(fo, o_err), max(fl, l_err), fnan or has_nan
                    # request 3 has seq_len 0: out 0, lse -inf
                    empty_ok = empty_ok and bool((out[3] == 0).all()) and bool(torch.isinf(lse[3]).all())
                eo = el = float("nan")
                if heads == 128:  # the exact kernel of the lab build (64 heads would JIT-build)
                    ex_out, ex_lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale, k_scale=case.k_scale)
                    eo, el, _ = errors(ex_out, ex_lse, ref_out, ref_lse)
                row = dict(heads=heads, page=page, q_len=q_len, k_scale=k_scale, fast_out_err=fo, fast_lse_err=fl,
                           fast_nan=fnan, exact_out_err=eo, exact_lse_err=el, empty_ok=empty_ok)
                results["check"].append(row)
                print(f"check h{heads} p{page} q{q_len} k_scale {k_scale}: fast out {fo:.2e} lse {fl:.2e} nan {fnan} "
                      f"empty {empty_ok} | exact out {eo:.2e} lse {el:.2e}", flush=True)


def speed(lib, results, reps):
    anchors = json.loads((ROOT / "shared" / "anchors-h200-modes.json").read_text())
    device = torch.device("cuda")
    pool, flush, gen = bench.KVPool(device), bench.L2Flush(device), torch.Generator(device="cuda").manual_seed(0)
    for case in anchors["cases"]:
        if case["kv_dtype"] == "bf16" or case["num_heads"] < 64:
            continue
        heads, page = case["num_heads"], case["page_size"]
        inputs = bench.build_inputs(pool, case["seq_lens"], heads, page, case["q_len"], torch.float8_e4m3fn, gen)
        b = len(case["seq_lens"])
        out = torch.empty(b, case["q_len"], heads, 512, dtype=torch.bfloat16, device=device)
        lse = torch.empty(b, heads, case["q_len"], device=device)
        splits = bench.case_splits(case, SimpleNamespace(num_kv_splits=None, dtype="fp8_e4m3", fp8_mode="exact"), case["q_len"],
                                   torch.cuda.get_device_properties(0).multi_processor_count)
        fast = fast_call(lib, inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"],
                         bench.SOFTMAX_SCALE, bench.K_SCALE, out, lse, splits)
        t_fast = bench.time_cold(fast, flush, reps, 3)
        # accuracy on these inputs: the first two requests against the fp32 reference (on the GPU)
        fast()
        n = min(b, 2)
        sub = [inputs[k][:n] for k in ("q", "kv_cache", "block_table", "seq_lens")]
        sub[1] = inputs["kv_cache"]
        ref_out, ref_lse = mla_decode_reference(*sub, bench.SOFTMAX_SCALE, k_scale=bench.K_SCALE)
        f_err = errors(out[:n], lse[:n], ref_out, ref_lse)
        t_exact = float("nan")
        if heads == 128:  # the exact kernel of the lab build (64 heads would JIT-build)
            exact, _, _ = bench.decode_call(inputs, splits)
            t_exact = bench.time_cold(exact, flush, reps, 3)
        fork = case["peers_us"].get("vllm_flashmla_fp8")
        fork_err = case["peers_err"].get("vllm_flashmla_fp8")
        row = dict(heads=heads, batch=b, seq=case["seq_mean"], ragged=case["ragged"], page=page, fast_us=t_fast,
                   exact_us=t_exact, splits=splits, fork_us=fork, best_us=case["best_us"], fast_out_err=f_err[0],
                   fast_lse_err=f_err[1], fork_err=fork_err)
        results["speed"].append(row)
        print(f"speed h{heads} b{b} s{case['seq_mean']}{'v' if case['ragged'] else ''} p{page} ({splits} splits): fast "
              f"{t_fast:.1f} us, out err {f_err[0]:.1e} lse err {f_err[1]:.1e} | exact {t_exact:.1f} us | fork {fork} "
              f"err {fork_err} | best {case['best_us']} -> fork/fast {fork / t_fast if fork else float('nan'):.2f}",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", required=True)
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one small check per q_len (for the sanitizers)")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.so)
    for name in ("fast_h128_p64", "fast_h128_p1", "fast_h64_p64"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    results = {"check": [], "speed": []}
    check(lib, results, args.quick)
    if not args.skip_speed:
        speed(lib, results, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
