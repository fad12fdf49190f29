"""The balanced schedule on the GPU (MLADecodePlan.schedule, templates/mla/schedule.cuh): each CTA covers
a run of (request, tile) that may span several requests or end inside one (on the transposed path each
segment of a run is a CTA of its own), so every request must come out exactly as the reference,
whichever CTAs share it; NaN-poisoned pages, permuted block tables and NaN-prefilled outputs as
everywhere. Skips where the build has no bf16 split variant (most tests take the 64-row path's first)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # also skip when run outside the repo's conftest
    pytest.skip("no CUDA GPU on this machine (GPU tests run on an sm_90 device)", allow_module_level=True)

from mla_variants import MLADecodePlan, MLAInputError, _binding, mla_decode_reference  # noqa: E402
from mla_variants.plan import SCHEDULE_OVERHEAD_TILES  # noqa: E402
from mla_variants.testing import capture_graph, compare, make_paged_case, replay_steps  # noqa: E402


def _keys(max_count=None):
    lib = _binding.library()
    keys = sorted({(k[0], k[1]) for k in lib.table if k[2] == "bf16" and lib.facts[k].balanced_schedule},
                  key=lambda k: (k[1] not in (1, 64), k[0] != 128, k))
    return keys[:max_count] if max_count else keys


def _run(plan, case, seq_lens=None, **kw):
    seq_lens = case.seq_lens if seq_lens is None else seq_lens
    b, ql, h = case.q.shape[:3]
    out = torch.full((b, ql, h, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    lse = torch.full((b, h, ql), float("nan"), device="cuda")
    assert plan.schedule(seq_lens, max_seq_len=case.block_table.shape[1] * case.kv_cache.shape[1], **kw)
    plan.run(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    return out, lse


LENGTHS = {
    "ragged": [529, 744, 1028, 1280, 7454, 1612, 2231, 2386, 2601, 4160, 3621, 3705, 4057, 64, 4194, 4380],
    "zeros_ones_long": [0, 1, 100_000, 0, 65, 1, 0, 4096, 3],
    "one_long": [70_000, 1],
    "many_short": [1 + (7 * i) % 200 for i in range(300)],
    "all_empty": [0, 0, 0],
}


@pytest.mark.parametrize("name", sorted(LENGTHS))
@pytest.mark.parametrize("q_len", [1, 2])
def test_balanced_schedule_matches_reference(name, q_len):
    gen = torch.Generator().manual_seed(11)
    lib = _binding.library()
    for heads, page in _keys():
        lens = LENGTHS[name]
        plan = MLADecodePlan(len(lens), heads, page, q_len=q_len, max_seq_len=max(max(lens), 1), balanced=True)
        # A transposed variant's 64-row second kernel (more than 32 rows a request) has no scheduled form.
        assert plan.balanced == lib.facts[(heads, page, "bf16", True)].balances(heads * q_len)
        if not plan.balanced:
            continue
        assert plan.default_overhead_tiles == SCHEDULE_OVERHEAD_TILES  # the 16-bit kernels'
        case = make_paged_case(lens, heads, page, q_len=q_len, generator=gen)
        out, lse = _run(plan, case)
        ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                case.softmax_scale)
        problems = compare(out, lse, ref_out, ref_lse)
        assert not problems, f"h{heads} p{page} {name} q_len {q_len}: {problems}"
        if name == "one_long" and plan.sched_ctas > 32:  # either cut: about min(sched_ctas, 64) pieces
            # (the uniform one ceil(T / ceil(T / S)) for T tiles, S splits), so the scheduled combine
            # reads lse past its warp's 32 lanes (combine.cuh)
            assert _pieces(plan, 0) > 32, f"h{heads} p{page}: {_pieces(plan, 0)} pieces"


def _pieces(plan, b):
    """Request b's piece count in the plan's last schedule (schedule.cuh layout: the 2 (G + 1) bounds,
    then 4 ints a request, the pieces last)."""
    return int(plan._schedules[plan._sched_batch][2 * (plan.sched_ctas + 1) + 4 * b + 3].item())


@pytest.mark.parametrize("overhead", [1, 3, 50])
def test_balanced_schedule_any_overhead(overhead):
    heads, page = _keys(1)[0] if _keys() else pytest.skip("no bf16 split variant in this build")
    lens = LENGTHS["ragged"] + LENGTHS["zeros_ones_long"]
    case = make_paged_case(lens, heads, page, generator=torch.Generator().manual_seed(3))
    plan = MLADecodePlan(len(lens), heads, page, max_seq_len=max(lens), balanced=True)
    out, lse = _run(plan, case, overhead_tiles=overhead)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert not compare(out, lse, ref_out, ref_lse)


def test_stale_schedule_gives_nan_not_a_wrong_answer():
    """run with seq_lens whose tile counts changed since schedule(): those requests are NaN; others exact."""
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    now = [1000, 3064, 64, 501]   # the step's lengths (the cache and block table hold these tokens)
    before = [1000, 3000, 64, 500]  # what the schedule saw: request 1 one tile short, request 3 same tiles
    case = make_paged_case(now, heads, page, generator=torch.Generator().manual_seed(5))
    plan = MLADecodePlan(len(now), heads, page, max_seq_len=4096, balanced=True)
    assert plan.schedule(torch.tensor(before, dtype=torch.int32, device="cuda"),
                         max_seq_len=case.block_table.shape[1] * page)
    out = torch.full((4, 1, heads, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    lse = torch.full((4, heads, 1), float("nan"), device="cuda")
    plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    keep = [0, 2, 3]
    assert not compare(out[keep], lse[keep], ref_out[keep], ref_lse[keep])


def test_schedule_in_a_cuda_graph_follows_seq_lens():
    """schedule + run captured once; replays after seq_lens changed in place (other tile counts, another
    balance) stay exact."""
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    steps = ([300, 5000, 1, 2000, 0, 800], [8000, 1, 0, 64, 4000, 65])
    case = make_paged_case([max(x) for x in zip(*steps)], heads, page,
                           generator=torch.Generator().manual_seed(9))
    seq_lens = case.seq_lens.clone()
    plan = MLADecodePlan(len(steps[0]), heads, page, max_seq_len=8000, balanced=True)
    out = torch.empty(len(steps[0]), 1, heads, 512, dtype=case.q.dtype, device="cuda")
    lse = torch.empty(len(steps[0]), heads, 1, device="cuda")
    max_keys = case.block_table.shape[1] * page

    def step():
        plan.schedule(seq_lens, max_seq_len=max_keys)
        plan.run(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale, out=out, lse=lse)

    replay_steps(capture_graph(step), seq_lens, steps, out, lse,
                 lambda: mla_decode_reference(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale))


def test_schedule_argument_errors():
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    plan = MLADecodePlan(4, heads, page, max_seq_len=1024, balanced=True)
    with pytest.raises(MLAInputError, match="seq_lens: expected an int32 tensor"):
        plan.schedule(torch.zeros(4, dtype=torch.int64, device="cuda"))
    with pytest.raises(MLAInputError, match="seq_lens: expected 1 to max_batch=4 requests"):
        plan.schedule(torch.zeros(5, dtype=torch.int32, device="cuda"))
    with pytest.raises(MLAInputError, match="seq_lens: expected a tensor whose memory holds its values"):
        plan.schedule(torch._neg_view(torch.full((4,), -100, dtype=torch.int32, device="cuda")))
    with pytest.raises(MLAInputError, match="overhead_tiles"):
        plan.schedule(torch.zeros(4, dtype=torch.int32, device="cuda"), overhead_tiles=0)
    case = make_paged_case([10, 20, 30], heads, page)
    assert plan.schedule(torch.tensor([10, 20, 30, 40], dtype=torch.int32, device="cuda"))
    out = torch.empty(3, 1, heads, 512, dtype=case.q.dtype, device="cuda")
    lse = torch.empty(3, heads, 1, device="cuda")
    with pytest.raises(MLAInputError, match="seq_lens: expected the batch of the last MLADecodePlan.schedule"):
        plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    with pytest.raises(MLAInputError, match="max_seq_len"):
        plan.schedule(torch.zeros(4, dtype=torch.int32, device="cuda"), max_seq_len=-1)
    with pytest.raises(MLAInputError, match="max_seq_len"):
        plan.schedule(torch.zeros(4, dtype=torch.int32, device="cuda"), max_seq_len=4096.0)
    plain = MLADecodePlan(4, heads, page, max_seq_len=1024)
    assert not plain.balanced
    with pytest.raises(MLAInputError, match="balanced: expected a plan made with MLADecodePlan"):
        plain.schedule(torch.zeros(4, dtype=torch.int32, device="cuda"))
    with pytest.raises(MLAInputError, match="max_batch: expected at most 2\\*\\*20 with balanced=True"):
        MLADecodePlan(2**20 + 1, heads, page, balanced=True)


def test_plans_without_balanced_keep_the_workspace_contract():
    """Only balanced=True plans grow the workspace; plain plans still fit workspace_size(...)."""
    from mla_variants import workspace_size
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    plain = MLADecodePlan(512, heads, page, max_seq_len=4096)
    assert plain.workspace_bytes == workspace_size(512, heads, 1, plain.num_kv_splits)
    ws = torch.empty(max(plain.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    MLADecodePlan(512, heads, page, max_seq_len=4096, workspace=ws)  # accepted as documented
    bal = MLADecodePlan(512, heads, page, max_seq_len=4096, balanced=True)
    assert bal.workspace_bytes >= (512 + bal.sched_ctas) * heads * 513 * 4


def test_graph_at_one_batch_survives_a_schedule_for_another():
    """A graph captured at batch P keeps reading the schedule made for P after an eager schedule() for
    batch R (each batch size has its own buffer): its replay stays exact, nothing is written past P."""
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    lens = [300, 5000, 1, 2000]
    case = make_paged_case(lens, heads, page, generator=torch.Generator().manual_seed(13))
    plan = MLADecodePlan(8, heads, page, max_seq_len=8000, balanced=True)
    out = torch.empty(4, 1, heads, 512, dtype=case.q.dtype, device="cuda")
    lse = torch.empty(4, heads, 1, device="cuda")
    max_keys = case.block_table.shape[1] * page

    def step():
        plan.schedule(case.seq_lens, max_seq_len=max_keys)
        plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)

    graph = capture_graph(step)
    plan.schedule(torch.tensor([7000, 1, 1, 1, 1, 1, 1, 9], dtype=torch.int32, device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    assert not compare(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("path", ["rows64", "transposed"])
@pytest.mark.parametrize("seed", list(range(6)) + ["4300"])
def test_schedule_kernel_matches_the_python_model(seed, path):
    """The schedule buffer the kernel writes equals mla_variants.testing.reference_schedule (the cut the
    kernel kept; a near-tie of the two prices may go either way in fp32), for a 64-row plan (no segment
    table) and a transposed one (the segment table, sorted); "4300": a batch whose segment table is longer
    than the kernel sorts."""
    import random

    from mla_variants import default_num_kv_splits
    from mla_variants.launching import sm_count
    from mla_variants.testing import reference_schedule
    piece_cost, margin = _binding.library().schedule_model()
    keys = _keys() if path == "rows64" else _st_keys("bf16")
    keys = [k for k in keys if (k[0] <= 32) == (path == "transposed")]
    if not keys:
        pytest.skip(f"no bf16 split variant of the {path} path in this build")
    heads, page = keys[0]
    rng = random.Random(seed)
    batch = int(seed) if isinstance(seed, str) else rng.choice([2, 5, 32, 200])
    lens = [rng.choice([0, 1, 64, 65, rng.randrange(0, 20000), -3, 30000]) for _ in range(batch)]
    max_keys = 20000
    plan = MLADecodePlan(batch, heads, page, max_seq_len=max_keys, balanced=True)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert plan.schedule(seq_lens, max_seq_len=max_keys, overhead_tiles=3)
    plan._schedules[batch].fill_(-7)  # so that every value compared below is one the kernel wrote
    assert plan.schedule(seq_lens, max_seq_len=max_keys, overhead_tiles=3)
    assert plan._sched_segments == (path == "transposed")
    splits = default_num_kv_splits(batch, heads, 1, max_keys, sm_count(plan.device.index), page_size=page)
    got = plan._schedules[batch].cpu().tolist()
    kind = got[_binding.library().cdll.mla_variants_schedule_kind_offset(batch, plan.sched_ctas)]
    ref = reference_schedule(lens, max_keys, plan.sched_ctas, 3, splits, kind, piece_cost=piece_cost,
                             balanced_margin=margin, segment_table=plan._sched_segments)
    g = plan.sched_ctas
    assert [tuple(got[2 * c:2 * c + 2]) for c in range(g + 1)] == ref["bounds"]
    assert [tuple(got[2 * (g + 1) + 4 * b:2 * (g + 1) + 4 * b + 4]) for b in range(batch)] == ref["requests"]
    shared_at = _binding.library().cdll.mla_variants_schedule_kind_offset(batch, g) + 1
    assert got[shared_at:shared_at + 1 + got[shared_at]] == [len(ref["shared"])] + ref["shared"]
    seg_at = shared_at + 1 + g  # schedule.cuh: the segment table follows the combine's list
    assert got[seg_at] == len(ref["segments"])
    assert [tuple(got[seg_at + 1 + 2 * k:seg_at + 3 + 2 * k]) for k in range(got[seg_at])] == ref["segments"]
    bal, uni = ref["prices"]
    if abs(bal - margin * uni) > 1e-3 * uni:
        assert kind == int(not bal < margin * uni)
    assert plan.scheduled_cut() == ("uniform" if kind else "balanced")
    assert plan.scheduled_step() == (batch, plan.scheduled_cut(), g, 0, path == "transposed")


def _st_keys(dtype):
    """(heads, page) of the build's transposed split variants of this dtype (at most 32 heads)."""
    lib = _binding.library()
    return sorted({(k[0], k[1]) for k in lib.table if k[2] == dtype and k[3] and k[0] <= 32
                   and lib.facts[k].balanced_schedule}, key=lambda k: (k[1] not in (1, 64), k))


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_transposed_balanced_plans_match_reference(dtype, q_len):
    """The transposed path (at most 32 heads) on the balanced schedule, one CTA per segment: the ragged
    mix, zero and one-key requests, one request longer than the rest together, and more segments than
    the GPU has SMs; exact and fp8 caches; q_len 1-4 where the launch's rows stay transposed."""
    from mla_variants.fp8 import FP8_DTYPE
    from mla_variants.testing import FP8_TOLERANCE
    keys = _st_keys(dtype)
    if not keys:
        pytest.skip(f"no transposed {dtype} split variant in this build")
    lib = _binding.library()
    gen = torch.Generator().manual_seed(17)
    ran = 0
    for heads, page in keys[:4]:
        for lens in (LENGTHS["ragged"] + LENGTHS["zeros_ones_long"], LENGTHS["many_short"]):
            fp8 = dtype == "fp8_e4m3"
            plan = MLADecodePlan(len(lens), heads, page, q_len=q_len, max_seq_len=max(lens), balanced=True,
                                 kv_dtype=FP8_DTYPE if fp8 else None)
            assert plan.balanced == lib.facts[(heads, page, dtype, True)].balances(heads * q_len)
            if not plan.balanced:
                continue
            case = make_paged_case(lens, heads, page, q_len=q_len, generator=gen, k_scale=0.0625 if fp8 else None,
                                   **({"dtype": FP8_DTYPE} if fp8 else {}))
            kw = {"k_scale": case.k_scale} if fp8 else {}
            b, ql, h = case.q.shape[:3]
            out = torch.full((b, ql, h, 512), float("nan"), dtype=case.q.dtype, device="cuda")
            lse = torch.full((b, h, ql), float("nan"), device="cuda")
            assert plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page)
            plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse, **kw)
            torch.cuda.synchronize()
            ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                    case.softmax_scale, **kw)
            problems = compare(out, lse, ref_out, ref_lse, **(FP8_TOLERANCE if fp8 else {}))
            assert not problems, f"h{heads} p{page} {dtype} q_len {q_len} batch {len(lens)}: {problems}"
            ran += 1
    if not ran:
        pytest.skip(f"no transposed {dtype} variant balances {q_len} query tokens a request")


