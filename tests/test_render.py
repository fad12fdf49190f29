"""Rendering: deterministic, write-if-changed, hashed headers, stale files removed, filters."""
import importlib.util
import json

from codegen.cli import select
from codegen.config import load_config
from codegen.render import ROOT, render
from codegen.variant import Variant


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
    assert len(ra.written) == sum(len(v.sources) for v in vs) + 3  # + sources.cmake, dispatch.py, manifest.json
    mtimes = {p: p.stat().st_mtime_ns for p in a.rglob("*") if p.is_file()}
    again = render(cfg, vs, a, a.parent / "build" / "lib.so")
    assert again.written == [] and again.removed == []
    assert mtimes == {p: p.stat().st_mtime_ns for p in a.rglob("*") if p.is_file()}


def test_headers_carry_the_inputs_hash(tmp_path):
    cfg = _cfg()
    v = Variant(16, 64, "bf16", True)
    g = tmp_path / "generated"
    render(cfg, [v], g, tmp_path / "lib.so")
    src = (g / "variants" / f"{v.name}.cu").read_text()
    assert src.startswith("// generated, do not edit")
    assert "inputs-hash: " in src.splitlines()[1]
    assert f'extern "C" int {v.name}(' in src
    assert "mla::launch<cutlass::bfloat16_t, 16, 64, true>" in src
    for f in ("dispatch.py", "sources.cmake"):
        assert (g / f).read_text().startswith("# generated, do not edit")
    manifest = json.loads((g / "manifest.json").read_text())
    assert manifest["generated"] == "do not edit" and len(manifest["inputs_hash"]) == 16


def test_an_fp8_split_variant_gets_its_short_split_unit(tmp_path):
    """fp8 split variants render a second unit that instantiates only the short-split kernel's launcher
    (templates/mla/short_split.cuh); sources.cmake lists both, other variants keep one unit."""
    cfg = _cfg()
    fp8, bf16 = Variant(64, 64, "fp8_e4m3", True), Variant(64, 64, "bf16", True)
    g = tmp_path / "generated"
    render(cfg, [fp8, bf16, Variant(64, 64, "fp8_e4m3", False)], g, tmp_path / "lib.so")
    assert sorted(p.name for p in (g / "variants").glob("*.cu")) == sorted(
        [f"{fp8.name}.cu", f"{fp8.name}_short.cu", f"{bf16.name}.cu", "mla_decode_h64_p64_fp8_e4m3_nosplit.cu"])
    short = (g / "variants" / f"{fp8.name}_short.cu").read_text()
    assert short.startswith("// generated, do not edit") and "inputs-hash: " in short.splitlines()[1]
    assert "template cudaError_t mla::launch_short_split<cutlass::float_e4m3_t, 64, 64>(" in short
    assert "extern \"C\"" not in short  # the exported launcher stays in the variant's own unit
    cmake = (g / "sources.cmake").read_text()
    assert f"variants/{fp8.name}.cu" in cmake and f"variants/{fp8.name}_short.cu" in cmake
    assert f"{bf16.name}_short" not in cmake
    # selecting fewer variants keeps the short unit of a variant variants.yaml still describes
    res = render(cfg, [bf16], g, tmp_path / "lib.so")
    assert res.removed == [] and (g / "variants" / f"{fp8.name}_short.cu").exists()


def test_a_16_bit_variant_of_17_to_32_heads_gets_its_64_row_unit(tmp_path):
    """bf16 / fp16 variants of 17..32 heads (the transposed kernel with 32 rows per CTA) render a second
    unit with their 64-row kernel's launcher (templates/mla/rows64.cuh); 16 and 64 heads and fp8 do not."""
    cfg = _cfg()
    with_unit = [Variant(32, 64, "bf16", True), Variant(17, 1, "fp16", False)]
    without = [Variant(16, 64, "bf16", True), Variant(33, 64, "bf16", True), Variant(32, 64, "fp8_e4m3", False)]
    g = tmp_path / "generated"
    render(cfg, with_unit + without, g, tmp_path / "lib.so")
    names = {p.name for p in (g / "variants").glob("*.cu")}
    assert names == {f"{v.name}.cu" for v in with_unit + without} | {f"{v.name}_rows64.cu" for v in with_unit}
    unit = (g / "variants" / "mla_decode_h32_p64_bf16_split_rows64.cu").read_text()
    assert unit.startswith("// generated, do not edit") and "inputs-hash: " in unit.splitlines()[1]
    assert "template cudaError_t mla::launch_rows64<cutlass::bfloat16_t, 32, 64, true>(" in unit
    assert "extern \"C\"" not in unit
    assert "launch_rows64<cutlass::half_t, 17, 1, false>(" in (g / "variants" / "mla_decode_h17_p1_fp16_nosplit_rows64.cu").read_text()
    cmake = (g / "sources.cmake").read_text()
    assert "variants/mla_decode_h32_p64_bf16_split_rows64.cu" in cmake


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
    narrowed = parse_config(cfg.text.replace("num_heads: [8, 16, 32, 64, 128]", "num_heads: [8, 32, 64, 128]")
                            .replace("    num_heads: [16]\n", "    num_heads: [32]\n")
                            .replace("    num_heads: [16, 32, 64]\n", "    num_heads: [32, 64]\n")
                            .replace("num_heads: [8, 16, 32]}", "num_heads: [8, 32]}"), "v.yaml")
    res = render(narrowed, [v2], g, tmp_path / "lib.so")
    assert res.removed == [g / "variants" / f"{gone.name}.cu"]


def test_manifest_and_dispatch_table_agree(tmp_path):
    cfg = _cfg()
    vs = cfg.presets["kimi-k2"].variants()
    g = tmp_path / "generated"
    render(cfg, vs, g, tmp_path / "build" / "libmla_variants.so")
    manifest = json.loads((g / "manifest.json").read_text())
    spec = importlib.util.spec_from_file_location("d", g / "dispatch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert sorted(mod.VARIANTS.values()) == sorted(e["name"] for e in manifest["variants"])
    for key, name in mod.VARIANTS.items():
        assert Variant.from_name(name).key == key
    assert mod.LIBRARY == "../build/libmla_variants.so"


def test_filters():
    vs = _cfg().variants()
    assert {v.name for v in select(vs, ["h64_p64_bf16"])} == {"mla_decode_h64_p64_bf16_split", "mla_decode_h64_p64_bf16_nosplit"}
    assert {v.name for v in select(vs, ["h16_p64_bf16"])} == {"mla_decode_h16_p64_bf16_split"}  # nosplit: excluded
    assert all(v.page_size == 1 for v in select(vs, ["_p1_*"]))
    # 2 head counts x 4 pages x 3 dtypes split, + 128-head nosplit at pages 64 / 128 x 3 dtypes
    assert len(select(vs, ["h8_", "h128_"])) == 2 * 4 * 3 + 2 * 3
    assert select(vs, ["nothing"]) == []
    assert select(vs, None) == vs
