"""Variant choice and missing-variant errors, on synthetic dispatch tables (no library needed)."""
import pytest
import torch

from mla_variants.dispatch import Launch, VariantNotCompiledError, is_supported, plan_launches

TABLE = {(h, p, d, s): f"mla_decode_h{h}_p{p}_{d}_{'split' if s else 'nosplit'}"
         for h in (8, 16, 64, 128) for p in (1, 64) for d in ("bf16",) for s in (False, True)}


def test_exact_head_count():
    assert plan_launches(TABLE, 16, 64, "bf16", False) == [Launch((16, 64, "bf16", False), "mla_decode_h16_p64_bf16_nosplit", 0, 16)]


def test_smallest_larger_head_count_with_masked_rows():
    (l,) = plan_launches(TABLE, 20, 1, "bf16", True)
    assert l.key == (64, 1, "bf16", True) and l.num_heads == 20
    assert plan_launches(TABLE, 1, 64, "bf16", False)[0].key[0] == 8


def test_head_groups_beyond_the_largest():
    ls = plan_launches(TABLE, 300, 64, "bf16", True)
    assert [(l.key[0], l.head_start, l.num_heads) for l in ls] == [(128, 0, 128), (128, 128, 128), (64, 256, 44)]


def test_unsplit_call_falls_back_to_a_split_variant():
    only_split = {k: v for k, v in TABLE.items() if k[3]}
    assert plan_launches(only_split, 16, 64, "bf16", False)[0].key == (16, 64, "bf16", True)


def test_head_count_decides_before_the_split_kind():
    """A build with nosplit variants only at some head counts (variants.yaml's exclude rules): an unsplit
    call runs its own head count's split variant with one split, not a larger count's nosplit variant
    (which would mask rows, and at <= 32 heads leave the transposed path)."""
    table = {k: v for k, v in TABLE.items() if k[3] or (k[0] >= 64 and k[1] == 64)}
    assert plan_launches(table, 16, 64, "bf16", False)[0].key == (16, 64, "bf16", True)
    assert plan_launches(table, 12, 64, "bf16", False)[0].key == (16, 64, "bf16", True)
    assert plan_launches(table, 64, 64, "bf16", False)[0].key == (64, 64, "bf16", False)
    assert plan_launches(table, 40, 64, "bf16", False)[0].key == (64, 64, "bf16", False)
    assert plan_launches(table, 64, 1, "bf16", False)[0].key == (64, 1, "bf16", True)
    ls = plan_launches(table, 200, 64, "bf16", False)
    assert [(l.key, l.num_heads) for l in ls] == [((128, 64, "bf16", False), 128), ((128, 64, "bf16", False), 72)]
    assert plan_launches(table, 16, 64, "bf16", True)[0].key == (16, 64, "bf16", True)


@pytest.mark.parametrize("args,why,fix", [
    ((16, 16, "bf16", False), "no page_size match", "add 16 to axes.page_size"),
    ((16, 64, "fp16", False), "no dtype match", "add fp16 to axes.dtype"),
])
def test_missing_variant_names_nearest_and_the_yaml_change(args, why, fix):
    with pytest.raises(VariantNotCompiledError) as e:
        plan_launches(TABLE, *args)
    msg = str(e.value)
    assert why in msg and fix in msg and "variants.yaml" in msg and "Nearest compiled: mla_decode_h16_" in msg


def test_missing_split_variant():
    no_split = {k: v for k, v in TABLE.items() if not k[3]}
    with pytest.raises(VariantNotCompiledError, match="add true to axes.split"):
        plan_launches(no_split, 16, 64, "bf16", True)
    assert is_supported(no_split, 16, 64, "bf16", False) and not is_supported(no_split, 16, 64, "bf16", True)


def test_empty_table():
    with pytest.raises(VariantNotCompiledError, match="none \\(the library is empty\\)"):
        plan_launches({}, 16, 64, "bf16", False)


