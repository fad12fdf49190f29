"""JIT on first use on the GPU: a call whose head count, page size or dtype the loaded build lacks
compiles that variant into a fresh cache and then matches the fp32 reference (NaN-prefilled outputs,
NaN in unused cache slots, permuted block tables, q_len 1 and 2, forced splits). Each variant compiles
once per test session (tens of seconds on the GPU host)."""
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import _binding, mla_decode_reference  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, compare, make_paged_case, run_nan_prefilled  # noqa: E402


@pytest.fixture(scope="module")
def jit_library(tmp_path_factory):
    """A library with JIT on, a fresh cache and no AOT build, as the process-wide one for this module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLA_VARIANTS_JIT", "1")
    mp.setenv("MLA_VARIANTS_CACHE", str(tmp_path_factory.mktemp("jit_cache")))
    lib = _binding.Library(tmp_path_factory.mktemp("no_aot_build"))
    mp.setattr(_binding, "_library", lib)
    yield lib
    mp.undo()


@pytest.mark.parametrize("num_heads, page_size, dtype", [(24, 16, torch.bfloat16), (48, 64, torch.bfloat16),
                                                         (96, 1, torch.bfloat16), (24, 64, torch.float8_e4m3fn)])
def test_first_call_compiles_the_variant_and_matches_the_reference(jit_library, num_heads, page_size, dtype):
    g = torch.Generator().manual_seed(num_heads * 1000 + page_size)
    t0 = time.monotonic()
    for q_len in (1, 2):
        case = make_paged_case([0, 1, page_size + 1, 1500, 70], num_heads, page_size, q_len, dtype, generator=g)
        ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                   k_scale=case.k_scale)
        for splits in (None, 1, 5):
            out, lse = run_nan_prefilled(case, splits)
            problems = compare(out, lse, *ref, **(FP8_TOLERANCE if case.k_scale is not None else {}))
            assert not problems, f"{num_heads} heads page {page_size} {dtype} q_len {q_len} splits {splits}: {problems}"
    token = "fp8_e4m3" if dtype == torch.float8_e4m3fn else "bf16"
    assert (num_heads, page_size, token, True) in jit_library.table, "the call did not run on its own variant"
    print(f"{num_heads} heads, page {page_size}, {token}: JIT build and checks in {time.monotonic() - t0:.1f} s")


def test_first_fast_fp8_call_of_40_heads_compiles_its_fast_variant(jit_library):
    """fp8_mode="fast" at 40 heads (33-63: no default-build head count) compiles the fp8_e4m3_fast variant of
    exactly 40 heads on first use; its split pieces (fast::Piece) go through the combine; a 16-head fast call
    compiles the exact fp8_e4m3 variant it runs (codegen.variant.call_dtype)."""
    from mla_variants.testing import FP8_FAST_TOLERANCE
    g = torch.Generator().manual_seed(40)
    case = make_paged_case([0, 1, 65, 1500, 3000], 40, 64, 2, torch.float8_e4m3fn, generator=g, k_scale=0.5)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.5)
    for splits in (1, 5):
        out, lse = run_nan_prefilled(case, splits, k_scale=0.5, fp8_mode="fast")
        problems = compare(out, lse, *ref, **FP8_FAST_TOLERANCE)
        assert not problems, f"40 heads fast splits {splits}: {problems}"
    assert (40, 64, "fp8_e4m3_fast", True) in jit_library.table
    small = make_paged_case([300, 70], 16, 64, 1, torch.float8_e4m3fn, generator=g, k_scale=0.5)
    run_nan_prefilled(small, 2, k_scale=0.5, fp8_mode="fast")
    assert (16, 64, "fp8_e4m3", True) in jit_library.table
    assert not any(k[2] == "fp8_e4m3_fast" and k[0] <= 32 for k in jit_library.table)
