"""The balanced schedule's algorithm (mla_variants.testing.reference_schedule, the Python mirror of
templates/mla/schedule.cu that tests/test_gpu_schedule.py holds the kernel to): whatever the lengths,
every tile of every request is covered by exactly one CTA, every empty request by exactly one segment,
pieces are numbered within the workspace, and the cost model keeps the cut the H200 measured faster."""
import random
import re
from pathlib import Path

import pytest

from mla_variants.testing import SEGMENT_SORT_MAX, _segments, reference_schedule as _reference_schedule

_CONFIG = (Path(__file__).resolve().parents[1] / "templates" / "mla" / "config.cuh").read_text()
# The cost model as the kernels compile it (config.cuh's policy values; the GPU test reads the library's).
MODEL = dict(piece_cost=float(re.search(r"kPieceCost = ([0-9.]+)f;", _CONFIG).group(1)),
             balanced_margin=float(re.search(r"kBalancedMargin = ([0-9.]+)f;", _CONFIG).group(1)))


def reference_schedule(*args, **kwargs):
    return _reference_schedule(*args, **kwargs, **MODEL)


def _check_invariants(seq_lens, max_keys, ctas, overhead, splits, kind=None):
    sch = reference_schedule(seq_lens, max_keys, ctas, overhead, splits, kind)
    bounds, reqs = sch["bounds"], sch["requests"]
    batch = len(seq_lens)
    tiles = [r[0] for r in reqs]
    assert bounds[0] == (0, 0) and bounds[ctas] == (batch, 0)
    assert all(bounds[c] <= bounds[c + 1] for c in range(ctas))
    assert all(t == 0 or t < tiles[b] for b, t in bounds[:ctas] if b < batch)
    covered = [[0] * t for t in tiles]
    empty_seen = [0] * batch
    pieces_seen = set()
    for c in range(ctas):
        for b, t0, t1 in _segments(bounds, tiles, c):
            assert 0 <= t0 <= t1 <= tiles[b]
            _, first, first_piece, pieces = reqs[b]
            assert first <= c < first + pieces, (b, c, reqs[b])
            if pieces > 1:
                piece = first_piece + c - first
                assert piece not in pieces_seen and 0 <= piece < batch + ctas
                pieces_seen.add(piece)
                assert t1 > t0  # a CTA sharing a request has some of its tiles
            if tiles[b] == 0:
                empty_seen[b] += 1
            for t in range(t0, t1):
                covered[b][t] += 1
    assert all(x == 1 for row in covered for x in row)
    assert all(empty_seen[b] == 1 for b in range(batch) if tiles[b] == 0)
    assert sum(r[3] for r in reqs) <= batch + ctas - 1
    assert [r[2] for r in reqs] == [sum(r[3] for r in reqs[:b]) for b in range(batch)]
    # The combine's list fits the layout's ctas slots: each shared request lies across an inner bound.
    assert sch["shared"] == [b for b in range(batch) if reqs[b][3] > 1] and len(sch["shared"]) <= ctas - 1
    # The transposed path's CTAs: every (request, CTA) segment exactly once, within the layout's
    # batch + ctas entries, costliest first (by 256 classes of the busiest CTA's price), then in request
    # order; no segment costs more than the busiest CTA.
    segs = sch["segments"]
    assert sorted(segs) == sorted((b, c) for c in range(ctas) for b, _, _ in _segments(bounds, tiles, c))
    assert len(segs) == len(set(segs)) == sum(r[3] for r in reqs) <= batch + ctas - 1

    def cost(b, c):
        t0, t1 = next((t0, t1) for bb, t0, t1 in _segments(bounds, tiles, c) if bb == b)
        return t1 - t0 + overhead
    busiest = max(sum(t1 - t0 + overhead for _, t0, t1 in _segments(bounds, tiles, c)) for c in range(ctas))
    assert all(cost(*s) <= busiest for s in segs)
    keys = [(-(cost(*s) * 256 // (busiest + 1)), s) for s in segs]
    assert keys == sorted(keys) if len(segs) <= SEGMENT_SORT_MAX else segs == sorted(segs)
    return sch


@pytest.mark.parametrize("seed", range(40))
def test_schedule_covers_every_tile_once(seed):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 3, 7, 32, 100, 300])
    max_keys = rng.choice([64, 4096, 100_000])
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randrange(0, max_keys + 1), -5, max_keys + 1]) for _ in range(batch)]
    for kind in (None, 0, 1):
        _check_invariants(lens, max_keys, rng.choice([1, 2, 33, 66, 132]), rng.choice([1, 3, 8]),
                          rng.choice([1, 2, 4, 64]), kind)


def test_small_schedules_exhaustively():
    """Every length mix of up to 3 requests from lengths around tile edges (empty, invalid, one key, one
    tile, one tile + 1) on 1-8 CTAs, both cuts: the small-G edge cases (batch < G, repeated bounds)."""
    import itertools
    edge = [-1, 0, 1, 64, 65, 129, 640, 1001]
    for batch in (1, 2, 3):
        for lens in itertools.product(edge, repeat=batch):
            for ctas in range(1, 9):
                for kind in (0, 1):
                    _check_invariants(list(lens), 1000, ctas, 1 + ctas % 3, 1 + ctas % 4, kind)


def test_uniform_cut_reproduces_the_uniform_split():
    """batch * S <= G: CTA c gets exactly split c % S of request c // S (params.cuh split_range)."""
    lens, splits, ctas = [1000, 64, 0, 4097, 130], 4, 66
    sch = _check_invariants(lens, 8192, ctas, 3, splits, kind=1)
    tiles = [-(-n // 64) for n in lens]
    for c in range(len(lens) * splits):
        b, s = divmod(c, splits)
        per = -(-tiles[b] // splits)
        want = (min(tiles[b], s * per), min(tiles[b], (s + 1) * per))
        got = [(t0, t1) for bb, t0, t1 in _segments(sch["bounds"], tiles, c) if bb == b]
        assert got == ([want] if want[1] > want[0] or (s == 0 and tiles[b] == 0) else []), (c, got, want)


def test_cost_model_keeps_the_measured_faster_cut():
    """Measured on the H200 (docs/design.md, balanced schedule): balanced won on the 128 x 32 ragged batch,
    lost on 128 x 128 x 1024."""
    ragged = [529, 744, 1028, 1280, 1477, 1612, 2231, 2386, 2601, 2693, 3621, 3705, 4057, 4160, 4194, 4380,
              4508, 4570, 5174, 5488, 5849, 6212, 6422, 6745, 6756, 6768, 6796, 6973, 7080, 7084, 7358, 7454]
    assert reference_schedule(ragged, 8192, 66, 3, 2)["kind"] == 0
    assert reference_schedule([1024] * 128, 1024, 66, 3, 1)["kind"] == 1
    assert reference_schedule([16384], 16384, 132, 3, 64)["kind"] == 1  # 64 heads, batch 1: finer cut lost


def test_segment_table_beyond_the_sort_stays_in_request_order():
    """More segments than the schedule kernel sorts (kSegmentSortItems x kScheduleThreads): request order."""
    lens = [1 + (37 * i) % 900 for i in range(SEGMENT_SORT_MAX + 50)]
    sch = _check_invariants(lens, 1000, 8, 3, 1)
    assert len(sch["segments"]) > SEGMENT_SORT_MAX
