"""Random paged decode problems for tests, benchmarks and examples.

A case scatters each request's tokens over randomly permuted pages of one pool, fills every slot past
seq_len, every unused page and every block_table entry past a request's last page with junk (NaN
values in the cache, -1/huge ids in the table), so a kernel that reads what it must not shows it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_DIM = 576


@dataclass
class PagedCase:
    q: torch.Tensor            # [batch, q_len, num_heads, 576]
    kv_cache: torch.Tensor     # [num_pages, page_size, 576]
    block_table: torch.Tensor  # [batch, max_pages] int32
    seq_lens: torch.Tensor     # [batch] int32
    softmax_scale: float
    k_scale: float | None = None  # set for a float8_e4m3fn cache: stored value x k_scale = real value


#: compare() bounds for an fp8 (e4m3) cache against the fp32 reference on the dequantized cache (issue 5)
FP8_TOLERANCE = dict(atol=1e-2, rtol=6.25e-2, cos_tol=1e-4, lse_atol=1e-3, lse_rtol=1e-4, rel_l2_tol=6.25e-2)
#: compare() bounds for fp8_mode="fast" (fp8_e4m3_fast variants): q is rounded to e4m3 per row (3 mantissa
#: bits, a relative error up to 2^-4 per value) and P to e4m3, so scores and lse move by up to a few 1e-3
#: on short requests, where the rounding errors of few keys do not average out. Measured on the lab
#: launcher (docs/design.md 3.3): out 1.1-1.4e-3, lse 1.1-1.7e-3 on 1-129 keys, 0.9-2.2e-4 on the
#: benchmark's inputs. Out's element and L2 bounds are the exact mode's, its cosine bound 1e-3 (exact:
#: 1e-4); lse's bounds leave about 3x room over those measurements.
FP8_FAST_TOLERANCE = dict(atol=1e-2, rtol=6.25e-2, cos_tol=1e-3, lse_atol=5e-3, lse_rtol=1e-3, rel_l2_tol=6.25e-2)


def make_paged_case(seq_lens: list[int], num_heads: int, page_size: int, q_len: int = 1,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                    q_std: float = 0.1, kv_std: float = 0.1, extra_pages: int = 3, poison: bool = True,
                    softmax_scale: float = (128 + 64) ** -0.5, generator: torch.Generator | None = None,
                    max_pages: int | None = None, k_scale: float | None = None, kv_mean: float = 0.0) -> PagedCase:
    """Build a random case. Pages are a random permutation of the pool (plus `extra_pages` unused ones);
    with `poison`, unused slots are NaN and unused table entries junk.

    dtype float8_e4m3fn makes an fp8 cache written the way engines write it (real N(kv_mean, kv_std^2)
    values quantized with `k_scale`, default 1.0; q stays bf16) and poisons unused slots with the e4m3 NaN
    byte. The cache's values are N(kv_mean, kv_std^2) for every dtype (a nonzero mean: values that share a
    sign, as a normalised latent's channels may).

    Raises ValueError for sizes below 1 or negative seq_lens, RuntimeError for a CUDA device when torch
    sees no GPU (pass device="cpu")."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"make_paged_case: device={str(device)!r} needs a CUDA GPU and this torch sees none "
                           "(torch.cuda.is_available() is False); pass device='cpu' to build the case on the CPU, "
                           "where mla_decode_reference runs")
    fp8 = dtype == torch.float8_e4m3fn
    if fp8:
        from .fp8 import FP8_NAN_BYTE, quantize_kv
        k_scale = 1.0 if k_scale is None else k_scale
    if page_size < 1 or num_heads < 1 or q_len < 1 or any(n < 0 for n in seq_lens):
        raise ValueError(f"make_paged_case: expected page_size, num_heads, q_len >= 1 and seq_lens >= 0, got "
                         f"page_size={page_size}, num_heads={num_heads}, q_len={q_len}, seq_lens={seq_lens}")
    g = generator
    batch = len(seq_lens)
    pages_per = [(n + page_size - 1) // page_size for n in seq_lens]
    width = max(max_pages or 0, max(pages_per, default=0), 1)
    num_pages = max(1, sum(pages_per) + extra_pages)
    real = torch.randn(num_pages, page_size, HEAD_DIM, generator=g, device="cpu") * kv_std + kv_mean
    kv = quantize_kv(real, k_scale) if fp8 else real.to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((batch, width), -1 if poison else 0, dtype=torch.int32)
    if poison:  # junk after the used entries: some -1, some far out of range
        junk = torch.randint(num_pages, 2**31 - 1, (batch, width), generator=g, dtype=torch.int64).to(torch.int32)
        table = torch.where(torch.rand(batch, width, generator=g) < 0.5, table, junk)
        kv_used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    start = 0
    for b, n in enumerate(pages_per):
        ids = perm[start:start + n]
        table[b, :n] = ids.to(torch.int32)
        start += n
        if poison:
            for j, pid in enumerate(ids.tolist()):
                kv_used[pid, : min(page_size, seq_lens[b] - j * page_size)] = True
    if poison:
        if fp8:
            kv.view(torch.uint8)[~kv_used] = FP8_NAN_BYTE
        else:
            kv[~kv_used] = float("nan")
    q_dtype = torch.bfloat16 if fp8 else dtype
    q = (torch.randn(batch, q_len, num_heads, HEAD_DIM, generator=g, device="cpu") * q_std).to(q_dtype)
    return PagedCase(q.to(device), kv.to(device), table.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), softmax_scale,
                     k_scale if fp8 else None)


