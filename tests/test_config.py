"""variants.yaml schema validation: every error names the file, the line and the key or value."""
import os
from pathlib import Path

import pytest

from codegen.config import MAX_CONFIG_BYTES, ConfigError, load_config, parse_config
from codegen.paths import CHECKOUT as ROOT
from codegen.variant import call_dtype

GOOD = """\
dims:
  kv_lora_rank: 512
  qk_rope_head_dim: 64
arch: sm_90a
axes:
  num_heads: [16, 128]
  page_size: [1, 64]
  dtype: [bf16]
  split: [false, true]
presets:
  small:
    description: one head count
    num_heads: [16]
"""


def test_repository_file_is_valid_and_complete():
    """The shipped variants.yaml parses and covers what the library promises; read from the file, so that
    adding an axis value (README: adding a variant) breaks nothing here."""
    cfg = load_config(ROOT / "variants.yaml")
    assert {16, 64, 128} <= set(cfg.axes["num_heads"]) and {1, 16, 64} <= set(cfg.axes["page_size"])
    assert set(cfg.axes["dtype"]) == {"bf16", "fp16", "fp8_e4m3", "fp8_e4m3_fast"} and cfg.axes["split"] == (False, True)
    n = 1
    for values in cfg.axes.values():
        n *= len(values)
    # less the fast variants no call runs (call_dtype: 32 heads or fewer run fp8_e4m3)
    never = sum(call_dtype(d, h) != d for h in cfg.axes["num_heads"] for d in cfg.axes["dtype"])
    assert len(cfg.cross_product()) == n - never * len(cfg.axes["page_size"]) * len(cfg.axes["split"]) and never == 3
    # every (num_heads, page_size, dtype) keeps its split variant, except the fast mode below 64 heads;
    # nosplit variants only where the 64-row kernel loads pages by TMA (the exclude rules)
    assert {v.key[:3] for v in cfg.variants() if v.split} == {
        v.key[:3] for v in cfg.cross_product() if v.dtype != "fp8_e4m3_fast" or v.num_heads >= 64}
    assert all(v.path == "rows64" and v.page_size % 64 == 0 and v.facts.tma for v in cfg.variants() if not v.split)
    for name in ("deepseek-v3-tp1", "deepseek-v3-tp8", "deepseek-v3-tp16", "deepseek-v2-lite", "kimi-k2", "ci"):
        assert name in cfg.presets
    assert {v.num_heads for v in cfg.presets["deepseek-v3-tp8"].variants()} == {16}
    assert {v.num_heads for v in cfg.presets["deepseek-v3-tp1"].variants()} == {128}
    # ci covers every kernel path: transposed and 64-row, both second kernels, split and not, 16-bit and fp8
    ci = cfg.presets["ci"].variants()
    assert {v.path for v in ci} == {"transposed", "rows64"} and {v.split for v in ci} == {False, True}
    assert {v.facts.second_kernel for v in ci} == {None, "rows64", "short_split"}
    assert {v.dtype for v in ci} >= {"bf16", "fp8_e4m3", "fp8_e4m3_fast"}


def test_good_config_and_preset_selection():
    cfg = parse_config(GOOD)
    assert len(cfg.variants()) == 2 * 2 * 1 * 2
    assert [v.name for v in cfg.presets["small"].variants()] == [
        "mla_decode_h16_p1_bf16_nosplit", "mla_decode_h16_p1_bf16_split",
        "mla_decode_h16_p64_bf16_nosplit", "mla_decode_h16_p64_bf16_split"]


