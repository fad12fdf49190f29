"""Serving contract on the GPU: plan/run, CUDA graphs, torch.compile, 64-bit offsets, numerics under
splits, invalid lengths, concurrency (skipped without an sm_90 GPU)."""
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_variants import MLADecodePlan, MLAInputError, mla_decode, mla_decode_reference, workspace_size  # noqa: E402
from mla_variants.testing import capture_graph, compare, make_paged_case  # noqa: E402


def _ref(case):
    return mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)


def test_cuda_graph_replay_tracks_growing_lengths_and_shrinking_batch():
    """Capture once at batch 8, replay 100 steps: lengths grow by one per step (one request crosses
    32k), the real batch shrinks (padded rows get seq_len 0); compare to eager at every step, then
    replay on another stream."""
    g = torch.Generator().manual_seed(5)
    page, max_len = 16, 32900
    start = [32790, 5, 900, 64, 1, 17, 3000, 250]
    case = make_paged_case([max_len] * 8, 16, page, 1, generator=g, poison=False)
    seq_lens = torch.tensor(start, dtype=torch.int32, device="cuda")
    plan = MLADecodePlan(8, 16, page, max_seq_len=max_len, num_kv_splits=4)
    out = torch.empty(8, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(8, 16, 1, device="cuda")
    graph = capture_graph(lambda: plan.run(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale,
                                           out=out, lse=lse))
    lens = list(start)
    for step in range(100):
        lens = [n + 1 if n else 0 for n in lens]
        if step % 20 == 19:  # a request finishes: its row becomes padding
            lens[7 - step // 20] = 0
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.q.normal_(0, 0.1)
        replay_stream = torch.cuda.Stream() if step == 99 else torch.cuda.current_stream()
        replay_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(replay_stream):
            graph.replay()
        torch.cuda.current_stream().wait_stream(replay_stream)
        eager_out, eager_lse = mla_decode(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale, num_kv_splits=4)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out) and torch.equal(lse.nan_to_num(), eager_lse.nan_to_num()), f"step {step}"
        pad = torch.tensor(lens, device="cuda") == 0
        assert (out[pad] == 0).all() and torch.isneginf(lse[pad]).all()
    assert max(lens) > 32768
    ref_out, ref_lse = _ref(case.__class__(case.q, case.kv_cache, case.block_table, seq_lens, case.softmax_scale))
    assert not compare(out, lse, ref_out, ref_lse)


def test_plan_run_allocates_nothing_and_checks_its_contract():
    case = make_paged_case([300, 0, 1000], 32, 64, 2, generator=torch.Generator().manual_seed(1))
    plan = MLADecodePlan(4, 32, 64, q_len=2, max_seq_len=1024)
    out = torch.full((3, 2, 32, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, 32, 2, device="cuda")
    plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert not compare(out, lse, *_ref(case))
    with pytest.raises(MLAInputError, match="MLADecodePlan.run allocates nothing"):
        plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=None, lse=lse)
    with pytest.raises(MLAInputError, match="this plan's"):
        MLADecodePlan(4, 16, 64, q_len=2).run(case.q, case.kv_cache, case.block_table, case.seq_lens, 0.1, out=out, lse=lse)
    with pytest.raises(MLAInputError, match="max_batch=2"):
        MLADecodePlan(2, 32, 64, q_len=2).run(case.q, case.kv_cache, case.block_table, case.seq_lens, 0.1, out=out, lse=lse)
    with pytest.raises(MLAInputError, match="workspace: expected a contiguous, 16-byte aligned tensor of at least"):
        MLADecodePlan(4, 32, 64, q_len=2, num_kv_splits=8, workspace=torch.empty(100, dtype=torch.uint8, device="cuda"))


def test_bound_step_matches_run_and_replays_in_a_graph():
    case = make_paged_case([700, 0, 2100, 65], 128 + 16, 16, 2, generator=torch.Generator().manual_seed(21))
    plan = MLADecodePlan(4, 144, 16, q_len=2, num_kv_splits=3)   # two head groups, split variant
    out = torch.empty(4, 2, 144, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 144, 2, device="cuda")
    step = plan.bind(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=out, lse=lse)
    got_out, got_lse = step()
    ref_out, ref_lse = _ref(case)
    assert got_out.data_ptr() == out.data_ptr() and not compare(out, lse, ref_out, ref_lse)
    run_out, run_lse = out.clone(), lse.clone()
    plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, out=run_out, lse=run_lse)
    torch.cuda.synchronize()
    assert torch.equal(run_out, out) and torch.equal(run_lse, lse)
    graph = capture_graph(step)
    case.seq_lens.copy_(torch.tensor([650, 0, 2000, 64], dtype=torch.int32))  # shorter: only written slots
    case.q.normal_(0, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert not compare(out, lse, *_ref(case))


def test_workspace_too_small_and_caller_workspace():
    case = make_paged_case([500, 70], 16, 64, 1, generator=torch.Generator().manual_seed(2))
    need = workspace_size(2, 16, 1, 3)
    with pytest.raises(MLAInputError, match=f"at least {need} bytes"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, 0.1, num_kv_splits=3,
                   workspace=torch.empty(need - 1, dtype=torch.uint8, device="cuda"))
    ws = torch.empty(need // 4, dtype=torch.float32, device="cuda")
    out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=3, workspace=ws)
    assert not compare(out, lse, *_ref(case))


def test_torch_compile_fullgraph_and_opcheck():
    import mla_variants.ops  # noqa: F401

    case = make_paged_case([200, 1, 3000], 16, 64, 2, generator=torch.Generator().manual_seed(3))

    class Attn(torch.nn.Module):
        def forward(self, q, kv, bt, sl):
            out, lse = torch.ops.mla_variants.mla_decode(q[..., :512], q[..., 512:], kv, bt, sl, case.softmax_scale, 0)
            return out * 2, lse

    compiled = torch.compile(Attn(), fullgraph=True)
    out, lse = compiled(case.q, case.kv_cache, case.block_table, case.seq_lens)
    ref_out, ref_lse = _ref(case)
    assert not compare(out / 2, lse, ref_out, ref_lse)
    args = (case.q[..., :512], case.q[..., 512:], case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, 3)
    torch.library.opcheck(torch.ops.mla_variants.mla_decode.default, args)
    out2 = torch.empty(3, 2, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse2 = torch.empty(3, 16, 2, device="cuda")
    torch.library.opcheck(torch.ops.mla_variants.mla_decode_out.default, args + (out2, lse2))
    torch.ops.mla_variants.mla_decode_out(*args, out2, lse2)
    assert not compare(out2, lse2, ref_out, ref_lse)


@pytest.mark.parametrize("page", [1, 64])
def test_64bit_offsets_with_a_pool_over_8gb(page):
    """Pages near the top of a 9 GB pool: every product page * stride passes 2^31 elements."""
    tokens = 9 * 2**30 // (576 * 2)
    num_pages = tokens // page
    pool = torch.empty(num_pages, page, 576, dtype=torch.bfloat16, device="cuda")
    lens = [3 * page + 5, 1, 40]
    need = [(n + page - 1) // page for n in lens]
    ids = torch.arange(num_pages - sum(need), num_pages, dtype=torch.int32)[torch.randperm(sum(need))]
    table = torch.full((3, max(need)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[k:k + n]
        k += n
    table = table.cuda()
    used = table[table >= 0].long()
    pool[used] = (torch.randn(len(used), page, 576, device="cuda") * 0.1).to(torch.bfloat16)
    q = (torch.randn(3, 1, 16, 576, device="cuda") * 0.1).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert int(used.min()) * page * 576 > 2**31
    for n in (1, 2):
        out, lse = mla_decode(q, pool, table, seq_lens, 0.1, num_kv_splits=n)
        ref = mla_decode_reference(q, pool, table, seq_lens, 0.1)
        assert not compare(out, lse, *ref)
    del pool
    torch.cuda.empty_cache()


def test_large_logits_agree_across_split_counts():
    case = make_paged_case([4000, 1, 0, 777], 16, 16, 2, q_std=100.0, softmax_scale=0.7,
                           generator=torch.Generator().manual_seed(4))
    ref_out, ref_lse = _ref(case)
    outs = []
    for n in (1, 2, 3, 7, 16, 64, 256):
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=n)
        assert not compare(out, lse, ref_out, ref_lse, elementwise=False), (n, compare(out, lse, ref_out, ref_lse, elementwise=False))
        outs.append((out.float(), lse))
    for o, l in outs[1:]:
        assert not compare(o, l, *outs[0], elementwise=False)


def test_empty_and_one_token_requests_beside_100k_under_forced_splits():
    case = make_paged_case([0, 1, 100_000, 0, 1, 64], 32, 64, 1, generator=torch.Generator().manual_seed(6))
    ref_out, ref_lse = _ref(case)
    for n in (1, 2, 5, 128, 256):
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, num_kv_splits=n)
        assert not compare(out, lse, ref_out, ref_lse), n
        assert (out[[0, 3]] == 0).all() and torch.isneginf(lse[[0, 3]]).all()


def test_batch_zero_is_a_no_op():
    q = torch.empty(0, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
    out, lse = mla_decode(q, torch.zeros(4, 64, 576, dtype=torch.bfloat16, device="cuda"),
                          torch.zeros(0, 4, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda"), 0.1)
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1)


def test_unaddressable_seq_len_gives_nan_and_debug_raises():
    case = make_paged_case([100, 50], 16, 64, 1, generator=torch.Generator().manual_seed(8))
    bad = case.seq_lens.clone()
    bad[1] = case.block_table.shape[1] * 64 + 1
    for n in (1, 3):
        out, lse = mla_decode(case.q, case.kv_cache, case.block_table, bad, case.softmax_scale, num_kv_splits=n)
        assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all(), n
        ref_out, ref_lse = _ref(case)
        assert not compare(out[:1], lse[:1], ref_out[:1], ref_lse[:1])
    with pytest.raises(MLAInputError, match=r"seq_lens: expected values in \[0, max_pages_per_seq"):
        mla_decode(case.q, case.kv_cache, case.block_table, bad, case.softmax_scale, debug=True)
    table = case.block_table.clone()
    table[0, 0] = case.kv_cache.shape[0] + 5
    with pytest.raises(MLAInputError, match=r"block_table: expected page ids in \[0, num_pages"):
        mla_decode(case.q, case.kv_cache, table, case.seq_lens, case.softmax_scale, debug=True)


def test_two_threads_two_streams_match_serial():
    cases = [make_paged_case([900, 30, 2500], 16, 16, 1, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    serial = [mla_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, c.softmax_scale, num_kv_splits=3) for c in cases]
    torch.cuda.synchronize()
    results, errors = [None, None], []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            plan = MLADecodePlan(3, 16, 16, num_kv_splits=3)
            c = cases[i]
            out = torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(3, 16, 1, device="cuda")
            with torch.cuda.stream(stream):
                for _ in range(50):
                    plan.run(c.q, c.kv_cache, c.block_table, c.seq_lens, c.softmax_scale, out=out, lse=lse)
            stream.synchronize()
            results[i] = (out, lse)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (o, l), (so, sl) in zip(results, serial):
        assert torch.equal(o, so) and torch.equal(l, sl)