def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
            atol: float = 1e-3, rtol: float = 1.6e-2, cos_tol: float = 1e-5, lse_atol: float = 1e-4,
            lse_rtol: float = 1e-4, elementwise: bool = True, rel_l2_tol: float = 1e-2) -> list[str]:
    """Problems found comparing a result with the fp32 reference (empty list = pass).

    out: every element within atol or rtol (when `elementwise`), 1 - cos(out, ref) < cos_tol (or < twice
    the cosine difference that rounding ref to out's dtype costs, where that is larger), and
    ||out - ref|| / ||ref|| < rel_l2_tol (catches a wrong scale, which cosine cannot);
    lse: |lse - ref| <= lse_atol + lse_rtol * |ref|, with -inf exactly where the reference has it."""
    problems = []
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return [f"shapes differ: out {tuple(out.shape)} vs {tuple(ref_out.shape)}, lse {tuple(lse.shape)} vs {tuple(ref_lse.shape)}"]
    if out.numel() == 0:
        return problems
    o, r = out.float(), ref_out.float()
    if not torch.isfinite(o).all():
        problems.append(f"out has {(~torch.isfinite(o)).sum().item()} non-finite values")
        return problems
    if elementwise:
        err = (o - r).abs()
        bad = (err > atol) & (err > rtol * r.abs())
        if bad.any():
            problems.append(f"out: {bad.sum().item()} elements outside atol {atol} / rtol {rtol}; max abs err {err.max().item():.3e}")
    denom = o.norm() * r.norm()
    if denom > 0:
        cos_diff = 1 - (o * r).sum().item() / denom.item()
        # Rounding the exact answer to out's dtype alone costs this much cosine; a 16-bit out may sit at
        # twice that (the kernel rounds P to 16 bits as well) when it exceeds cos_tol.
        rounded = ref_out.to(out.dtype).float() if out.dtype != torch.float32 else r
        floor = 1 - (rounded * r).sum().item() / max((rounded.norm() * r.norm()).item(), 1e-30)
        tol = max(cos_tol, 2 * floor)
        if cos_diff >= tol:
            problems.append(f"out: cosine difference {cos_diff:.3e} >= {tol:.3e}")
        rel = ((o - r).norm() / r.norm()).item()
        if rel >= rel_l2_tol:
            problems.append(f"out: relative L2 error {rel:.3e} >= {rel_l2_tol}")
    elif o.abs().max() > 0:
        problems.append("out: nonzero where the reference is all zero")
    l, rl = lse.float(), ref_lse.float()
    ninf = torch.isneginf(rl)
    if not torch.equal(torch.isneginf(l), ninf):
        problems.append(f"lse: -inf pattern differs ({torch.isneginf(l).sum().item()} vs {ninf.sum().item()} -inf)")
    fin = ~ninf
    if fin.any():
        if not torch.isfinite(l[fin]).all():
            problems.append("lse: non-finite where the reference is finite")
        else:
            e = (l[fin] - rl[fin]).abs()
            if (e > lse_atol + lse_rtol * rl[fin].abs()).any():
                problems.append(f"lse: max abs err {e.max().item():.3e} beyond {lse_atol} + {lse_rtol}*|ref|")
    return problems


