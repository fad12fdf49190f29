"""lab/trace.py's parts that need no GPU: reading the stamps a trace build (MLA_TRACE=1,
templates/mla/trace.cuh) leaves in the library's trace buffer, and turning them into phases."""
import pytest
import torch


@pytest.fixture(scope="module")
def trace(lab_module):
    with lab_module("trace") as module:
        yield module


def _words(ctas, stamps, slots=16):
    """stamps: {row: (entry, producer_start, q, loop, stored, producer_done, sm, tiles, segments
    [, loop_done_last, merged])}"""
    w = torch.zeros(ctas, slots, dtype=torch.int64)
    for row, (entry, pstart, q, loop, stored, pdone, sm, tiles, segs, *rest) in stamps.items():
        w[row, :8] = torch.tensor([entry, pstart, q, loop, stored, pdone, (sm << 32) | tiles, segs])
        if rest:
            w[row, 8:10] = torch.tensor(rest)
    return w


def test_slots_match_the_kernel_header(trace):
    from pathlib import Path
    header = (Path(__file__).resolve().parents[2] / "templates" / "mla" / "trace.cuh").read_text()
    assert f"constexpr int kTraceSlots = {trace.SLOTS};" in header
    for name, slot in (("kTraceLoopDoneLast", trace.LOOP_DONE_LAST), ("kTraceMerged", trace.MERGED),
                       ("kTraceSegments", trace.SEGMENTS), ("kTraceStored", trace.STORED),
                       ("kTraceSegPrevEnd", trace.SEG_PREV_END), ("kTraceSegQIssued", trace.SEG_Q_ISSUED),
                       ("kTraceSegEnd", trace.SEG_END), ("kTraceSegTiles", trace.SEG_TILES)):
        assert f"{name} = {slot}," in header


def test_epilogue_splits_into_lag_merge_and_store(trace):
    # wg1 ends its loop 1.5 us after wg0; the merge ends 0.5 us later, the stores 1 us after that.
    # Row 1: the last warpgroup had no tile and left at once (negative lag; merge counts from wg0).
    w = _words(2, {0: (1_000, 1_500, 2_000, 4_000, 7_000, 5_000, 0, 2, 0, 5_500, 6_000),
                   1: (1_000, 1_500, 2_000, 4_000, 5_000, 4_000, 1, 1, 0, 2_100, 4_300)})
    full, single = trace.phases(trace.cta_records(w, m_blocks=1, grid_x=2))
    assert full["lag"] == pytest.approx(1.5) and full["merge"] == pytest.approx(0.5)
    assert full["store"] == pytest.approx(1.0) and full["epilogue"] == pytest.approx(3.0)
    assert single["lag"] == pytest.approx(-1.9) and single["merge"] == pytest.approx(0.3)
    assert single["store"] == pytest.approx(0.7)


def test_records_decode_the_grid(trace):
    # 128 heads, q_len 1, batch 3, 2 splits: m_blocks 2, grid (6, 2); CTA (x, y) at row x + 6 y.
    w = _words(12, {0: (1, 2, 3, 4, 5, 6, 7, 4, 0), 5: (1, 2, 3, 4, 5, 6, 9, 3, 0), 11: (1, 2, 3, 4, 5, 6, 2, 1, 0)})
    recs = trace.cta_records(w, m_blocks=2, grid_x=6)
    assert [(r["unit"], r["m_block"], r["split"], r["sm"], r["tiles"]) for r in recs] == [
        (0, 0, 0, 7, 4), (2, 1, 0, 9, 3), (2, 1, 1, 2, 1)]