def test_one_request_keeps_the_uniform_split():
    """schedule() for one request runs no kernel: run and a bound step take the uniform split (the plan's
    split count for one request), bit for bit mla_decode's with that count; scheduled_cut and scheduled_step say so."""
    from mla_variants import mla_decode
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    for heads, page in [_keys(1)[0]] + _st_keys("bf16")[:1]:
        case = make_paged_case([5000], heads, page, generator=torch.Generator().manual_seed(21))
        plan = MLADecodePlan(8, heads, page, max_seq_len=8192, balanced=True)
        assert plan.schedule(case.seq_lens) and plan.scheduled_cut() == "uniform"
        assert plan._schedules[1] is None
        assert plan.scheduled_step() == (1, "uniform", 0, plan._one_request_splits, False)
        out, lse = plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                            out=torch.full((1, 1, heads, 512), float("nan"), dtype=case.q.dtype, device="cuda"),
                            lse=torch.full((1, heads, 1), float("nan"), device="cuda"))
        want_out, want_lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                        num_kv_splits=plan._one_request_splits, max_seq_len=8192)
        assert plan._one_request_splits > 1
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"h{heads} p{page}"
        step = plan.bind(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                         out=torch.full_like(out, float("nan")), lse=torch.full_like(lse, float("nan")))
        bound_out, bound_lse = step()
        assert torch.equal(bound_out, want_out) and torch.equal(bound_lse, want_lse), f"h{heads} p{page} bound"
        with pytest.raises(MLAInputError, match="seq_lens: expected the batch of the last"):
            two = make_paged_case([10, 20], heads, page)
            plan.run(two.q, two.kv_cache, two.block_table, two.seq_lens, two.softmax_scale,
                     out=torch.empty(2, 1, heads, 512, dtype=two.q.dtype, device="cuda"),
                     lse=torch.empty(2, heads, 1, device="cuda"))


def test_bound_step_follows_the_schedule():
    """bind() before schedule(): the bound step runs the uniform split, then the schedule once one exists;
    a schedule for another batch is refused by name."""
    if not _keys():
        pytest.skip("no bf16 split variant in this build")
    heads, page = _keys(1)[0]
    lens = LENGTHS["ragged"]
    case = make_paged_case(lens, heads, page, generator=torch.Generator().manual_seed(21))
    plan = MLADecodePlan(len(lens), heads, page, max_seq_len=max(lens), balanced=True)
    out = torch.full((len(lens), 1, heads, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    lse = torch.full((len(lens), heads, 1), float("nan"), device="cuda")
    step = plan.bind(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    ref_out, ref_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    step()
    torch.cuda.synchronize()
    assert not compare(out, lse, ref_out, ref_lse)
    assert plan.schedule(case.seq_lens, max_seq_len=case.block_table.shape[1] * page)
    out.fill_(float("nan"))
    step()
    torch.cuda.synchronize()
    assert not compare(out, lse, ref_out, ref_lse)
    assert plan.schedule(case.seq_lens[:3].contiguous())
    with pytest.raises(MLAInputError, match="seq_lens: expected the batch of the last MLADecodePlan.schedule"):
        step()