def run_nan_prefilled(case: PagedCase, num_kv_splits: int | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode on `case` into out / lse buffers prefilled with NaN (so a row the kernel forgets to
    write cannot pass), then a device synchronization. Extra keyword arguments go to mla_decode (e.g.
    k_scale=...; an fp8 case's own k_scale is passed unless one is given). Returns (out [batch, q_len,
    num_heads, 512] in q's dtype, lse [batch, num_heads, q_len])."""
    from .api import mla_decode
    if case.k_scale is not None:
        kwargs.setdefault("k_scale", case.k_scale)
    batch, q_len, num_heads = case.q.shape[:3]
    out = torch.full((batch, q_len, num_heads, 512), float("nan"), dtype=case.q.dtype, device=case.q.device)
    lse = torch.full((batch, num_heads, q_len), float("nan"), dtype=torch.float32, device=case.q.device)
    out, lse = mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                          num_kv_splits=num_kv_splits, out=out, lse=lse, **kwargs)
    torch.cuda.synchronize(case.q.device)
    return out, lse


def capture_graph(step) -> "torch.cuda.CUDAGraph":
    """Run `step()` once on a side stream (the warm-up PyTorch's CUDA-graph docs ask for), then capture
    one call of it into a CUDA graph and return the graph (replay it with ``graph.replay()``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_steps(graph: "torch.cuda.CUDAGraph", seq_lens: torch.Tensor, steps: list[list[int]], out: torch.Tensor,
                 lse: torch.Tensor, reference, **tolerance) -> None:
    """Replay a captured decode step once per entry of `steps` (each a list of seq_lens, int, one per
    request), with `seq_lens` (the int32 device tensor the graph reads) set to it and `out` prefilled
    with NaN; after each replay, compare out / lse with `reference()` (returning the fp32 reference's
    (out, lse) for the current seq_lens) under compare()'s `tolerance`. Raises AssertionError naming the
    step whose result is off."""
    for new in steps:
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        problems = compare(out, lse, *reference(), **tolerance)
        assert not problems, f"seq_lens {new}: {problems}"


def as_token_pages(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache memory seen as page_size 1: ([num_pages * page_size, 1, 576] view, token-level
    block_table [batch, max_pages * page_size] int32). Used to time a page-P variant against the
    page-1 (per-token gather) variant on identical bytes. Needs a cache whose pages are contiguous."""
    num_pages, page_size, dim = kv_cache.shape
    if kv_cache.stride(0) != page_size * kv_cache.stride(1):
        raise ValueError("kv_cache: as_token_pages needs pages laid out back to back (stride(0) == page_size * stride(1))")
    tokens = kv_cache.as_strided((num_pages * page_size, 1, dim), (kv_cache.stride(1), kv_cache.stride(1), kv_cache.stride(2)))
    offs = torch.arange(page_size, device=block_table.device, dtype=torch.int64)
    table = (block_table.long().clamp_min(0)[:, :, None] * page_size + offs).reshape(block_table.shape[0], -1)
    return tokens, table.to(torch.int32)


