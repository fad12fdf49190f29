"""benchmarks/bench.py's command-line parts that need no GPU: which anchors file a run reads by
default, the source hash a run records, and the roofline plot of a recorded run (--from-json --plot)."""
import re
import sys

import pytest
import torch

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


def test_a_mode_runs_at_its_cases_q_len(bench, tmp_path):
    """The modes file gives q_len per case, not at its top level: --mode bf16_q2 must measure q_len 2
    (until session 29 the run took the missing top-level value and measured q_len 1)."""
    import json
    case = dict(num_heads=16, batch=2, seq_mean=64, page_size=64, ragged=False)
    data = {"gpu": "H200", "cases": [dict(case, mode="bf16_q1", q_len=1), dict(case, mode="bf16_q2", q_len=2),
                                     dict(case, mode="fp8_q1", q_len=1)]}
    path = tmp_path / "modes.json"
    path.write_text(json.dumps(data))
    for mode, want in (("bf16_q2", 2), ("bf16_q1", 1), (None, 1)):
        args = bench.parse_args(["--anchors", str(path)] + (["--mode", mode] if mode else []))
        cases, meta, _ = bench.load_cases(args)
        assert len(cases) == 1 and bench.cases_q_len(cases, meta) == want, mode
    assert bench.cases_q_len([case], {"q_len": 3}) == 3 and bench.cases_q_len([case], {}) == 1
    with pytest.raises(SystemExit, match="mix q_len"):
        bench.cases_q_len([dict(case, q_len=1), dict(case, q_len=2)], {})
    assert bench.cases_q_len([], {}) == 1  # an empty selection (trace.py, timeline.py) runs nothing
    for bad in (2.7, None, "2", 0, 9, True):
        with pytest.raises(SystemExit, match="q_len must be an int from 1 to 8"):
            bench.cases_q_len([dict(case, q_len=bad)], {})


def test_a_mode_or_dtype_the_anchors_do_not_hold_is_refused(bench, tmp_path, monkeypatch):
    """--mode bf16_q2 on a file without that mode (or on the generated grid) would measure q_len 1 under
    a q_len-2 label, and --dtype bf16 on fp8 cases would compare a bf16 run with fp8 peers: both exit."""
    import json
    case = dict(num_heads=16, batch=2, seq_mean=64, page_size=64, ragged=False)
    plain, modes = tmp_path / "plain.json", tmp_path / "modes.json"
    plain.write_text(json.dumps({"cases": [case]}))
    modes.write_text(json.dumps({"cases": [dict(case, mode="fp8_q1", q_len=1, kv_dtype="fp8"),
                                           dict(case, mode="bf16_q2", q_len=2, kv_dtype="bf16")]}))
    with pytest.raises(SystemExit, match="has no case of that mode"):
        bench.load_cases(bench.parse_args(["--anchors", str(plain), "--mode", "bf16_q2"]))
    monkeypatch.setattr(bench, "default_anchors_path", lambda name: tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="no anchors file"):
        bench.load_cases(bench.parse_args(["--mode", "bf16_q2"]))
    with pytest.raises(SystemExit, match="cases have a fp8 cache"):
        bench.load_cases(bench.parse_args(["--anchors", str(modes), "--mode", "fp8_q1"]))
    with pytest.raises(SystemExit, match="cases have a bf16 cache"):
        bench.load_cases(bench.parse_args(["--anchors", str(modes), "--mode", "bf16_q2", "--dtype", "fp8_e4m3"]))
    assert len(bench.load_cases(bench.parse_args(["--anchors", str(modes), "--dtype", "fp8_e4m3"]))[0]) == 1
    assert len(bench.load_cases(bench.parse_args(["--anchors", str(plain)]))[0]) == 1


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


