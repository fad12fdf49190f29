"""The fp8 fast mode on the CPU: its variants (variants.yaml dtype fp8_e4m3_fast) from name to rendered
unit and ptxas record, the dispatch of fp8_mode, and the errors naming fp8_mode. The kernels themselves
are tested in tests/test_gpu_fp8_fast.py."""
import pytest
import torch

from codegen.build import parse_resource_usage
from codegen.config import ConfigError, load_config
from codegen.paths import project_dir
from codegen.render import render
from codegen.variant import PathFacts, Variant, call_dtype
from mla_variants import MLAInputError, api, validation
from mla_variants.dispatch import VariantNotCompiledError, plan_launches

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads", [40, 64, 128])
def test_a_fast_variant_runs_the_64_row_fast_kernel_and_the_exact_short_split_one(heads):
    v = Variant(heads, 16, "fp8_e4m3_fast", True)
    assert v.name == f"mla_decode_h{heads}_p16_fp8_e4m3_fast_split" and Variant.from_name(v.name) == v
    # A split fast variant also runs the balanced schedule (the fast kernel's scheduled instantiation).
    assert v.facts == PathFacts(rows_per_cta=64, second_kernel="short_split", second_max_split_keys=128, tma=False,
                                second_tma=False, balanced_schedule=True)
    assert v.path == "rows64" and v.units == ((f"{v.name}.cu", "variant.cu.j2"),
                                              (f"{v.name}_second.cu", "variant_second.cu.j2"))
    assert v.facts.rows_for(heads * 4) == 64 and v.cpp_type == "mla::Fp8FastCache"
    # Pages that are multiples of 64 tokens load full tiles by TMA (the short-split kernel never does).
    assert Variant(heads, 64, "fp8_e4m3_fast", True).facts.tma and Variant(heads, 128, "fp8_e4m3_fast", False).facts.tma
    assert not Variant(heads, 64, "fp8_e4m3_fast", True).facts.second_tma
    # Splits of at most 128 keys run the short-split kernel (64 rows as well); longer ones the fast kernel.
    assert v.facts.runs_second(1024, 8) and not v.facts.runs_second(1024, 4)
    assert v.facts.launch_rows(1024, 8, heads) == 64
    nosplit = Variant(heads, 16, "fp8_e4m3_fast", False)
    assert nosplit.facts.second_kernel is None and not nosplit.facts.balanced_schedule and nosplit.units == ((f"{nosplit.name}.cu", "variant.cu.j2"),)


def test_the_default_build_has_split_fast_variants_at_64_and_128_heads():
    cfg = load_config(project_dir() / "variants.yaml")
    fast = [v for v in cfg.variants() if v.dtype == "fp8_e4m3_fast"]
    assert {(v.num_heads, v.split) for v in fast} == {(64, True), (128, True)}
    assert {v.page_size for v in fast} == set(cfg.axes["page_size"])
    assert [v.name for v in cfg.presets["ci"].variants() if v.dtype == "fp8_e4m3_fast"] == [
        "mla_decode_h64_p64_fp8_e4m3_fast_split"]


def test_a_fast_unit_launches_the_fast_cache_type(tmp_path):
    cfg = load_config(project_dir() / "variants.yaml")
    v = Variant(128, 64, "fp8_e4m3_fast", True)
    render(cfg, [v], tmp_path / "g", tmp_path / "b" / "lib.so")
    unit = (tmp_path / "g" / "variants" / f"{v.name}.cu").read_text()
    assert "mla::launch<mla::Fp8FastCache, 128, 64, true, Facts>(args)" in unit
    assert f"using Facts = {v.facts.cpp()};" in unit


def test_a_serialized_fast_kernel_is_recorded_for_its_variant():
    note = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the wgmma pipeline in the function "
            "'_ZN3mla4fast26mla_decode_fp8_fast_kernelILi128ELi64ELb1EEEvNS_12DecodeParamsE'\n")
    assert parse_resource_usage(note) == {"mla_decode_h128_p64_fp8_e4m3_fast_split": {"wgmma_serialized": ["C7511"]}}