def _tiles(n: int) -> int:
    return -(-n // 64)


def _segments(bounds, tiles, c):
    """CTA c's segments (request, first tile, end tile), as the decode kernel walks them."""
    b, t = bounds[c]
    end_b, end_t = bounds[c + 1]
    while b < end_b or (b == end_b and t < end_t):
        yield b, t, end_t if b == end_b else tiles[b]
        b, t = b + 1, 0


#: schedule.cuh kSegmentSortItems x kScheduleThreads: the longest segment table the schedule kernel sorts
SEGMENT_SORT_MAX = 8 * 512


def reference_schedule(seq_lens: list[int], max_keys: int, ctas: int, overhead: int, uniform_splits: int,
                       kind: int | None = None, *, piece_cost: float, balanced_margin: float,
                       segment_table: bool = True) -> dict:
    """What the schedule kernel (templates/mla/schedule.cu) writes, computed in Python: {"bounds": [(request,
    tile)] * (ctas + 1), "requests": [(tiles, first_cta, first_piece, pieces)] * batch, "kind": 0 balanced /
    1 uniform-equivalent, "prices": (balanced, uniform) in tiles, "shared": the requests of several pieces,
    in order (the combine's list), "segments": every (request, CTA) segment, the transposed path's CTAs:
    by cost class (256 classes of the kept cut's busiest CTA), costliest first, request order within a
    class; in request order when there are more than SEGMENT_SORT_MAX, 2**20 requests or more, or more than
    4096 CTAs; none without segment_table (a plan whose launch walks runs: PathFacts.runs_segments)}.
    piece_cost and balanced_margin: the kernel's cost model (a loaded library's Library.schedule_model()).
    `kind` forces the cut (the kernel prices in fp32 and may fuse a multiply-add, so a near-tie can go
    either way). The GPU test compares the kernel's buffer with it; CPU tests check its invariants."""
    batch = len(seq_lens)
    tiles = [0 if n < 0 or n > max_keys else _tiles(n) for n in seq_lens]
    cost, acc = [], 0
    for t in tiles:
        cost.append(acc)
        acc += t + overhead
    total, per_cta = acc, max(1, -(-acc // ctas))
    balanced = []
    for c in range(ctas + 1):
        x = c * per_cta
        if c == ctas or x >= total:
            balanced.append((batch, 0))
            continue
        b = max(i for i in range(batch) if cost[i] <= x)
        balanced.append((b, max(0, x - cost[b] - overhead)))
    s = uniform_splits
    k = -(-batch * s // ctas)
    uniform = []
    for c in range(ctas + 1):
        j = c * k
        if c == ctas or j >= batch * s:
            uniform.append((batch, 0))
            continue
        b, split = divmod(j, s)
        t = split * -(-tiles[b] // s)
        uniform.append((b + 1, 0) if split > 0 and t >= tiles[b] else (b, t))

    def busiest_and_pieces(bounds):
        work, pieces = 0, 0
        for c in range(ctas):
            w = 0
            for b, t0, t1 in _segments(bounds, tiles, c):
                w += t1 - t0 + overhead
                pieces += not (t0 == 0 and t1 == tiles[b])
            work = max(work, w)
        return work, pieces

    (bal_work, bal_pieces), (uni_work, uni_pieces) = busiest_and_pieces(balanced), busiest_and_pieces(uniform)
    prices = (bal_work + piece_cost * bal_pieces, uni_work + piece_cost * uni_pieces)
    if kind is None:
        kind = int(not prices[0] < balanced_margin * prices[1])
    bounds = uniform if kind else balanced
    busiest = uni_work if kind else bal_work

    def last_cta_at(b, t):
        return max(c for c in range(ctas) if bounds[c] <= (b, t))

    requests, first_piece = [], 0
    for b in range(batch):
        first = last_cta_at(b, 0)
        last = last_cta_at(b, tiles[b] - 1) if tiles[b] else first
        requests.append((tiles[b], first, first_piece, last - first + 1))
        first_piece += last - first + 1
    shared = [b for b in range(batch) if requests[b][3] > 1]
    segments, cost_class = [], {}
    for b, (n, first, _, pieces) in enumerate(requests if segment_table else []):
        for c in range(first, first + pieces):
            t0 = bounds[c][1] if bounds[c][0] == b else 0
            t1 = bounds[c + 1][1] if bounds[c + 1][0] == b else n
            segments.append((b, c))
            cost_class[b, c] = (t1 - t0 + overhead) * 256 // (busiest + 1)
    if len(segments) <= SEGMENT_SORT_MAX and batch < 1 << 20 and ctas <= 4096:  # costliest class first (stable)
        segments.sort(key=lambda s: -cost_class[s])
    return {"bounds": bounds, "requests": requests, "kind": kind, "prices": prices, "shared": shared,
            "segments": segments}
