"""Randomized cases against the reference on the GPU (skipped without an sm_90 GPU).

Each case draws batch, q_len, num_heads (1..160), page size (from the build), seq_lens (0, page
boundaries, random, long), junk-filled block tables, split forcing, dtype and strided q/out views.
A failure prints the seed; rerun one case with MLA_FUZZ_SEED=<seed> pytest tests/test_gpu_fuzz.py.
"""
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import mla_decode, mla_decode_reference  # noqa: E402
from mla_variants.testing import FP8_FAST_TOLERANCE, FP8_TOLERANCE, compare, make_paged_case  # noqa: E402

NUM_CASES = int(os.environ.get("MLA_FUZZ_CASES", "3000"))


def _lens(rng, page, n):
    picks = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            picks.append(0)
        elif kind < 0.45:
            picks.append(max(0, page * rng.randint(1, 8) + rng.choice([-1, 0, 1])))
        elif kind < 0.9:
            picks.append(rng.randint(1, 1500))
        else:
            picks.append(rng.randint(1500, 20000))
    return picks


def run_case(seed: int, table) -> list[str]:
    rng = random.Random(seed)
    pages = sorted({k[1] for k in table})
    dtypes = sorted({k[2] for k in table})
    page = rng.choice(pages)
    token = rng.choice(dtypes)
    dtype, fp8_mode = {"bf16": (torch.bfloat16, "exact"), "fp16": (torch.float16, "exact"),
                       "fp8_e4m3": (torch.float8_e4m3fn, "exact"), "fp8_e4m3_fast": (torch.float8_e4m3fn, "fast")}[token]
    fp8 = dtype == torch.float8_e4m3fn
    k_scale = rng.choice([0.0625, 1.0, 37.5]) if fp8 else None
    num_heads = rng.choice([1, 2, 3, 8, 16, 20, 32, 64, 100, 128, 160, rng.randint(1, 160)])
    q_len = rng.choice([1, 1, 2, 3, 4, 8])
    batch = rng.randint(1, 6)
    splits = rng.choice([None, 1, 2, 3, 7, 32, 256])
    case = make_paged_case(_lens(rng, page, batch), num_heads, page, q_len, dtype,
                           generator=torch.Generator().manual_seed(seed), extra_pages=rng.randint(0, 4),
                           max_pages=rng.randint(0, 40), k_scale=k_scale)
    q = case.q
    dtype = q.dtype  # q and out: bf16 for an fp8 cache
    if rng.random() < 0.3:  # q as a strided view of a wider buffer
        wide = torch.zeros(*q.shape[:3], 576 + 64, dtype=dtype, device="cuda")
        wide[..., 64:] = q
        q = wide[..., 64:]
    out = None
    if rng.random() < 0.3:
        out = torch.full((batch, q_len, num_heads, 512 + 128), float("nan"), dtype=dtype, device="cuda")[..., :512]
    scale_arg = k_scale
    if fp8 and rng.random() < 0.5:  # the scale as a device tensor
        scale_arg = torch.tensor([k_scale], dtype=torch.float32, device="cuda")
    got_out, got_lse = mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                  num_kv_splits=splits, out=out, k_scale=scale_arg,
                                  **({"fp8_mode": fp8_mode} if fp8 else {}))
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                            k_scale=k_scale)
    tolerance = (FP8_FAST_TOLERANCE if fp8_mode == "fast" else FP8_TOLERANCE) if fp8 else {}
    problems = compare(got_out, got_lse, ref_out, ref_lse, **tolerance)
    return [f"seed={seed} (page {page}, {f'fp8 {fp8_mode} k_scale ' + str(k_scale) if fp8 else dtype}, heads {num_heads}, q_len {q_len}, seq_lens {case.seq_lens.tolist()}, "
            f"splits {splits}): {p}" for p in problems]


def test_fuzz():
    from mla_variants._binding import library
    table = library().table
    seeds = [int(os.environ["MLA_FUZZ_SEED"])] if "MLA_FUZZ_SEED" in os.environ else range(NUM_CASES)
    failures = []
    for seed in seeds:
        failures += run_case(seed, table)
        if len(failures) >= 5:
            break
    assert not failures, "\n".join(failures)