def test_ptxas_records_of_the_fast_kernel_name_their_variant():
    log = ("ptxas info    : Compiling entry function '_ZN3mla4fast26mla_decode_fp8_fast_kernelILi64ELi16ELb1EEEvNS_"
           "12DecodeParamsE' for 'sm_90a'\n"
           "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n")
    assert parse_resource_usage(log) == {"mla_decode_h64_p16_fp8_e4m3_fast_split": {
        "registers": 168, "stack_bytes": 8, "spill_store_bytes": 8, "spill_load_bytes": 4}}


@pytest.mark.parametrize("mode, kv_dtype, token", [
    ("exact", FP8, "fp8_e4m3"), ("fast", FP8, "fp8_e4m3_fast"),
    ("exact", torch.bfloat16, "bf16"), ("exact", torch.float16, "fp16")])
def test_fp8_mode_picks_the_dispatch_dtype(mode, kv_dtype, token):
    assert validation.fp8_token(mode, kv_dtype) == token


@pytest.mark.parametrize("mode, kv_dtype, expected", [
    ("fast", torch.bfloat16, "'exact' with a torch.bfloat16 kv_cache"),
    ("fast", torch.float16, "'exact' with a torch.float16 kv_cache"),
    ("Fast", FP8, "'exact' or 'fast'"), (None, FP8, "'exact' or 'fast'"), (1, FP8, "'exact' or 'fast'"),
    (b"fast", FP8, "'exact' or 'fast'"), (torch.tensor(1), FP8, "'exact' or 'fast'")])
def test_a_bad_fp8_mode_is_an_error_naming_it(mode, kv_dtype, expected):
    with pytest.raises(MLAInputError, match="^fp8_mode: expected ") as e:
        validation.fp8_token(mode, kv_dtype)
    assert expected in str(e.value)


def test_the_ops_take_fp8_mode_and_their_fakes_check_it():
    from mla_variants import ops
    for op in ("mla_decode", "mla_decode_out", "mla_decode_varlen"):
        assert 'str fp8_mode="exact"' in str(getattr(torch.ops.mla_variants, op).default._schema)
    q_nope, q_pe = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    ops._fake_check(q_nope, q_pe, kv, None, "exact")
    with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' with a torch.bfloat16 kv_cache"):
        ops._fake_check(q_nope, q_pe, kv, None, "fast")
    with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' or 'fast', got 'turbo'"):
        ops._fake_check(q_nope, q_pe, kv.to(FP8), torch.ones(1), "turbo")


class _StubLibrary:
    def __init__(self, table):
        self.table = table

    def plan(self, num_heads, page_size, dtype, split):
        import dataclasses
        return [dataclasses.replace(l, facts=PathFacts.of(*l.key))
                for l in plan_launches(self.table, num_heads, page_size, dtype, split)]


def test_a_fast_call_dispatches_to_the_fast_variants_and_an_exact_one_does_not(monkeypatch):
    table = {(128, 64, d, True): f"mla_decode_h128_p64_{d}_split" for d in ("fp8_e4m3", "fp8_e4m3_fast")}
    monkeypatch.setattr(api, "sm_count", lambda device_index: 132)
    for mode, symbol in (("exact", "mla_decode_h128_p64_fp8_e4m3_split"),
                         ("fast", "mla_decode_h128_p64_fp8_e4m3_fast_split")):
        shape = validation.Call.of_shape(4, 128, 1, 64, torch.bfloat16, 0, 256, FP8)
        shape.key_dtype = validation.fp8_token(mode, FP8)
        launches, _ = api.choose_launches(_StubLibrary(table), shape, None, 16384)
        assert [l.symbol for l in launches] == [symbol]


