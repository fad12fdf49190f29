"""Does each compile-time axis pay? Times a specialized variant against the next more generic one on
identical inputs (issue 3: an axis that does not pay becomes a run-time parameter).

    python lab/specialization.py [--json PATH] [--reps N]

Pairs, each on the same q / cache / block_table / seq_lens, cold L2 (as benchmarks/bench.py):
  num_heads  the exact head-count variant vs the next larger compiled one serving it with masked rows
  page_size  the page-P variant vs the page-1 variant reading the same bytes as 1-token pages
  split      the nosplit variant vs the split variant run with one split
  dtype      bf16 vs fp16 (the issue's bar: fp16 within 3% of bf16)
A ratio generic / specialized above 1 means the specialization pays.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench.py (which puts this checkout first)
from bench import REPO, KVPool, L2Flush, build_inputs, time_cold  # noqa: E402

import torch  # noqa: E402

from mla_variants import _binding, mla_decode  # noqa: E402
from mla_variants.testing import as_token_pages  # noqa: E402

CASES = [  # (num_heads, batch, seq_len, page_size)
    (16, 32, 16384, 64), (16, 128, 4096, 64), (32, 32, 16384, 16), (64, 32, 16384, 64), (8, 64, 8192, 128),
    (32, 128, 4096, 1), (64, 128, 4096, 16), (128, 32, 16384, 64), (128, 128, 4096, 1),
]


@contextlib.contextmanager
def only_variants(keep):
    """Serve calls from the subset of the dispatch table for which keep(key) is true."""
    lib = _binding.library()
    table = lib.table
    lib.table, lib._plans = {k: v for k, v in table.items() if keep(k)}, {}
    try:
        yield
    finally:
        lib.table, lib._plans = table, {}


def timed(inputs, flush, reps, **kw) -> float:
    args = (inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], (128 + 64) ** -0.5)
    return time_cold(lambda: mla_decode(*args, num_kv_splits=1, **kw), flush, reps, warmup=3)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--json", default=str(REPO / "bench-results" / "specialization.json"))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this benchmark needs an sm_90a GPU", file=sys.stderr)
        return 1
    table = _binding.library().table
    device = torch.device("cuda", torch.cuda.current_device())
    pool, flush, gen = KVPool(device), L2Flush(device), torch.Generator(device=device).manual_seed(0)
    rows = []
    print(f"{'axis':>9} {'case (heads, batch, seq, page)':>30} {'specialized':>28} {'us':>8} {'generic':>28} {'us':>8} {'ratio':>6}")
    for heads, batch, seq, page in CASES:
        dtype = torch.bfloat16
        if (heads, page, "bf16", False) not in table:
            print(f"skip {heads}h p{page}: not built")
            continue
        inputs = build_inputs(pool, [seq] * batch, heads, page, 1, dtype, gen)
        spec = timed(inputs, flush, args.reps)
        name = table[(heads, page, "bf16", False)]
        pairs = []
        larger = sorted(k[0] for k in table if k[0] > heads and k[1:] == (page, "bf16", False))
        if larger:
            with only_variants(lambda k: k[0] != heads):
                pairs.append(("num_heads", table[(larger[0], page, "bf16", False)], timed(inputs, flush, args.reps)))
        if page > 1 and (heads, 1, "bf16", False) in table:
            kv1, table1 = as_token_pages(inputs["kv_cache"], inputs["block_table"])
            tok = dict(inputs, kv_cache=kv1, block_table=table1)
            pairs.append(("page_size", table[(heads, 1, "bf16", False)], timed(tok, flush, args.reps)))
        if (heads, page, "bf16", True) in table:
            with only_variants(lambda k: not (k[1:] == (page, "bf16", False))):
                pairs.append(("split", table[(heads, page, "bf16", True)], timed(inputs, flush, args.reps)))
        if (heads, page, "fp16", False) in table:
            half = dict(inputs, q=inputs["q"].half(), kv_cache=inputs["kv_cache"].half())
            pairs.append(("dtype", table[(heads, page, "fp16", False)], timed(half, flush, args.reps)))
            del half
        for axis, generic, us in pairs:
            rows.append(dict(axis=axis, case=[heads, batch, seq, page], specialized=name, specialized_us=spec,
                             generic=generic, generic_us=us, ratio=us / spec))
            print(f"{axis:>9} {str((heads, batch, seq, page)):>30} {name:>28} {spec:8.1f} {generic:>28} {us:8.1f} "
                  f"{us / spec:6.3f}", flush=True)
        del inputs
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
