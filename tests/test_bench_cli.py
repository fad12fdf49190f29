"""benchmarks/bench.py's command-line parts that need no GPU: which anchors file a run reads by
default, and the source hash a run records."""
import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench") as module:
        yield module


@pytest.mark.parametrize("dtype, mode, name", [
    ("bf16", None, "anchors-h200.json"),
    ("fp16", "bf16_q1", "anchors-h200.json"),
    ("fp8_e4m3", None, "anchors-h200-modes.json"),
    ("bf16", "bf16_q2", "anchors-h200-modes.json"),
])
def test_default_anchors_file_follows_dtype_and_mode(bench, dtype, mode, name):
    assert bench.default_anchors_name(dtype, mode) == name
    args = bench.parse_args(["--dtype", dtype] + (["--mode", mode] if mode else []))
    assert bench.default_anchors_name(args.dtype, args.mode) == name


def test_tree_hash_is_stable_and_printed_without_a_gpu(bench, capsys):
    first = bench.tree_hash()
    assert len(first) == 64 and set(first) <= set("0123456789abcdef")
    assert bench.tree_hash() == first
    assert bench.main(["--tree-hash"]) == 0
    assert capsys.readouterr().out.strip() == first


def test_tree_hash_follows_the_kernel_sources(bench, monkeypatch, tmp_path):
    (tmp_path / "templates" / "mla").mkdir(parents=True)
    (tmp_path / "mla_variants").mkdir()
    (tmp_path / "templates" / "mla" / "kernel.cuh").write_text("// v1\n")
    (tmp_path / "mla_variants" / "api.py").write_text("X = 1\n")
    (tmp_path / "variants.yaml").write_text("axes: {}\n")
    monkeypatch.setattr(bench, "REPO", tmp_path)
    before = bench.tree_hash()
    (tmp_path / "templates" / "mla" / "kernel.cuh").write_text("// v2\n")
    changed = bench.tree_hash()
    (tmp_path / "templates" / "mla" / "kernel.cuh").write_text("// v1\n")
    (tmp_path / "README.md").write_text("not a source\n")
    assert changed != before
    assert bench.tree_hash() == before  # same sources again; files outside them do not count