def test_fast_calls_take_256_key_pieces_where_short_pieces_would_run_the_exact_kernel():
    from mla_variants import splits
    table = {(h, 64, d, True): f"mla_decode_h{h}_p64_{d}_split" for h in (64, 128) for d in ("fp8_e4m3", "fp8_e4m3_fast")}
    lib = _StubLibrary(table)
    count = lambda heads, dtype, batch, keys, q_len=1: splits.choose(lib, heads, 64, dtype, batch, q_len, keys, 132)[1]  # noqa: E731
    # (heads, batch, keys): the heuristic's count (exact variants keep it) and the fast variants' count
    for heads, batch, keys, exact, fast in ((128, 1, 4096, 64, 16),   # 64 keys -> 256 keys, 32 CTAs
                                            (128, 8, 1024, 8, 4),     # 128 keys -> 256 keys, 64 CTAs
                                            (64, 8, 1024, 8, 4),      # 32 CTAs
                                            (64, 1, 4096, 64, 64),    # 16 CTAs of 256 keys: too few
                                            (128, 1, 1024, 16, 16),   # 8 CTAs
                                            (128, 1, 16384, 64, 64),  # 256-key pieces already
                                            (128, 8, 4096, 8, 8)):    # 512-key pieces
        assert count(heads, "fp8_e4m3", batch, keys) == exact, (heads, batch, keys)
        assert count(heads, "fp8_e4m3_fast", batch, keys) == fast, (heads, batch, keys)
    assert count(128, "fp8_e4m3_fast", 1, 4096, q_len=2) == 16  # 4 row blocks x 16 pieces
    assert count(128, "fp8_e4m3_fast", 1, 256) == 4  # one 256-key piece only: the heuristic's count stays
    # the count the rule gives never runs the short-split kernel
    facts = PathFacts.of(128, 64, "fp8_e4m3_fast", True)
    assert facts.runs_second(4096, 64) and not facts.runs_second(4096, 16)


def test_a_missing_fast_variant_names_the_yaml_change_and_ensure_variant():
    table = {(128, 64, "fp8_e4m3", True): "mla_decode_h128_p64_fp8_e4m3_split"}
    with pytest.raises(VariantNotCompiledError) as e:
        plan_launches(table, 64, 64, "fp8_e4m3_fast", True)
    msg = str(e.value)
    assert "dtype=fp8_e4m3_fast" in msg and "add fp8_e4m3_fast to axes.dtype" in msg
    assert "ensure_variant(64, 64, 'fp8_e4m3_fast', True)" in msg and "mla_decode_h128_p64_fp8_e4m3_split" in msg


def test_is_supported_names_the_fast_token_among_the_dtypes():
    with pytest.raises(MLAInputError, match="'fp8_e4m3_fast'"):
        api.is_supported(16, 64, "fp8_e4m3_turbo")


def _fp8_call(kv, out=None, lse=None, total_q_tokens=0):
    """A validated-call stand-in (CPU tensors): 2 requests of 64 heads, page 64, an fp8 cache."""
    c = validation.Call.of_shape(2, 64, 1, 64, torch.bfloat16, 0, 4, FP8)
    c.kv_cache, c.out, c.lse, c.total_q_tokens = kv, out, lse, total_q_tokens
    return c


