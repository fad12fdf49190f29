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
