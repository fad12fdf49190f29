"""Rendering: deterministic, write-if-changed, hashed headers (flags and compiler included), stale files
removed, filters, and the manifest with each variant's path facts."""
import json
import re

import pytest

from codegen.cli import select
from codegen.config import load_config
from codegen.paths import CHECKOUT as ROOT
from codegen.render import render, write_manifest
from codegen.variant import PathFacts, Variant


def _cfg():
    return load_config(ROOT / "variants.yaml")


def _tree(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_deterministic_and_write_if_changed(tmp_path):
    cfg = _cfg()
    vs = cfg.presets["deepseek-v3-tp8"].variants()
    a, b = tmp_path / "a" / "generated", tmp_path / "b" / "generated"
    ra = render(cfg, vs, a, a.parent / "build" / "lib.so")
    render(cfg, list(reversed(vs)), b, b.parent / "build" / "lib.so")
    assert _tree(a) == _tree(b)  # same inputs, same bytes, whatever the order or folder
    assert len(ra.written) == sum(len(v.sources) for v in vs) + 1  # + sources.cmake (the manifest: after the build)
    mtimes = {p: p.stat().st_mtime_ns for p in a.rglob("*") if p.is_file()}
    again = render(cfg, vs, a, a.parent / "build" / "lib.so")
    assert again.written == [] and again.removed == []
    assert mtimes == {p: p.stat().st_mtime_ns for p in a.rglob("*") if p.is_file()}


def test_headers_carry_the_inputs_hash(tmp_path, monkeypatch):
    cfg = _cfg()
    v = Variant(16, 64, "bf16", True)
    g = tmp_path / "generated"
    monkeypatch.delenv("CUDAFLAGS", raising=False)
    res = render(cfg, [v], g, tmp_path / "lib.so")
    src = (g / "variants" / f"{v.name}.cu").read_text()
    assert src.startswith("// generated, do not edit")
    assert "inputs-hash: " in src.splitlines()[1]
    assert f'extern "C" int {v.name}(' in src
    assert "mla::launch<cutlass::bfloat16_t, 16, 64, true, Facts>" in src
    assert (g / "sources.cmake").read_text().startswith("# generated, do not edit")
    assert not (g / "manifest.json").exists()  # written by the build once the library links
    write_manifest(res)
    manifest = json.loads((g / "manifest.json").read_text())
    assert manifest["generated"].startswith("do not edit") and len(manifest["inputs_hash"]) == 16
    assert manifest["cudaflags"] == "" and manifest["compiler"]
    # a changed CUDAFLAGS (the diagnostic MLA_TRACE build) changes every unit's hash and the manifest's
    monkeypatch.setenv("CUDAFLAGS", "-DMLA_TRACE=1")
    traced = render(cfg, [v], g, tmp_path / "lib.so")
    assert g / "variants" / f"{v.name}.cu" in traced.written
    assert traced.manifest["inputs_hash"] != manifest["inputs_hash"] and traced.manifest["cudaflags"] == "-DMLA_TRACE=1"


def test_the_manifest_records_each_variants_path_facts(tmp_path):
    """The one dispatch artifact: every variant's key, symbol, sources and the facts codegen computed
    (the runtime reads them; launch.cuh static_asserts the same facts against the C++ traits)."""
    cfg = _cfg()
    vs = cfg.presets["kimi-k2"].variants() + cfg.presets["deepseek-v3-tp8"].variants()
    g = tmp_path / "generated"
    res = render(cfg, vs, g, tmp_path / "build" / "libmla_variants.so")
    write_manifest(res)
    manifest = json.loads((g / "manifest.json").read_text())
    assert manifest["library"] == "../build/libmla_variants.so"
    assert sorted(e["name"] for e in manifest["variants"]) == sorted(v.name for v in vs)
    for e in manifest["variants"]:
        v = Variant.from_name(e["name"])
        assert (e["num_heads"], e["page_size"], e["dtype"], e["split"]) == v.key
        assert PathFacts.from_json(e["facts"]) == v.facts
        assert e["sources"] == [f"variants/{f}" for f in v.sources]
        unit = (g / "variants" / f"{v.name}.cu").read_text()
        assert f"using Facts = {v.facts.cpp()};" in unit


@pytest.mark.parametrize("variant,rows,second,max_keys,tma,second_tma,balanced", [
    (Variant(8, 1, "bf16", True), 8, "rows64", 0, False, False, True),
    (Variant(16, 64, "fp8_e4m3", True), 16, None, 0, False, False, True),
    (Variant(16, 64, "bf16", True), 16, "rows64", 0, False, True, True),
    (Variant(32, 64, "bf16", True), 32, "rows64", 960, False, True, True),
    (Variant(17, 1, "fp16", False), 32, "rows64", 960, False, False, False),
    (Variant(32, 64, "fp8_e4m3", True), 32, None, 0, False, False, True),
    (Variant(64, 64, "fp8_e4m3", True), 64, "short_split", 128, True, False, False),
    (Variant(64, 64, "fp8_e4m3", False), 64, None, 0, True, False, False),
    (Variant(128, 16, "bf16", True), 64, None, 0, False, False, True),
    (Variant(128, 128, "bf16", False), 64, None, 0, True, False, False),
])
def test_path_facts(variant, rows, second, max_keys, tma, second_tma, balanced):
    f = variant.facts
    assert (f.rows_per_cta, f.second_kernel, f.second_max_split_keys, f.tma, f.second_tma, f.balanced_schedule) == (
        rows, second, max_keys, tma, second_tma, balanced)


@pytest.mark.parametrize("heads, dtype, q_len, balances", [
    (16, "bf16", 1, True), (16, "bf16", 2, True), (16, "bf16", 3, False), (32, "fp16", 1, True),
    (32, "bf16", 2, False), (16, "fp8_e4m3", 4, True), (32, "fp8_e4m3", 2, True), (64, "fp8_e4m3", 1, False),
    (128, "bf16", 4, True), (128, "fp8_e4m3_fast", 2, True),
])
def test_balanced_schedule_needs_a_scheduled_kernel_for_the_launchs_rows(heads, dtype, q_len, balances):
    """PathFacts.balances: a transposed 16-bit variant whose request rows exceed 32 runs its 64-row second
    kernel, which has no scheduled form; exact fp8 on the 64-row path has none either. runs_segments: the
    transposed kernels run one CTA per segment table entry, the 64-row ones walk runs."""
    assert Variant(heads, 64, dtype, True).facts.balances(heads * q_len) == balances
    assert Variant(heads, 64, dtype, True).facts.runs_segments(heads * q_len) == (balances and heads <= 32)
    assert not Variant(heads, 64, dtype, False).facts.balances(heads * q_len)


@pytest.mark.parametrize("heads, dtype, q_rows, rows", [
    (8, "bf16", 8, 8), (8, "bf16", 16, 16), (8, "bf16", 24, 32), (8, "bf16", 40, 64), (8, "fp8_e4m3", 64, 32),
    (16, "bf16", 16, 16), (16, "bf16", 32, 32), (16, "fp16", 48, 64), (16, "fp8_e4m3", 48, 32), (16, "bf16", 128, 64),
    (32, "bf16", 64, 64), (32, "fp8_e4m3", 64, 32), (64, "bf16", 128, 64), (128, "fp8_e4m3", 8, 64),
])
def test_q_len_rows_share_a_cta_up_to_the_paths_largest_row_block(heads, dtype, q_rows, rows):
    """rows_for: a transposed variant takes its row block, twice or four times it (up to 32), or (16-bit)
    its 64-row kernel above that, so that a request's q_len x num_heads rows share one CTA's read of the
    keys (config.cuh rows_for)."""
    f = Variant(heads, 64, dtype, True).facts
    assert f.rows_for(q_rows) == rows
    assert f.launch_rows(1 << 20, 1, q_rows) == rows  # long splits: the own kernel's rows


def test_policy_values_match_the_kernels_config():
    """codegen's copies of the C++ policy values that the facts depend on; the build's static_assert
    catches a disagreement too, this catches it without nvcc."""
    text = (ROOT / "templates" / "mla" / "config.cuh").read_text()
    from codegen import variant
    for name, value in (("kBlockN", variant.TILE_KEYS), ("kBlockM", variant.ROWS_64),
                        ("kSt32MinKeys", variant.ST32_MIN_KEYS), ("kFp8ShortSplitKeys", variant.FP8_SHORT_SPLIT_KEYS)):
        assert int(re.search(rf"constexpr int {name} = (\d+);", text).group(1)) == value, name
    assert re.search(r"constexpr bool kUseSt = NUM_HEADS <= (\d+);", text).group(1) == str(variant.ST_MAX_HEADS)
    assert int(re.search(r"constexpr int kStMaxRows = (\d+);", text).group(1)) == variant.ST_MAX_ROWS


def test_a_variant_with_a_second_kernel_gets_its_second_unit(tmp_path):
    """fp8 split variants of the 64-row path (short-split kernel) and transposed bf16 / fp16 variants (their
    64-row kernel) render a second unit that instantiates only launch_second; the others keep one."""
    cfg = _cfg()
    with_unit = [Variant(64, 64, "fp8_e4m3", True), Variant(32, 64, "bf16", True), Variant(17, 1, "fp16", False),
                 Variant(16, 64, "bf16", True)]
    without = [Variant(64, 64, "bf16", True), Variant(64, 64, "fp8_e4m3", False), Variant(128, 1, "bf16", True),
               Variant(16, 64, "fp8_e4m3", True), Variant(32, 64, "fp8_e4m3", False)]
    g = tmp_path / "generated"
    render(cfg, with_unit + without, g, tmp_path / "lib.so")
    names = {p.name for p in (g / "variants").glob("*.cu")}
    assert names == {f"{v.name}.cu" for v in with_unit + without} | {f"{v.name}_second.cu" for v in with_unit}
    unit = (g / "variants" / "mla_decode_h32_p64_bf16_split_second.cu").read_text()
    assert unit.startswith("// generated, do not edit") and "inputs-hash: " in unit.splitlines()[1]
    assert "template cudaError_t mla::launch_second<cutlass::bfloat16_t, 32, 64, true>(" in unit
    assert "extern \"C\"" not in unit  # the exported launcher stays in the variant's own unit
    short = (g / "variants" / "mla_decode_h64_p64_fp8_e4m3_split_second.cu").read_text()
    assert "launch_second<cutlass::float_e4m3_t, 64, 64, true>(" in short and "short_split" in short
    cmake = (g / "sources.cmake").read_text()
    assert "variants/mla_decode_h32_p64_bf16_split_second.cu" in cmake
    # selecting fewer variants keeps the second unit of a variant variants.yaml still describes (and
    # removes those of one it does not: 17 heads)
    res = render(cfg, without, g, tmp_path / "lib.so")
    assert sorted(p.name for p in res.removed) == ["mla_decode_h17_p1_fp16_nosplit.cu", "mla_decode_h17_p1_fp16_nosplit_second.cu"]
    assert (g / "variants" / "mla_decode_h16_p64_bf16_split_second.cu").exists()
    assert (g / "variants" / "mla_decode_h32_p64_bf16_split_second.cu").exists()


def test_changing_a_variant_set_rewrites_only_what_depends_on_it(tmp_path):
    cfg = _cfg()
    g = tmp_path / "generated"
    v1, v2 = Variant(16, 64, "bf16", True), Variant(32, 64, "bf16", True)
    render(cfg, [v1], g, tmp_path / "lib.so")
    before = (g / "variants" / f"{v1.name}.cu").stat().st_mtime_ns
    res = render(cfg, [v1, v2], g, tmp_path / "lib.so")
    assert (g / "variants" / f"{v1.name}.cu").stat().st_mtime_ns == before
    assert g / "variants" / f"{v2.name}.cu" in res.written
    res = render(cfg, [v2], g, tmp_path / "lib.so")  # a narrower selection keeps v1's source untouched
    assert res.removed == [] and (g / "variants" / f"{v1.name}.cu").stat().st_mtime_ns == before
    assert f"{v1.name}.cu" not in (g / "sources.cmake").read_text()
    gone = Variant(16, 64, "bf16", True)  # a variant the yaml no longer has is removed
    from codegen.config import parse_config
    narrowed = parse_config("dims: {kv_lora_rank: 512, qk_rope_head_dim: 64}\narch: sm_90a\naxes:\n"
                            "  num_heads: [32]\n  page_size: [64]\n  dtype: [bf16]\n  split: [true]\n", "v.yaml")
    res = render(narrowed, [v2], g, tmp_path / "lib.so")
    assert sorted(res.removed) == [g / "variants" / f"{gone.name}.cu", g / "variants" / f"{gone.name}_second.cu"]


def test_filters():
    """--filter keeps the variants whose name matches (substring or glob); the expectations are read from
    variants.yaml, so adding an axis value breaks nothing here."""
    cfg = _cfg()
    vs = cfg.variants()
    assert {v.name for v in select(vs, ["h64_p64_bf16"])} == {
        v.name for v in vs if (v.num_heads, v.page_size, v.dtype) == (64, 64, "bf16")}
    assert all(v.page_size == 1 for v in select(vs, ["_p1_*"]))
    assert {v.name for v in select(vs, ["h8_", "h128_"])} == {v.name for v in vs if v.num_heads in (8, 128)}
    assert select(vs, ["nothing"]) == []
    assert select(vs, None) == vs


def test_a_damaged_or_older_manifest_is_refused_with_the_fix(tmp_path):
    """The runtime and `mla-variants list` read the manifest through one check: an older version's
    manifest (no path facts), a damaged one, or one whose facts are not this version's gives an error
    naming the file and `mla-variants build`, never a raw KeyError or TypeError."""
    from codegen.manifest import ManifestError, load_manifest
    from mla_variants import _binding
    cfg = _cfg()
    g = tmp_path / "generated"
    res = render(cfg, [Variant(16, 64, "bf16", True)], g, tmp_path / "lib.so")
    write_manifest(res)
    good = json.loads((g / "manifest.json").read_text())
    assert load_manifest(g / "manifest.json") == good
    older = json.loads(json.dumps(good))
    del older["variants"][0]["facts"]
    wrong_facts = json.loads(json.dumps(good))
    wrong_facts["variants"][0]["facts"]["rows_per_cta"] = 64
    renamed = json.loads(json.dumps(good))
    renamed["variants"][0]["name"] = "mla_variants_schedule"
    twice = json.loads(json.dumps(good))
    twice["variants"] *= 2
    for content in (older, wrong_facts, renamed, twice, [1], {}, {"library": None, "variants": []},
                    {"library": "x.so", "variants": {}}, "not json", b"\xff\xfe"):
        (g / "manifest.json").write_bytes(content if isinstance(content, bytes) else
                                          (content if isinstance(content, str) else json.dumps(content)).encode())
        with pytest.raises(ManifestError, match="run `mla-variants build`"):
            load_manifest(g / "manifest.json")
        with pytest.raises(_binding.LibraryNotBuiltError, match="mla-variants build"):
            _binding.read_manifest(g)


def test_cudaflags_spacing_changes_no_hash(tmp_path, monkeypatch):
    cfg = _cfg()
    g = tmp_path / "generated"
    monkeypatch.setenv("CUDAFLAGS", "-DMLA_TRACE=1 -lineinfo")
    render(cfg, [Variant(16, 64, "bf16", True)], g, tmp_path / "lib.so")
    monkeypatch.setenv("CUDAFLAGS", "  -DMLA_TRACE=1   -lineinfo ")
    assert render(cfg, [Variant(16, 64, "bf16", True)], g, tmp_path / "lib.so").written == []