@pytest.fixture
def fp8_library(monkeypatch):
    """A stub library with the exact and the fast h64 p64 split variants, and the launches the entry points
    hand to launching.launch (recorded, not run)."""
    from mla_variants import _binding, launching
    table = {(64, 64, d, True): f"mla_decode_h64_p64_{d}_split" for d in ("fp8_e4m3", "fp8_e4m3_fast")}
    stub = _StubLibrary(table)
    monkeypatch.setattr(_binding, "library", lambda: stub)
    monkeypatch.setattr(api, "sm_count", lambda device_index: 132)
    seen = []
    monkeypatch.setattr(launching, "launch", lambda c, launches, *a, **k: seen.append([l.symbol for l in launches]))
    return seen


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_mla_decode_and_varlen_launch_the_variants_of_their_fp8_mode(fp8_library, monkeypatch, mode):
    from mla_variants import varlen
    kv = torch.zeros(4, 64, 576, dtype=FP8)
    out, lse = torch.empty(2, 1, 64, 512, dtype=torch.bfloat16), torch.empty(2, 64, 1)
    monkeypatch.setattr(api, "validate", lambda *a, **k: _fp8_call(kv, out, lse))
    monkeypatch.setattr(api, "check_disjoint", lambda *a, **k: None)
    symbol = f"mla_decode_h64_p64_{'fp8_e4m3_fast' if mode == 'fast' else 'fp8_e4m3'}_split"
    api.mla_decode(None, kv, None, None, 0.1, num_kv_splits=1, out=out, lse=lse, k_scale=1.0, fp8_mode=mode)
    monkeypatch.setattr(varlen, "native_call", lambda *a, **k: _fp8_call(kv, out, lse, total_q_tokens=2))
    varlen.mla_decode_varlen(None, kv, None, None, 0.1, query_start_loc=None, max_q_len=1, num_kv_splits=1,
                             k_scale=1.0, fp8_mode=mode)
    assert fp8_library == [[symbol], [symbol]]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_plan_takes_the_variants_of_its_fp8_mode(fp8_library, monkeypatch, mode):
    from mla_variants import MLADecodePlan, plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(plan, "check_workspace", lambda *a, **k: None)
    p = MLADecodePlan(2, 64, 64, kv_dtype=FP8, max_seq_len=256, num_kv_splits=1, workspace=torch.empty(16),
                      fp8_mode=mode)
    assert [l.symbol for l in p.launches] == [
        f"mla_decode_h64_p64_{'fp8_e4m3_fast' if mode == 'fast' else 'fp8_e4m3'}_split"]
    assert f"fp8_mode={mode!r}" in repr(p)
    with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' with a torch.bfloat16 kv_cache"):
        MLADecodePlan(2, 16, 64, max_seq_len=256, workspace=torch.empty(16), fp8_mode="fast")


def test_the_ops_pass_fp8_mode_on(monkeypatch):
    from mla_variants import ops
    seen = []
    monkeypatch.setattr(ops, "_mla_decode", lambda *a, **k: seen.append(k["fp8_mode"]))
    monkeypatch.setattr(ops, "_mla_decode_varlen", lambda *a, **k: seen.append(k["fp8_mode"]))
    fns = [getattr(op, "_init_fn", None) for op in (ops.mla_decode_op, ops.mla_decode_out_op, ops.mla_decode_varlen_op)]
    if None in fns:
        pytest.skip("this torch's CustomOpDef keeps no _init_fn")
    t = torch.zeros(1)
    fns[0](t, t, t, t, t, 0.1, 0, t, "fast")
    fns[1](t, t, t, t, t, 0.1, 0, t, t, t, "fast")
    fns[2](t, t, t, t, t, t, 1, 0.1, 0, t, "fast")
    assert seen == ["fast", "fast", "fast"]


@pytest.mark.parametrize("heads, token", [(1, "fp8_e4m3"), (16, "fp8_e4m3"), (32, "fp8_e4m3"), (33, "fp8_e4m3_fast"),
                                          (64, "fp8_e4m3_fast"), (128, "fp8_e4m3_fast"), (200, "fp8_e4m3_fast")])
def test_fast_calls_of_at_most_32_heads_run_the_exact_variants(heads, token):
    assert call_dtype("fp8_e4m3_fast", heads) == token
    assert all(call_dtype(d, heads) == d for d in ("bf16", "fp16", "fp8_e4m3"))


def test_a_fast_call_of_16_heads_dispatches_to_the_exact_variant_and_one_of_40_to_the_fast_one():
    table = {(h, 64, d, True): f"mla_decode_h{h}_p64_{d}_split" for h in (16, 64) for d in ("fp8_e4m3", "fp8_e4m3_fast")}
    assert [l.symbol for l in plan_launches(table, 16, 64, "fp8_e4m3_fast", True)] == ["mla_decode_h16_p64_fp8_e4m3_split"]
    assert [l.symbol for l in plan_launches(table, 12, 64, "fp8_e4m3_fast", False)] == ["mla_decode_h16_p64_fp8_e4m3_split"]
    assert [l.symbol for l in plan_launches(table, 40, 64, "fp8_e4m3_fast", True)] == [
        "mla_decode_h64_p64_fp8_e4m3_fast_split"]
    # No exact 16-head variant: the error names the variant such a call runs, fp8_e4m3.
    with pytest.raises(VariantNotCompiledError) as e:
        plan_launches({(64, 64, "fp8_e4m3_fast", True): "mla_decode_h64_p64_fp8_e4m3_fast_split"}, 16, 1, "fp8_e4m3_fast",
                      True)
    assert "dtype=fp8_e4m3," in str(e.value) and e.value.request == (16, 1, "fp8_e4m3", True)