def test_an_exclude_rule_can_name_the_kernel_path():
    """`path` matches the path a variant's own kernel runs, so a rule about the transposed path keeps
    holding for a head count added to axes.num_heads later (one edit adds a variant)."""
    cfg = parse_config(GOOD + "exclude:\n  - {split: [false], path: [transposed]}\n")
    dropped = {v.name for v in cfg.cross_product() if cfg.excluded_by(v)}
    assert dropped and all(v.num_heads <= 32 and not v.split for v in cfg.cross_product() if v.name in dropped)
    assert all(v.num_heads > 32 or v.split for v in cfg.variants())
    with pytest.raises(ConfigError, match="unknown path 'seesaw'"):
        parse_config(GOOD + "exclude:\n  - {path: [seesaw]}\n")
    with pytest.raises(ConfigError, match="matches no variant of the axes"):  # 16 heads run the transposed path
        parse_config(GOOD + "exclude:\n  - {path: [rows64], num_heads: [16]}\n")
    with pytest.raises(ConfigError, match="expected a list such as \\[transposed\\], got 'transposed'"):
        parse_config(GOOD + "exclude:\n  - {path: transposed}\n")


def test_exclude_rules_drop_what_matches_every_named_axis():
    cfg = parse_config(GOOD + "exclude:\n  - {split: [false], num_heads: [16]}\n  - {page_size: [1], num_heads: [128]}\n")
    assert [v.name for v in cfg.variants()] == [
        "mla_decode_h128_p64_bf16_nosplit", "mla_decode_h128_p64_bf16_split",
        "mla_decode_h16_p1_bf16_split", "mla_decode_h16_p64_bf16_split"]
    assert [v.name for v in cfg.presets["small"].variants()] == ["mla_decode_h16_p1_bf16_split", "mla_decode_h16_p64_bf16_split"]
    assert len(cfg.cross_product()) == 8
    dropped = [v for v in cfg.cross_product() if cfg.excluded_by(v)]
    assert [[r.line for r in cfg.excluded_by(v)] for v in dropped] == [[16], [16], [15], [15]]  # h128 p1 x 2, h16 nosplit x 2
    both = parse_config(GOOD + "exclude:\n  - {split: [false]}\n  - {page_size: [1]}\n")
    h16_p1_nosplit = next(v for v in both.cross_product() if v.name == "mla_decode_h16_p1_bf16_nosplit")
    assert [r.line for r in both.excluded_by(h16_p1_nosplit)] == [15, 16]


@pytest.mark.parametrize("rules,line,words", [
    ("exclude: 3\n", 14, "exclude: expected a list of rules"),
    ("exclude:\n  - {}\n", 15, "expected at least one axis"),
    ("exclude:\n  - {colour: [red]}\n", 15, "unknown key 'colour'"),
    ("exclude:\n  - {num_heads: [32]}\n", 15, "exclude[0].num_heads: 32 is not in axes.num_heads [16, 128] (line 6)"),
    ("exclude:\n  - {split: [maybe]}\n", 15, "expected true or false"),
    ("exclude:\n  - {dtype: [bf16]}\n", 15, "the rules drop every variant"),
    ("exclude:\n  - {num_heads: [16]}\n", 11, "presets.small: every variant it selects is dropped"),
])
def test_exclude_errors_name_the_line(rules, line, words):
    with pytest.raises(ConfigError) as e:
        parse_config(GOOD + rules, "v.yaml")
    assert e.value.line == line and words in str(e.value), str(e.value)


@pytest.mark.parametrize("old,new,line,words", [
    ("  dtype: [bf16]", "  dtype: [bf16]\n  colour: [red]", 9, "unknown key 'colour'"),
    ("  dtype: [bf16]", "  dtype: [fp8_e5m2]", 8, "unknown dtype 'fp8_e5m2'"),
    ("  num_heads: [16, 128]", "  num_heads: [16, 0]", 6, "from 1 to 128, got 0"),
    ("  num_heads: [16, 128]", "  num_heads: [16, 16]", 6, "listed twice"),
    ("  page_size: [1, 64]", "  page_size: [one]", 7, "expected an integer, got 'one'"),
    ("  page_size: [1, 64]", "  page_size: []", 7, "at least one value"),
    ("  split: [false, true]", "  split: [maybe]", 9, "expected true or false"),
    ("  kv_lora_rank: 512", "  kv_lora_rank: 256", 2, "only 512 is supported"),
    ("arch: sm_90a", "arch: sm_80", 4, "expected one of sm_90a, got 'sm_80'"),
    ("    num_heads: [16]", "    num_heads: [96]", 13, "impossible combination: 96 is not in axes.num_heads"),
    ("    description: one head count\n", "", 11, "missing required key 'description'"),
    ("  split: [false, true]\n", "", 5, "missing required key 'split'"),
    ("dims:\n  kv_lora_rank: 512\n  qk_rope_head_dim: 64", "dims: [512, 64]", 1, "dims: expected a mapping"),
])
def test_errors_name_the_line(old, new, line, words):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    with pytest.raises(ConfigError) as e:
        parse_config(text, "v.yaml")
    assert e.value.line == line, str(e.value)
    assert str(e.value).startswith(f"v.yaml:{line}: ")
    assert words in str(e.value)