class _Facts:
    """A launch's facts as the library's plan gives them (launch.facts): 32 rows per CTA, and the
    second kernel's 64 when every split is shorter than 1024 keys."""
    rows_per_cta = 32

    def __init__(self):
        self.calls = []

    def rows_for(self, q_rows):
        return 32

    def launch_rows(self, max_seq_len, num_kv_splits, q_rows=1):
        self.calls.append((max_seq_len, num_kv_splits))
        return 64 if -(-max_seq_len // num_kv_splits) < 1024 else 32


class _Launch:
    def __init__(self, key, symbol="mla_decode_h32_p64_bf16_split"):
        self.key, self.symbol, self.facts = key, symbol, _Facts()


class _Library:
    def __init__(self, plans):
        self.plans, self.asked = plans, []

    def plan(self, num_heads, page_size, dtype, split):
        self.asked.append((num_heads, page_size, dtype, split))
        got = self.plans.get(num_heads)
        if got is None:
            raise LookupError(f"no variant for {num_heads} heads")  # VariantNotCompiledError is a LookupError
        return got


def test_rows_per_cta_come_from_the_launch_facts(trace):
    launch = _Launch((32, 64, "bf16", True))
    assert trace.rows_per_cta(launch) == 32 and launch.facts.calls == []  # the variant's own rows
    assert [trace.rows_per_cta(launch, 4096, n) for n in (1, 4, 5, 64)] == [32, 32, 64, 64]
    assert launch.facts.calls == [(4096, 1), (4096, 4), (4096, 5), (4096, 64)]  # the bound and split count as given


def test_the_launch_is_the_plan_of_one_exact_variant(trace, monkeypatch):
    """A case is traced only where the library's plan for it is one launch of a variant with exactly its
    head count: masked rows or head groups would not decode to the kernel's row blocks."""
    exact, larger = _Launch((32, 64, "bf16", True)), _Launch((64, 64, "bf16", True))
    lib = _Library({32: [exact], 24: [larger], 128: [_Launch((64, 64, "bf16", True)), _Launch((64, 64, "bf16", True))]})
    monkeypatch.setattr(trace._binding, "library", lambda: lib)
    assert trace.the_launch(32, 64, "bf16", True) is exact
    assert trace.the_launch(24, 64, "bf16", True) is None  # served with masked rows by the 64-head variant
    assert trace.the_launch(128, 64, "bf16", True) is None  # two head groups
    assert trace.the_launch(16, 64, "bf16", True) is None  # no variant
    assert lib.asked[0] == (32, 64, "bf16", True)


def test_phases_and_waves(trace):
    w = _words(3, {
        # Two CTAs on SM 0, the second entering after the first stored: a later wave.
        0: (1_000, 2_000, 5_000, 13_000, 15_000, 14_000, 0, 4, 0),
        1: (16_000, 16_500, 18_000, 26_000, 27_000, 26_500, 0, 4, 0),
        # A CTA without tiles never sees Q: its q and loop phases are missing, not zero.
        2: (1_200, 0, 0, 1_300, 2_200, 0, 1, 0, 0)})
    rows = trace.phases(trace.cta_records(w, m_blocks=1, grid_x=3))
    first, second, empty = rows
    assert first["q"] == pytest.approx(4.0) and first["loop"] == pytest.approx(8.0)
    assert first["loop_per_tile"] == pytest.approx(2.0) and first["epilogue"] == pytest.approx(2.0)
    assert first["cta"] == pytest.approx(14.0) and first["start"] == pytest.approx(1.0)
    assert not first["later_wave"] and second["later_wave"] and not empty["later_wave"]
    assert second["spread"] == pytest.approx(15.0)
    assert empty["q"] is None and empty["loop"] is None and empty["loop_per_tile"] is None
    summary = trace.summarize(rows)
    assert summary["all"]["cta"]["n"] == 3 and summary["later_waves"]["q"]["median"] == pytest.approx(2.0)
    assert summary["all"]["q"]["n"] == 2


def test_scheduled_cost_fit(trace):
    # Six scheduled CTAs whose times follow 5 + 1.5 tiles + 3 segments us exactly; row 6 never stamped.
    plan = [(4, 1), (6, 1), (4, 2), (8, 3), (2, 2), (10, 1)]
    w = _words(7, {x: (1000, 1100, 0, 0, 1000 + int((5 + 1.5 * t + 3 * g) * 1000), 0, x, t, g)
                   for x, (t, g) in enumerate(plan)})
    recs = trace.cta_records(w, m_blocks=1, grid_x=7)
    assert [r["unit"] for r in recs] == list(range(6)) and recs[3]["segments"] == 3
    rows = trace.phases(recs)
    assert rows[0]["q"] is None and rows[0]["cta"] == pytest.approx(14.0)
    fit = trace.fit_cost(rows)
    assert fit["fixed_us"] == pytest.approx(5.0) and fit["per_tile_us"] == pytest.approx(1.5)
    assert fit["per_segment_us"] == pytest.approx(3.0) and fit["rms_residual_us"] < 1e-6
    assert trace.fit_cost(rows[:3]) is None  # too few CTAs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so_and_fails(trace, capsys):
    assert trace.main(["--heads", "128"]) == 1
    assert "no CUDA GPU available: the trace needs an sm_90a GPU" in capsys.readouterr().err


def test_scheduled_second_segment_phases(trace):
    # A scheduled CTA of 3 segments, 20 tiles: its first segment's stores done at 30 us, the second's Q
    # issued at 28.5, landed at 31, 10 tiles looped by 51 (wg1 0.5 later), merged at 52, stored at 53.
    w = _words(2, {0: (1_000, 1_100, 31_000, 51_000, 70_000, 68_000, 0, 20, 3, 51_500, 52_000),
                   1: (1_000, 1_100, 0, 0, 40_000, 39_000, 1, 12, 1)})
    w[0, 10:14] = torch.tensor([30_000, 28_500, 53_000, 10])
    seg, single = trace.phases(trace.cta_records(w, m_blocks=1, grid_x=2))
    assert seg["seg_q_lead"] == pytest.approx(1.5) and seg["seg_q_wait"] == pytest.approx(1.0)
    assert seg["seg_loop"] == pytest.approx(20.0) and seg["seg_loop_per_tile"] == pytest.approx(2.0)
    assert seg["seg_lag"] == pytest.approx(0.5) and seg["seg_merge"] == pytest.approx(0.5)
    assert seg["seg_store"] == pytest.approx(1.0) and seg["seg_total"] == pytest.approx(23.0)
    assert seg["seg_tiles"] == 10 and seg["cta"] == pytest.approx(69.0)
    assert seg["q"] is None and seg["loop"] is None and seg["epilogue"] is None  # not the CTA's phases
    assert single["seg_total"] is None and single["cta"] == pytest.approx(39.0)
    summary = trace.summarize([seg, single])
    assert summary["all"]["seg_q_wait"]["n"] == 1 and summary["all"]["cta"]["n"] == 2
