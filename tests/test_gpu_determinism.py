"""Run-to-run determinism of every kernel path on the GPU (skipped without an sm_90 GPU).

A shared-memory race between warpgroups shows as results that change from launch to launch. Each case
below takes one path (transposed 8 / 16 / 32 rows, q_len 2 and 4 row blocks, the 64-row path with
cp.async and TMA pages, staged epilogue, fp8 ring, the short-split kernels, split combines, the
balanced schedule) and must give bit-identical out and lse over many launches on the same inputs. The
paths and barriers are those that compute-sanitizer's racecheck reports (docs/performance.md,
"Correctness"); lab/sanitize.py --calls --repeat N runs the same check over its calls.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import MLADecodePlan, VariantNotCompiledError, mla_decode  # noqa: E402
from mla_variants.testing import make_paged_case  # noqa: E402

REPEATS = 300
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}

# (num_heads, page_size, dtype, seq_lens, q_len, num_kv_splits, mode): mode "short" makes every split
# short (max_seq_len=1: the variant's second kernel), "balanced" runs MLADecodePlan's schedule, "fast"
# fp8_mode="fast" (the fp8 fast kernel; with "balanced", its scheduled instantiation).
CASES = [
    (8, 1, "bf16", [150, 1, 0], 1, 3, ""),
    (8, 16, "fp8", [150, 70], 1, 2, ""),
    (16, 16, "fp16", [300, 3], 1, 12, ""),
    (16, 16, "bf16", [300, 70], 2, 2, ""),
    (8, 1, "fp8", [150, 90], 4, 2, ""),
    (32, 1, "fp8", [333, 90], 1, 2, ""),
    (32, 64, "bf16", [300, 129], 2, 3, "short"),
    (64, 1, "bf16", [250, 64, 1], 1, 3, ""),
    (64, 64, "bf16", [260, 128], 1, 1, ""),
    (128, 64, "bf16", [520, 200], 2, 20, ""),
    (64, 64, "bf16", [700, 30, 0, 1100], 1, None, "balanced"),
    (64, 64, "fp8", [600, 257], 1, 2, ""),
    (128, 64, "fp8", [400, 100], 1, 4, "short"),
    (128, 1, "fp8", [190, 64], 2, 1, ""),
    (128, 64, "fp8", [700, 3000], 1, 4, "fast"),
    (128, 64, "fp8", [700, 30, 0, 1100, 5000], 2, None, "balanced-fast"),
]


@pytest.mark.parametrize("heads, page, dtype, lens, q_len, splits, mode", CASES,
                         ids=[f"h{c[0]}-p{c[1]}-{c[2]}-q{c[4]}-s{c[5]}{'-' + c[6] if c[6] else ''}" for c in CASES])
def test_bit_identical_over_repeated_launches(heads, page, dtype, lens, q_len, splits, mode):
    case = make_paged_case(lens, heads, page, q_len, DTYPES[dtype], generator=torch.Generator().manual_seed(heads + page))
    kw = {"k_scale": case.k_scale} if case.k_scale is not None else {}
    mode_kw = {"fp8_mode": "fast"} if "fast" in mode else {}
    out = torch.empty(len(lens), q_len, heads, 512, dtype=case.q.dtype, device="cuda")
    lse = torch.empty(len(lens), heads, q_len, device="cuda")
    try:
        if mode.startswith("balanced"):
            plan = MLADecodePlan(len(lens), heads, page, q_len=q_len, max_seq_len=max(lens), balanced=True,
                                 kv_dtype=case.kv_cache.dtype, **mode_kw)
            assert plan.balanced
            plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page)

            def launch():
                plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse,
                         **kw)
        else:
            def launch():
                mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                           num_kv_splits=splits, out=out, lse=lse, max_seq_len=1 if mode == "short" else None, **kw,
                           **mode_kw)
        launch()
    except VariantNotCompiledError as e:
        pytest.skip(f"not in this build: {e}")
    first_out, first_lse = out.clone(), lse.clone()
    outs = torch.empty((REPEATS,) + out.shape, dtype=out.dtype, device="cuda")
    lses = torch.empty((REPEATS,) + lse.shape, dtype=lse.dtype, device="cuda")
    for i in range(REPEATS):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        launch()
        outs[i].copy_(out)
        lses[i].copy_(lse)
    as_bits = {2: torch.int16, 4: torch.int32}
    same_out = (outs.view(as_bits[out.element_size()]) == first_out.view(as_bits[out.element_size()])).flatten(1).all(1)
    same_lse = (lses.view(torch.int32) == first_lse.view(torch.int32)).flatten(1).all(1)
    differ = int((~(same_out & same_lse)).sum())
    assert differ == 0, f"{differ} of {REPEATS} launches differ bitwise from the first"