@pytest.mark.parametrize("old,new,words", [
    ("arch: sm_90a", "arch:", "arch: expected a non-empty string, got ''"),
    ("arch: sm_90a", "arch: !!python/name:os.system", "arch: expected a non-empty string"),
    ("  num_heads: [16, 128]", "  num_heads: [!!int 16.5]", "expected an integer, got '16.5'"),
    ("  num_heads: [16, 128]", "  num_heads: [017]", "expected an integer, got '017'"),
    ("  num_heads: [16, 128]", "  num_heads: [0x10]", "expected an integer, got '0x10'"),
    ("  num_heads: [16, 128]", "  num_heads: [2:08]", "expected an integer, got '2:08'"),
    ("  num_heads: [16, 128]", "  num_heads: ['16']", "expected an integer, got '16'"),
    ("  num_heads: [16, 128]", "  num_heads: [16.0]", "expected an integer, got '16.0'"),
    ("  num_heads: [16, 128]", "  num_heads: [true]", "expected an integer, got 'true'"),
    ("  num_heads: [16, 128]", "  num_heads: 16", "expected a list such as [16, 64], got '16'"),
    ("  num_heads: [16, 128]", "  num_heads:", "expected a list"),
    ("  split: [false, true]", "  split: [!!bool 1]", "expected true or false, got '1'"),
    ("    description: one head count", "    description:", "expected a non-empty string"),
    ("  small:", "  'a b':", "preset names are letters, digits"),
])
def test_odd_yaml_is_a_config_error(old, new, words):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    with pytest.raises(ConfigError) as e:
        parse_config(text, "v.yaml")
    assert words in str(e.value) and e.value.line is not None, str(e.value)


def test_huge_integers_and_deep_nesting_are_config_errors():
    """A 5000-digit head count (int() refuses 4300+ digits with a ValueError) and 10000 nested lists
    (a RecursionError inside yaml) are config errors like any other, not tracebacks."""
    text = GOOD.replace("  num_heads: [16, 128]", "  num_heads: [" + "9" * 5000 + "]", 1)
    assert text != GOOD
    with pytest.raises(ConfigError, match="expected an integer of at most 18 digits, got one of 5000 digits") as e:
        parse_config(text, "v.yaml")
    assert e.value.line is not None
    with pytest.raises(ConfigError, match="v.yaml: not valid YAML: nested too deeply"):
        parse_config("[" * 10000, "v.yaml")


def test_invalid_yaml_and_empty_and_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"v.yaml:3: not valid YAML"):
        parse_config("dims:\n  a: [1\n  b: 2\n", "v.yaml")
    with pytest.raises(ConfigError, match=r"v.yaml:2: not valid YAML"):
        parse_config("dims:\n  a: \x07\n", "v.yaml")
    with pytest.raises(ConfigError, match="empty"):
        parse_config("", "v.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    # break-it findings: a file that is not UTF-8 raised UnicodeDecodeError, /dev/zero read without bound
    (tmp_path / "b.yaml").write_bytes(b"dims:\n  \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"b.yaml:2: not UTF-8 text \(byte 0xff\)"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "big.yaml").write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="at most 1048576 bytes"):
        load_config(tmp_path / "big.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")  # open() would wait for a writer forever (break-it finding)
    with pytest.raises(ConfigError, match="a regular file expected"):
        load_config(tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match="a regular file expected"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="NUL byte"):
        load_config("a\0b.yaml")