def _cpu_inputs(batch=3, q_len=2, heads=16, page=4, fp8=False):
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return {"q": torch.zeros(batch, q_len, heads, 576, dtype=torch.bfloat16),
            "kv_cache": torch.zeros(5, page, 576, dtype=kv_dtype),
            "block_table": torch.zeros(batch, 7, dtype=torch.int32),
            "seq_lens": torch.ones(batch, dtype=torch.int32)}


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_call_preallocates_and_passes_the_case(bench, monkeypatch, fp8):
    seen = []
    monkeypatch.setattr(bench, "mla_decode", lambda *a, **kw: seen.append((a, kw)))
    inputs = _cpu_inputs(fp8=fp8)
    call, out, lse = bench.decode_call(inputs, 4)
    assert out.shape == (3, 2, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (3, 16, 2)
    call()
    call()
    (a1, kw1), (a2, kw2) = seen
    assert a1[0] is inputs["q"] and a1[4] == bench.SOFTMAX_SCALE and kw1["num_kv_splits"] == 4
    assert kw1["out"] is out and kw1["lse"] is lse and kw2["workspace"] is kw1["workspace"]  # allocated once
    assert kw1["workspace"].numel() >= bench.workspace_size(3, 16, 2, 4)
    assert kw1.get("k_scale") == (bench.K_SCALE if fp8 else None)
    assert kw1.get("fp8_mode") == ("exact" if fp8 else None)  # --fp8-mode's default; none for a 16-bit cache


def test_fp8_mode_fast_reaches_the_call_and_needs_an_fp8_dtype(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "mla_decode", lambda *a, **kw: seen.append(kw))
    monkeypatch.setattr(bench, "FP8_MODE", "exact")
    bench.parse_args(["--dtype", "fp8_e4m3", "--fp8-mode", "fast"])
    assert bench.FP8_MODE == "fast"
    inputs = _cpu_inputs(fp8=True)
    bench.decode_call(inputs, 2)[0]()
    assert seen[0]["fp8_mode"] == "fast" and bench.case_tolerance(inputs) is bench.FP8_FAST_TOLERANCE
    args = bench.parse_args(["--dtype", "fp8_e4m3", "--fp8-mode", "fast"])
    assert bench.variant_dtype(args) == "fp8_e4m3_fast" and bench.element_sizes("fp8_e4m3_fast") == (1, 2)
    assert bench.variant_dtype(bench.parse_args(["--dtype", "fp8_e4m3"])) == "fp8_e4m3"
    with pytest.raises(SystemExit):
        bench.parse_args(["--fp8-mode", "fast"])  # bf16 cache


def test_tma_reaches_the_call_only_when_set(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "mla_decode", lambda *a, **kw: seen.append(kw))
    monkeypatch.setattr(bench, "TMA_MODE", "auto")
    bench.parse_args([])
    bench.decode_call(_cpu_inputs(fp8=False), 2)[0]()
    assert "tma" not in seen[-1]  # the default call is mla_decode's own default
    bench.parse_args(["--tma", "off"])
    assert bench.TMA_MODE == "off"
    bench.decode_call(_cpu_inputs(fp8=False), 2)[0]()
    assert seen[-1]["tma"] == "off"
    for bad in (["--tma", "off", "--balanced"], ["--tma", "require", "--varlen", "1,2"], ["--tma", "on"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    bench.parse_args([])  # leave TMA_MODE at its default for the other tests
    assert bench.TMA_MODE == "auto"


@pytest.mark.parametrize("served", [True, False])
def test_balanced_call_makes_the_plan_and_schedule_of_the_case(bench, monkeypatch, served):
    made = {}

    class Plan:
        def __init__(self, *a, **kw):
            made["init"] = (a, kw)

        def schedule(self, seq_lens, **kw):
            made.setdefault("schedules", []).append(kw)
            return served

        def run(self, *a, **kw):
            made["run"] = (a, kw)

    monkeypatch.setattr(bench, "MLADecodePlan", Plan)
    inputs = _cpu_inputs()
    out, lse = torch.empty(0), torch.empty(0)
    call, plan, schedule = bench.balanced_call(inputs, out, lse, None, 5)
    a, kw = made["init"]
    assert a == (3, 16, 4) and kw["q_len"] == 2 and kw["balanced"] is True and kw["max_seq_len"] == 7 * 4
    assert made["schedules"] == [{"max_seq_len": 28, "overhead_tiles": 5}]
    assert (schedule is not None) == served
    call()
    assert made["run"][1]["out"] is out and made["run"][1]["lse"] is lse


def test_schedule_label_names_the_cut_or_the_one_request_split(bench):
    from mla_variants.plan import ScheduledStep
    assert bench.schedule_label(ScheduledStep(1, "uniform", 0, 12, False)) == 12
    assert bench.schedule_label(ScheduledStep(32, "balanced", 66, 0, False)) == "b66"
    assert bench.schedule_label(ScheduledStep(32, "uniform", 132, 0, True)) == "u132"


def _recorded_run(bench) -> dict:
    """A small result file as bench.py --json writes it (rows made by derived(), as a run makes them):
    memory-bound 16-head and compute-bound 128-head cases, one without a peer time, one skipped and
    one that failed the reference check."""
    ceilings = {"read_tbps": 4.335, "bf16_matmul_tflops": 782.9}
    cases = []
    for i, (heads, lens, cold_us, peer_us) in enumerate([(16, [1024], 12.1, 19.4), (16, [16384] * 128, 562.4, 623.6),
                                                         (128, [16384] * 128, 990.4, 1006.3), (64, [4096] * 8, 30.0, None),
                                                         (32, [4096] * 8, 20.0, 25.0)]):
        case = dict(num_heads=heads, batch=len(lens), seq_mean=lens[0], page_size=64, ragged=False, seq_lens=lens,
                    best_us=peer_us, best_peer=peer_us and "fi072_fa3")
        row = {"num_kv_splits": 1, "cold_us": cold_us, "graph_us": cold_us, "check": "pass" if i < 4 else "FAIL: out"}
        bench.derived(case, row, 2, 1, ceilings, 2)
        rec = {k: case[k] for k in ("num_heads", "batch", "seq_mean", "page_size", "ragged", "best_us", "best_peer")}
        cases.append(dict(rec, index=i, dtype="bf16", q_len=1, seq_total=sum(lens), **row))
    cases.append(dict(num_heads=8, batch=1, seq_mean=1024, page_size=16, ragged=False, index=5, dtype="bf16",
                      q_len=1, seq_total=1024, skipped="not in this build"))
    return {"environment": {"gpu": "NVIDIA H200", "date": "2026-12-04T12:00:00+00:00", "git_commit": "0" * 40},
            "anchors_meta": {"date": "2026-12-04", "ceilings": ceilings}, "ceilings": ceilings, "cases": cases}


def test_roofline_points_use_the_runs_byte_and_flop_accounting(bench):
    report = _recorded_run(bench)
    points = bench.roofline_points(report)
    assert [p["num_heads"] for p in points] == [16, 16, 128, 64]  # no skipped or check-failing case
    first = points[0]  # 16 heads, one request of 1024 keys, bf16: cache rows + q + out
    nbytes, flops = 1024 * 576 * 2 + 16 * (576 + 512) * 2, 2 * 1024 * 16 * (576 + 512)
    assert first["intensity"] == pytest.approx(flops / nbytes)
    assert first["ours_tbps"] == pytest.approx(nbytes / 12.1e-6 / 1e12)
    assert first["peer_tflops"] == pytest.approx(flops / 19.4e-6 / 1e12)
    for p, row in zip(points, report["cases"]):  # the same numbers as the run's own columns
        assert p["ours_tbps"] == pytest.approx(row["tbps"]) and p["ours_tflops"] == pytest.approx(row["tflops"])
    assert points[3]["peer_tbps"] is None and points[3]["peer_tflops"] is None
    assert points[2]["intensity"] > 782.9 / 4.335 > points[1]["intensity"]  # either side of the ridge


def test_from_json_plot_draws_a_recorded_run_without_a_gpu(bench, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the [plot] extra)")
    import json
    from matplotlib.image import imread
    results = tmp_path / "run.json"
    results.write_text(json.dumps(_recorded_run(bench)))
    out = tmp_path / "plots" / "roofline.png"
    assert bench.main(["--from-json", str(results), "--plot", str(out)]) == 0
    assert "roofline of 4 cases" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    pixels = imread(str(out))
    assert pixels.shape[0] > 400 and pixels.shape[1] > 1000 and pixels.std() > 0.05  # drawn, not blank
    assert bench.main(["--from-json", str(results), "--plot", str(out), "--heads", "128"]) == 0
    assert "roofline of 1 cases" in capsys.readouterr().out


def test_plot_options_fail_clearly(bench, tmp_path, monkeypatch, capsys):
    """--from-json without --plot, a missing file, a file with no timed case, and a missing matplotlib
    (which must name the extra that installs it) each stop with a message, before any GPU check."""
    results, png = tmp_path / "run.json", str(tmp_path / "r.png")
    assert bench.main(["--from-json", str(results)]) == 2
    assert "--from-json needs --plot" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=re.escape("pip install matplotlib")):
        bench.main(["--from-json", str(results), "--plot", png])
    monkeypatch.undo()
    pytest.importorskip("matplotlib", reason="the remaining checks run after --plot's matplotlib import")
    with pytest.raises(SystemExit, match="no such file"):
        bench.main(["--from-json", str(results), "--plot", png])
    results.write_text('{"cases": [{"num_heads": 16, "batch": 1, "seq_mean": 64, "page_size": 64, "ragged": false}]}')
    with pytest.raises(SystemExit, match="no timed case"):  # e.g. an anchors file given by mistake
        bench.main(["--from-json", str(results), "--plot", png])


def test_varlen_model_is_each_requests_share_of_its_uniform_batch(bench):
    q_lens = bench.varlen_q_lens(6, [1, 2, 0])
    assert q_lens == [1, 2, 0, 1, 2, 0]
    # 2 of 6 requests at q_len 1 (uniform 60 us), 2 at q_len 2 (90 us), 2 empty: 20 + 30
    assert bench.varlen_model_us(q_lens, {1: 60.0, 2: 90.0}) == pytest.approx(50.0)
    assert bench.varlen_model_us([3, 3], {3: 70.0}) == pytest.approx(70.0)


def test_varlen_call_packs_each_requests_first_tokens(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "mla_decode_varlen", lambda *a, **kw: seen.append((a, kw)))
    inputs = _cpu_inputs(batch=3, q_len=4)
    inputs["q"] = torch.arange(3 * 4, dtype=torch.bfloat16).view(3, 4, 1, 1).expand(3, 4, 16, 576).contiguous()
    call, out, lse, q, loc = bench.varlen_call(inputs, [1, 4, 0], 2)
    assert loc.tolist() == [0, 1, 5, 5] and loc.dtype == torch.int32
    assert q[:, 0, 0].tolist() == [0.0, 4.0, 5.0, 6.0, 7.0]  # request 0's token 0, request 1's four
    assert out.shape == (5, 16, 512) and lse.shape == (16, 5)
    call()
    (a, kw), = seen
    assert a[0] is q and kw["query_start_loc"] is loc and kw["max_q_len"] == 4 and kw["num_kv_splits"] == 2
    assert kw["out"] is out and kw["lse"] is lse


@pytest.mark.parametrize("argv, message", [
    (["--q-len", "9"], "--q-len must be from 1 to 8"),
    (["--varlen", "0,0"], "--varlen needs q_lens from 0 to 8, at least one of them >= 1"),
    (["--varlen", "1,9"], "--varlen needs q_lens from 0 to 8"),
    (["--varlen", "1,2", "--q-len", "2"], "--varlen does not combine with --q-len"),
    (["--vs-q1", "--balanced"], "--vs-q1 times mla_decode at q_len 1"),
])
def test_serving_mode_options_fail_clearly(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_max_errors_skip_rows_whose_reference_lse_is_minus_inf(bench):
    ref_out = torch.zeros(1, 1, 2, 4)
    out = ref_out.clone()
    out[0, 0, 1, 3] = 2.5e-4
    ref_lse = torch.tensor([[[1.0], [-float("inf")]]])
    lse = torch.tensor([[[1.0 + 3e-5], [-float("inf")]]])
    errors = bench.max_errors(out, lse, ref_out, ref_lse)
    assert errors["max_abs_err"] == pytest.approx(2.5e-4)
    assert errors["lse_max_abs_err"] == pytest.approx(3e-5, rel=1e-2)


def test_checked_errors_are_compared_with_the_fastest_peers(bench):
    """--check records our max abs out error; against anchors with peers_err the row carries the fastest
    peer's error on the same inputs and the summary counts the cases at or below it."""
    ceilings = {"read_tbps": 4.0, "bf16_matmul_tflops": 750.0}
    case = {"num_heads": 128, "seq_lens": [4096], "best_us": 20.0, "best_peer": "fork",
            "peers_err": {"fork": 3e-4, "other": 1e-5}}
    rows = [{"cold_us": 25.0, "max_abs_err": 2e-4}, {"cold_us": 25.0, "max_abs_err": 4e-4},
            {"cold_us": 25.0}]  # the last one ran without --check
    for row in rows:
        bench.derived(case, row, 1, 1, ceilings, 2)
    assert [r.get("best_peer_err") for r in rows] == [3e-4, 3e-4, None]
    s = bench.summarize(rows)
    assert (s["err_at_or_below_peer"], s["compared_err"], s["max_abs_err"]) == (1, 2, 4e-4)
    no_errors = dict(case, peers_err=None)
    row = {"cold_us": 25.0, "max_abs_err": 2e-4}
    bench.derived(no_errors, row, 1, 1, ceilings, 2)
    assert "best_peer_err" not in row
