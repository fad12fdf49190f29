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


def test_code_warm_is_an_option_that_refuses_the_balanced_path(bench, capsys):
    assert bench.parse_args(["--code-warm"]).code_warm is True
    assert bench.parse_args([]).code_warm is False
    with pytest.raises(SystemExit):
        bench.parse_args(["--code-warm", "--balanced"])
    assert "--code-warm" in capsys.readouterr().err


def test_time_cold_runs_the_after_flush_call_between_flush_and_timed_call(bench, monkeypatch):
    # No GPU needed: CUDA events are replaced by a recorder of the call order.
    order = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            order.append("event")

        def elapsed_time(self, other):
            return 0.001

    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    t = bench.time_cold(lambda: order.append("call"), lambda: order.append("flush"), reps=2, warmup=1,
                        after_flush=lambda: order.append("warm"))
    assert order == ["call"] + ["flush", "warm", "event", "call", "event"] * 2
    assert t == pytest.approx(1.0)