def test_no_fast_variant_of_at_most_32_heads_is_built_whatever_the_axes(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("dims: {kv_lora_rank: 512, qk_rope_head_dim: 64}\narch: sm_90a\n"
                    "axes: {num_heads: [16, 32, 48], page_size: [64], dtype: [fp8_e4m3_fast], split: [true]}\n"
                    "presets:\n  small: {description: d, num_heads: [16]}\n  mixed: {description: d, num_heads: [16, 48]}\n")
    with pytest.raises(ConfigError, match="presets.small: every variant it selects .* at most 32 heads"):
        load_config(path)
    path.write_text(path.read_text().replace("  small: {description: d, num_heads: [16]}\n", ""))
    cfg = load_config(path)
    assert [v.name for v in cfg.variants()] == ["mla_decode_h48_p64_fp8_e4m3_fast_split"]
    assert [v.name for v in cfg.presets["mixed"].variants()] == ["mla_decode_h48_p64_fp8_e4m3_fast_split"]


def test_a_filter_on_a_fast_variant_no_call_runs_names_the_one_it_does(tmp_path, capsys):
    from codegen import cli
    path = tmp_path / "v.yaml"
    path.write_text("dims: {kv_lora_rank: 512, qk_rope_head_dim: 64}\narch: sm_90a\n"
                    "axes: {num_heads: [16, 64], page_size: [64], dtype: [fp8_e4m3, fp8_e4m3_fast], split: [true]}\n")
    argv = ["generate", "--config", str(path), "--generated-dir", str(tmp_path / "g"), "--build-dir", str(tmp_path / "b")]
    assert cli.main(argv + ["--filter", "h16_p64_fp8_e4m3_fast"]) == 2
    assert ("mla_decode_h16_p64_fp8_e4m3_fast_split is never built: a call of dtype fp8_e4m3_fast at 16 heads runs "
            "mla_decode_h16_p64_fp8_e4m3_split (codegen.variant.call_dtype)") in capsys.readouterr().err
    assert cli.main(argv + ["--filter", "fp8_e4m3_fast"]) == 0
    assert "rendered 1 variant" in capsys.readouterr().out
    assert cli.main(argv + ["--filter", "h16_p64_fp8_e4m3_fast", "--filter", "h64_p64_fp8_e4m3_split"]) == 0
    out = capsys.readouterr().out
    assert "note: --filter h16_p64_fp8_e4m3_fast: mla_decode_h16_p64_fp8_e4m3_fast_split is never built" in out
    assert "rendered 1 variant" in out


def test_ensure_variant_of_a_16_head_fast_call_makes_the_exact_variant(monkeypatch, tmp_path):
    from mla_variants import _binding, jit
    built = []
    monkeypatch.setattr(_binding, "generated_dir", lambda: tmp_path / "none")
    monkeypatch.setattr(jit, "cached_build", lambda *key: built.append(key) or (_ for _ in ()).throw(RuntimeError("stop")))
    for heads in (16, 64):
        with pytest.raises(RuntimeError, match="stop"):
            jit.ensure_variant(heads, 64, "fp8_e4m3_fast", True)
    assert built == [(16, 64, "fp8_e4m3", True), (64, 64, "fp8_e4m3_fast", True)]


def test_the_registered_fakes_check_fp8_mode_under_fake_tensors():
    """What torch.compile traces: the ops' fake implementations, called through the dispatcher on fake meta
    tensors, refuse a bad fp8_mode with the eager call's error and accept "fast" on an fp8 cache."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.mla_variants
    with FakeTensorMode():
        def t(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="meta")
        qn, qp, bt, sl = t(1, 1, 16, 512), t(1, 1, 16, 64), t(1, 2, dtype=torch.int32), t(1, dtype=torch.int32)
        out, lse, loc = t(1, 1, 16, 512), t(1, 16, 1, dtype=torch.float32), t(2, dtype=torch.int32)
        calls = {
            "mla_decode": lambda kv, k, mode: ops.mla_decode(qn, qp, kv, bt, sl, 0.1, 0, k, mode),
            "mla_decode_out": lambda kv, k, mode: ops.mla_decode_out(qn, qp, kv, bt, sl, 0.1, 0, out, lse, k, mode),
            "mla_decode_varlen": lambda kv, k, mode: ops.mla_decode_varlen(qn[0], qp[0], kv, bt, sl, loc, 1, 0.1, 0, k, mode),
        }
        kv16, kv8, k_scale = t(2, 64, 576), t(2, 64, 576, dtype=FP8), t(1, dtype=torch.float32)
        for name, call in calls.items():
            with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' with a torch.bfloat16 kv_cache"):
                call(kv16, None, "fast")
            with pytest.raises(MLAInputError, match="^fp8_mode: expected 'exact' or 'fast', got 'turbo'"):
                call(kv8, k_scale, "turbo")
            call(kv8, k_scale, "fast")  # no error: the fake accepts it (and returns shapes, or None in place)


def test_is_supported_takes_the_fast_token_and_maps_small_head_counts(monkeypatch):
    from mla_variants import _binding
    table = {(64, 64, "fp8_e4m3_fast", True): "mla_decode_h64_p64_fp8_e4m3_fast_split",
             (16, 64, "fp8_e4m3", True): "mla_decode_h16_p64_fp8_e4m3_split"}
    monkeypatch.setattr(_binding, "library", lambda: _StubLibrary(table))
    assert api.is_supported(64, 64, "fp8_e4m3_fast", split=True) and api.is_supported(40, 64, "fp8_e4m3_fast")
    assert api.is_supported(16, 64, "fp8_e4m3_fast", split=True)  # runs the exact 16-head variant
    assert not api.is_supported(64, 1, "fp8_e4m3_fast")


def test_jit_on_first_use_of_a_16_head_fast_call_builds_the_exact_variant(monkeypatch, tmp_path):
    """A library with JIT on (the default outside the tests): a fast call of 16 heads compiles the variant it
    runs, fp8_e4m3, never an fp8_e4m3_fast one; a 64-head fast call compiles the fast one."""
    from mla_variants import _binding, jit
    monkeypatch.setenv("MLA_VARIANTS_JIT", "1")
    lib = _binding.Library(tmp_path)  # no build: every variant comes on first use
    built = []

    def build(*key):
        built.append(key)
        raise RuntimeError("no compiler in this test")
    monkeypatch.setattr(jit, "cached", lambda *key: None, raising=False)
    monkeypatch.setattr(jit, "cached_build", build)
    for heads in (16, 64):
        with pytest.warns(RuntimeWarning), pytest.raises(VariantNotCompiledError):
            lib.plan(heads, 64, "fp8_e4m3_fast", True)
    assert [k[:3] for k in built] == [(16, 64, "fp8_e4m3"), (64, 64, "fp8_e4m3_fast")]


def test_axes_of_only_never_run_fast_variants_are_an_error_and_narrowed_axes_keep_the_shipped_rules():
    from codegen.config import parse_config
    head = "dims: {kv_lora_rank: 512, qk_rope_head_dim: 64}\narch: sm_90a\n"
    with pytest.raises(ConfigError, match="every combination is an fp8_e4m3_fast variant of at most 32 heads"):
        parse_config(head + "axes: {num_heads: [16, 32], page_size: [64], dtype: [fp8_e4m3_fast], split: [true]}\n")
    # A TP 4-16 deployment narrows num_heads to 8-32: the shipped exclude rules still load (a rule is checked
    # against every combination of the axes, never-run fast variants included).
    text = (project_dir() / "variants.yaml").read_text()
    text = text[:text.index("\npresets:")].replace("num_heads: [8, 16, 32, 64, 128]", "num_heads: [8, 16, 32]")
    cfg = parse_config(text)
    assert cfg.variants() and all(v.dtype != "fp8_e4m3_fast" for v in cfg.variants())