class _StubLibrary:
    """The part of _binding.Library that the variant choice uses: a table and plan(), each launch with its
    variant's path facts (as codegen computes them and the manifest records them)."""

    def __init__(self, table):
        self.table = table

    def plan(self, num_heads, page_size, dtype, split):
        import dataclasses

        from codegen.variant import PathFacts
        return [dataclasses.replace(l, facts=PathFacts.from_json(PathFacts.of(*l.key).to_json()))
                for l in plan_launches(self.table, num_heads, page_size, dtype, split)]


@pytest.mark.parametrize("dtype,key", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_plan_shape_dispatches_on_its_cache_dtype(dtype, key, monkeypatch):
    """MLADecodePlan chooses its variants from a shape-only call (no tensors yet); the choice must use
    the same dispatch dtype as a tensor call (regression: the shape once lacked it)."""
    from mla_variants import api, validation
    table = {(16, 64, d, s): f"mla_decode_h16_p64_{d}_{'split' if s else 'nosplit'}"
             for d in ("bf16", "fp16", "fp8_e4m3") for s in (False, True)}
    monkeypatch.setattr(api, "sm_count", lambda device_index: 132)
    shape = validation.Call.of_shape(2, 16, 1, 64, dtype, 0, 256)
    launches, splits = api.choose_launches(_StubLibrary(table), shape, None, 16384)
    assert splits > 1 and [l.symbol for l in launches] == [f"mla_decode_h16_p64_{key}_split"]
    launches, splits = api.choose_launches(_StubLibrary(table), shape, 1, None)
    assert splits == 1 and [l.symbol for l in launches] == [f"mla_decode_h16_p64_{key}_nosplit"]


_HOOK_TESTS = """
import pytest
from mla_variants.dispatch import VariantNotCompiledError

@pytest.mark.gpu
def test_left_out_by_the_filter():
    raise VariantNotCompiledError("no compiled MLA decode variant ...", (16, 64, "bf16", True))

@pytest.mark.gpu
def test_not_even_the_whole_build_serves_it():
    raise VariantNotCompiledError("no compiled MLA decode variant ...", (16, 3, "bf16", True))

@pytest.mark.gpu
def test_another_error():
    raise ValueError("not a missing variant")

def test_a_cpu_test():
    raise VariantNotCompiledError("no compiled MLA decode variant ...", (16, 64, "bf16", True))
"""


@pytest.mark.parametrize("subset", [True, False])
def test_a_missing_variant_skips_a_gpu_test_only_in_a_subset_build(pytester, subset):
    """tests/conftest.py reports a GPU test's VariantNotCompiledError as skipped when the session's build
    (its generated dispatch table, read at session start) holds fewer variants than variants.yaml's cross
    product and the whole build would serve the request; a whole build, a request no build serves, another
    error, or a CPU test stays a failure."""
    from conftest import ROOT_DIR
    built = '{(16, 64, "bf16", False): "mla_decode_h16_p64_bf16_nosplit"}' if subset else "_full_table()"
    pytester.makeconftest((ROOT_DIR / "tests" / "conftest.py").read_text() + f"""
ROOT_DIR = pathlib.Path({str(ROOT_DIR)!r})
GPU_SKIP = None  # as on a GPU machine
_built_table = lambda: {built}
""")
    pytester.makepyfile(test_hook=_HOOK_TESTS)
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    if subset:
        result.assert_outcomes(skipped=1, failed=3)
        result.stdout.fnmatch_lines(["*a subset build: no compiled MLA decode variant*"])
    else:
        result.assert_outcomes(failed=4)


def test_missing_variant_error_carries_the_request():
    with pytest.raises(VariantNotCompiledError) as e:
        plan_launches({(16, 64, "bf16", False): "x"}, 16, 1, "bf16", False)
    assert e.value.request == (16, 1, "bf16", False)


def test_a_page_size_above_the_limit_says_so_instead_of_suggesting_a_build():
    with pytest.raises(VariantNotCompiledError, match="no MLA decode variant can have page_size=2048: variants.yaml "
                                                      "takes page sizes up to 1024") as e:
        plan_launches(TABLE, 16, 2048, "bf16", True)
    assert "ensure_variant" not in str(e.value)
