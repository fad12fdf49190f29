"""benchmarks/trace.py's parts that need no GPU: reading the stamps a trace build (MLA_TRACE=1,
templates/mla/trace.cuh) leaves in the spare columns of `out`, and turning them into phases."""
import pytest
import torch

from conftest import benchmark_module


@pytest.fixture(scope="module")
def trace():
    with benchmark_module("trace") as module:
        yield module


def _stamp(spare, b, qi, h, split, entry, pstart, q, loop, stored, pdone, sm, tiles):
    words = [entry, pstart, q, loop, stored, pdone, (sm << 32) | tiles, 0]
    spare[b, qi, h, split * 8:(split + 1) * 8] = torch.tensor(words, dtype=torch.int64)


def test_records_are_read_from_each_row_blocks_first_row(trace):
    # 128 heads, q_len 1: two 64-row blocks per request, their first rows are heads 0 and 64.
    spare = torch.zeros(2, 1, 128, 128, dtype=torch.int64)
    _stamp(spare, 0, 0, 0, 0, 1000, 1500, 3000, 9000, 10000, 9500, sm=3, tiles=4)
    _stamp(spare, 1, 0, 64, 1, 2000, 2500, 4000, 12000, 13000, 12500, sm=5, tiles=2)
    _stamp(spare, 1, 0, 3, 0, 7, 7, 7, 7, 7, 7, sm=1, tiles=1)  # not a block's first row: ignored
    recs = trace.cta_records(spare, num_heads=128, q_len=1, splits=2)
    assert [(r["b"], r["m_block"], r["split"], r["sm"], r["tiles"]) for r in recs] == [(0, 0, 0, 3, 4), (1, 1, 1, 5, 2)]


def test_transposed_path_blocks_cover_q_len_times_heads(trace):
    # 8 heads, q_len 4: 32 rows in 8-row blocks, block m starts at row 8 m = (qi m, head 0).
    spare = torch.zeros(1, 4, 8, 128, dtype=torch.int64)
    for m in range(4):
        _stamp(spare, 0, m, 0, 0, 100 + m, 0, 0, 0, 0, 0, sm=m, tiles=1)
    assert [r["m_block"] for r in trace.cta_records(spare, num_heads=8, q_len=4, splits=1)] == [0, 1, 2, 3]


def test_phases_and_waves(trace):
    spare = torch.zeros(3, 1, 64, 128, dtype=torch.int64)
    # Two CTAs on SM 0, the second entering after the first stored: a later wave.
    _stamp(spare, 0, 0, 0, 0, 1_000, 2_000, 5_000, 13_000, 15_000, 14_000, sm=0, tiles=4)
    _stamp(spare, 1, 0, 0, 0, 16_000, 16_500, 18_000, 26_000, 27_000, 26_500, sm=0, tiles=4)
    # A CTA without tiles never sees Q: its q and loop phases are missing, not zero.
    _stamp(spare, 2, 0, 0, 0, 1_200, 0, 0, 1_300, 2_200, 0, sm=1, tiles=0)
    rows = trace.phases(trace.cta_records(spare, num_heads=64, q_len=1, splits=1))
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


def test_scheduled_records_and_the_cost_fit(trace):
    # Six scheduled CTAs whose times follow 5 + 1.5 tiles + 3 segments us exactly.
    tail = torch.zeros(7, 8, dtype=torch.int64)
    plan = [(4, 1), (6, 1), (4, 2), (8, 3), (2, 2), (10, 1)]
    for x, (tiles, segs) in enumerate(plan):
        t = 5 + 1.5 * tiles + 3 * segs
        tail[x] = torch.tensor([1000, 1100, 0, 0, 1000 + int(t * 1000), 0, (x << 32) | tiles, segs])
    recs = trace.scheduled_records(tail)  # row 6 never stamped: no record
    assert [r["cta_index"] for r in recs] == list(range(6)) and recs[3]["segments"] == 3 and recs[3]["sm"] == 3
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
