"""The TMA path: kernels that load full 64-token tiles by TMA (skipped without an sm_90 GPU, or when the
build has no such variant). Which kernels those are comes from the loaded build's path facts
(mla_variants._binding.library().facts[(num_heads, page_size, dtype, split)]): `tma` says the variant's
own kernel loads full tiles by TMA (the 64-row kernel, more than 32 heads, of a page size that is a
multiple of 64: bf16/fp16, fp8_e4m3 over the cache's raw bytes, before the copy warps widen them, and
fp8_e4m3_fast, whose fp8 kernel reads the swizzled raw bytes as they land: those cases call
fp8_mode="fast"),
`second_tma` that its second kernel does (the 64-row kernel that 17..32-head bf16/fp16 variants run for
short splits).

The tile holding a request's or split's end keeps cp.async with zero fill, and so does the fp8
short-split kernel (second_kernel "short_split": a launch whose every split has at most
facts.second_max_split_keys keys), so the fp8 cases here keep their splits long.
The TMA mode is a per-call argument of mla_decode (run_nan_prefilled passes it on): tma="off" sends
every tile through cp.async, tma="require" makes a launch whose tensor map cannot be encoded fail
(RuntimeError, CUDA error 801) instead of falling back, and the default ("auto") uses TMA where the map
can be encoded. So the TMA-vs-cp.async comparisons run the same inputs in this process under two modes
and compare the outputs bit for bit: both paths put the same bytes in shared memory and the math is the
same, so out and lse must be identical.

- test_tma_variant_against_reference: every compiled variant whose own kernel loads by TMA, with
  tma="require" (so the TMA path surely ran; the transposed path of smaller head counts gathers with
  cp.async) on seq_lens {0, 1, 63, 64, 65, 127, 128, 129, 65536, 65537, 65599} in one batch, q_len 1
  and 2, forced splits, NaN-prefilled outputs, against the fp32 reference (for fp8: on the dequantized
  cache, k_scale 0.0625, within mla_variants.testing.FP8_TOLERANCE, fast variants FP8_FAST_TOLERANCE).
- test_tma_bitwise_equals_cp_async: tma="require" vs tma="off", every TMA page size, split and not.
- test_negative_page_id_in_a_full_tile: block_table entries of -1 inside a request's range (full
  tiles): cp.async zero-fills them, TMA reads an out-of-bounds box as zeros; both must agree bitwise
  and match the reference on a cache where those entries name an all-zero page.
- test_require_* (16-bit caches): tma="require" encodes an ordinary cache, and refuses (CUDA error 801)
  the legal caches TMA cannot address (stride-0 pages or tokens, a one-page cache with an odd page
  stride), which the default mode serves correctly through cp.async.
- test_require_refuses_an_fp8_cache_tma_cannot_address: the same refusal for the fp8 64-token kernel's
  byte map and the fast kernel's swizzled one (proof that each fp8 launch encodes one), and the
  cp.async fallback right.
- test_require_shows_which_kernel_a_17_to_32_head_launch_runs: the same refusal for the 64-row kernel
  of a 17..32-head variant (short splits), none for its transposed kernel (long splits).
"""
import functools
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # also skip when run outside the repo's conftest
    pytest.skip("no CUDA GPU on this machine (GPU tests run on an sm_90 device)", allow_module_level=True)

from mla_variants import LibraryNotBuiltError, _binding, mla_decode_reference  # noqa: E402
from mla_variants.testing import FP8_FAST_TOLERANCE, FP8_TOLERANCE, PagedCase, compare, make_paged_case, \
    run_nan_prefilled  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
      "fp8_e4m3_fast": torch.float8_e4m3fn}
FP8 = "fp8_e4m3"
FP8_FAST = "fp8_e4m3_fast"
FP8S = (FP8, FP8_FAST)
FP8_K_SCALE = 0.0625  # stored value x k_scale = real value: far from 1, so a scale applied twice or not at all fails
NOT_SUPPORTED = "CUDA error 801"  # cudaErrorNotSupported: what tma="require" raises when encoding fails
DEFAULT = None  # a mode: mla_decode called without `tma` (its default, "auto")


def _library():
    try:
        return _binding.library()
    except LibraryNotBuiltError as e:
        pytest.skip(f"kernels not built: {e}", allow_module_level=True)


LIB = _library()


def _facts(key):
    return LIB.facts[key]


def _tma_keys():
    # The variants whose own kernel loads full tiles by TMA (the 64-row kernel on a TMA page size); the
    # transposed kernel of smaller head counts always gathers with cp.async.
    keys = sorted((k for k in LIB.table if k[2] in DT and _facts(k).tma), key=lambda k: (k[1], k[2], k[0], k[3]))
    if not keys:
        pytest.skip("no variant whose own kernel loads full tiles by TMA (the 64-row path, more than 32 heads, "
                    "with a page size that is a multiple of 64) is compiled", allow_module_level=True)
    return keys


KEYS = _tma_keys()
PAGE_DTYPES = sorted({(k[1], k[2]) for k in KEYS})
TMA_PAGES = sorted({k[1] for k in KEYS})


def _key_id(k):
    return f"h{k[0]}_p{k[1]}_{k[2]}_{'split' if k[3] else 'nosplit'}"


def _heads(page, dtype, split=None):
    return sorted({k[0] for k in KEYS if k[1] == page and k[2] == dtype and (split is None or k[3] == split)})


def _splits_of(split: bool):
    return (2, 7, 64) if split else (1,)


def _q_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype in FP8S else DT[dtype]


def _k_scale(dtype: str):
    return FP8_K_SCALE if dtype in FP8S else None


def _tolerance(dtype: str) -> dict:
    return FP8_FAST_TOLERANCE if dtype == FP8_FAST else FP8_TOLERANCE if dtype == FP8 else {}


def _mode(dtype: str) -> dict:
    """mla_decode's keyword that runs a variant of this dtype token (the fast variants' fp8_mode)."""
    return {"fp8_mode": "fast"} if dtype == FP8_FAST else {}


_SEED = {"bf16": 0, "fp16": 1, FP8: 2, FP8_FAST: 3}


def _launch_key(heads: int, page: int, dtype: str, num_kv_splits: int):
    """The variant a call with a compiled head count runs (the dispatch rule): a split call the split
    variant; an unsplit one the nosplit variant if compiled, else the split variant with one split."""
    if num_kv_splits == 1 and (heads, page, dtype, False) in LIB.table:
        return heads, page, dtype, False
    return heads, page, dtype, True


def _max_split_keys(facts, bound: int, num_kv_splits: int) -> int:
    """The most keys one split of a launch can get: whole tiles per split for the bound the launcher
    sees (run_nan_prefilled gives no max_seq_len, so the block table's capacity, max_pages x page_size)."""
    tiles = -(-bound // facts.tile_keys)
    return -(-tiles // num_kv_splits) * facts.tile_keys


def _loads_by_tma(key, bound: int, num_kv_splits: int) -> bool:
    """Whether the kernel this launch runs loads full tiles by TMA: the second kernel when every split
    has at most facts.second_max_split_keys keys, else the variant's own."""
    f = _facts(key)
    return f.second_tma if f.runs_second(bound, num_kv_splits) else f.tma


def _assert_takes_tma(key, bound: int, num_kv_splits: int) -> None:
    """A launch that runs a cp.async-only kernel (e.g. the fp8 short-split kernel, when every split has
    at most facts.second_max_split_keys keys) would compare cp.async with itself: keep such cases out."""
    f = _facts(key)
    assert _loads_by_tma(key, bound, num_kv_splits), (
        f"{_key_id(key)}: a launch with {_max_split_keys(f, bound, num_kv_splits)} keys per split "
        f"(second kernel {f.second_kernel!r} for splits of at most {f.second_max_split_keys} keys) "
        f"would not take the TMA path")


# ------------------------------------------------------------------------------------------------
# Running one case under several TMA modes, in this process

def _run(case: PagedCase, num_kv_splits: int, mode, dtype: str = "bf16"):
    """{"out", "lse"} of run_nan_prefilled under `mode` (DEFAULT: no `tma` argument) for a variant of
    `dtype`, or {"error": "Type: message"} for a launch that fails (a tma="require" refusal), recorded for
    the test to judge."""
    kwargs = {**_mode(dtype), **({} if mode is DEFAULT else {"tma": mode})}
    try:
        out, lse = run_nan_prefilled(case, num_kv_splits, **kwargs)
        return {"out": out, "lse": lse}
    except RuntimeError as e:
        torch.cuda.synchronize()  # a sticky error (a crash, not a refusal) surfaces here
        return {"error": f"{type(e).__name__}: {e}"}


def _runs(case: PagedCase, num_kv_splits: int, modes, dtype: str = "bf16") -> dict:
    return {mode: _run(case, num_kv_splits, mode, dtype) for mode in modes}


def _mode_name(mode) -> str:
    return 'default tma ("auto")' if mode is DEFAULT else f"tma={mode!r}"


def _gpu_case(q, kv, block_table, seq_lens, softmax_scale: float, k_scale=None) -> PagedCase:
    """A case on the GPU: q, block_table and seq_lens copied (contiguous), kv as given (a GPU tensor,
    possibly an expanded or overlapping view)."""
    return PagedCase(q.contiguous().cuda(), kv, block_table.contiguous().cuda(), seq_lens.contiguous().cuda(),
                     float(softmax_scale), None if k_scale is None else float(k_scale))


def _reference(case: PagedCase):
    return mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                k_scale=case.k_scale)


@dataclass
class _Job:
    label: str
    case: PagedCase
    num_kv_splits: int
    ref: tuple
    dtype: str = "bf16"


def _ok(res, what):
    assert "error" not in res, f"{what}: {res['error']}"
    return res["out"], res["lse"]


def _assert_bitwise(a, b, what):
    (oa, la), (ob, lb) = _ok(a, what), _ok(b, what)
    assert oa.shape == ob.shape and la.shape == lb.shape, what
    if not torch.equal(oa, ob):
        diff = oa.float() != ob.float()
        err = (oa.float() - ob.float()).abs().nan_to_num(float("inf"))
        pytest.fail(f"{what}: out differs in {int(diff.sum())} of {diff.numel()} elements "
                    f"(max abs diff {err.max().item():.3e})")
    if not torch.equal(la, lb):
        diff = la != lb
        pytest.fail(f"{what}: lse differs in {int(diff.sum())} of {diff.numel()} rows")


def _assert_matches(res, ref, what, dtype: str = "bf16"):
    out, lse = _ok(res, what)
    problems = compare(out, lse, *ref, **_tolerance(dtype))
    assert not problems, f"{what}: {problems}"


def _assert_refused(res, what):
    err = res.get("error")
    assert err is not None, f"{what}: launched, but its tensor map should be refused"
    assert err.startswith("RuntimeError") and NOT_SUPPORTED in err, f"{what}: {err}"


# ------------------------------------------------------------------------------------------------
# 1. Every TMA variant against the reference, 64K-token requests among short ones

LONG = 64 * 1024
LENS = [LONG, 1, LONG + 1, 63, 64, 0, 65, 127, LONG + 63, 128, 129]


@functools.lru_cache(maxsize=1)  # tests are ordered by (page, dtype): one case alive at a time
def _long_case(page: int, dtype: str):
    """(case with the largest compiled head count and q_len 2, {q_len: reference}). The three long
    requests share their pages (65536 and 65537 use a prefix of 65599's table row: the slots they
    read are all valid), which keeps the cache at ~66K tokens instead of ~197K."""
    heads = max(_heads(page, dtype))
    g = torch.Generator().manual_seed(1000 + page + (dtype == "fp16"))
    short = [n for n in LENS if n < LONG]
    base = make_paged_case([LONG + 63] + short, heads, page, 2, DT[dtype], device="cpu", generator=g,
                           k_scale=_k_scale(dtype))
    rows, short_rows = [], iter(range(1, len(short) + 1))
    for n in LENS:
        if n >= LONG:
            row = base.block_table[0].clone()
            row[(n + page - 1) // page:] = -1  # past this request's pages: junk, never read
        else:
            row = base.block_table[next(short_rows)]
        rows.append(row)
    q = (torch.randn(len(LENS), 2, heads, 576, generator=g) * 0.1).to(_q_dtype(dtype))
    case = PagedCase(q.cuda(), base.kv_cache.cuda(), torch.stack(rows).cuda(),
                     torch.tensor(LENS, dtype=torch.int32).cuda(), base.softmax_scale, base.k_scale)
    refs = {}
    for q_len in (1, 2):
        refs[q_len] = mla_decode_reference(case.q[:, :q_len].contiguous(), case.kv_cache, case.block_table,
                                           case.seq_lens, case.softmax_scale, k_scale=case.k_scale)
    return case, refs


@pytest.mark.parametrize("key", KEYS, ids=_key_id)
def test_tma_variant_against_reference(key):
    heads, page, dtype, split = key
    case, refs = _long_case(page, dtype)
    for q_len in (1, 2):
        sub = PagedCase(case.q[:, :q_len, :heads].contiguous(), case.kv_cache, case.block_table, case.seq_lens,
                        case.softmax_scale, case.k_scale)
        ref_out, ref_lse = refs[q_len]
        ref_out, ref_lse = ref_out[:, :, :heads], ref_lse[:, :heads]
        for n in _splits_of(split):
            _assert_takes_tma(_launch_key(heads, page, dtype, n), case.block_table.shape[1] * page, n)
            # "require": a contiguous cache must be encoded, so this is the TMA path for sure
            out, lse = run_nan_prefilled(sub, n, tma="require", **_mode(dtype))
            problems = compare(out, lse, ref_out, ref_lse, **_tolerance(dtype))
            assert not problems, f"{_key_id(key)} q_len={q_len} num_kv_splits={n} seq_lens={LENS}: {problems}"


# ------------------------------------------------------------------------------------------------
# 3. TMA (tma="require") and cp.async (tma="off") give the same bits

def test_tma_bitwise_equals_cp_async():
    for page, dtype in PAGE_DTYPES:
        g = torch.Generator().manual_seed(2000 + page + _SEED[dtype])
        lens = [0, 1, 63, 64, 65, 127, 128, 129, 2 * page + 64, 4097, 4160]  # 4160: 65 full tiles
        heads_all = _heads(page, dtype)
        case = make_paged_case(lens, max(heads_all), page, 2, DT[dtype], device="cpu", generator=g,
                               k_scale=_k_scale(dtype))
        kv = case.kv_cache.cuda()
        name = f"p{page}_{dtype}"
        for split in (False, True):
            hs = _heads(page, dtype, split)
            for heads in sorted({hs[0], hs[-1]}) if hs else ():
                for q_len in (1, 2):
                    sub = _gpu_case(case.q[:, :q_len, :heads], kv, case.block_table, case.seq_lens,
                                    case.softmax_scale, case.k_scale)
                    ref = _reference(sub)
                    # fp8: 64 splits of 4160 keys would be short (the short-split kernel, no TMA)
                    for n in (((2, 3) if dtype in FP8S else (3, 64)) if split else (1,)):
                        _assert_takes_tma(_launch_key(heads, page, dtype, n), case.block_table.shape[1] * page, n)
                        label = f"{name} heads={heads} q_len={q_len} num_kv_splits={n}"
                        got = _runs(sub, n, ("require", "off"), dtype)
                        _assert_matches(got["require"], ref, f'tma="require", {label}', dtype)
                        _assert_bitwise(got["require"], got["off"], f'tma="require" vs tma="off", {label}')


# ------------------------------------------------------------------------------------------------
# 2. A block_table entry of -1 inside a request's range, on full tiles

def test_negative_page_id_in_a_full_tile():
    """The cp.async path zero-fills a row whose page id is negative: the keys of such a page score 0
    and add nothing to O. TMA gets coordinate -1 in the page dimension, which is out of the map's
    bounds, so the box reads zeros too. The reference refuses negative ids, so it runs on the cache
    plus one all-zero page, with those entries pointing at it."""
    for page, dtype in PAGE_DTYPES:
        g = torch.Generator().manual_seed(3000 + page + _SEED[dtype])
        lens = [6 * page + 17, 2 * page + 5, 3 * page]
        case = make_paged_case(lens, max(_heads(page, dtype)), page, 2, DT[dtype], device="cpu", generator=g,
                               k_scale=_k_scale(dtype))
        holes = [(0, 0), (0, 2), (2, 1), (2, 2)]  # first page, a middle page, a request's last (full) page
        table, table_ref = case.block_table.clone(), case.block_table.clone()
        num_pages = case.kv_cache.shape[0]
        for b, j in holes:
            assert j * page + page <= lens[b], "each hole must cover full tiles only (the TMA path)"
            table[b, j], table_ref[b, j] = -1, num_pages
        kv = case.kv_cache.cuda()
        kv_ref = torch.cat([case.kv_cache.view(torch.uint8), torch.zeros_like(case.kv_cache[:1].view(torch.uint8))]
                           ).view(case.kv_cache.dtype).cuda()  # (bytes: torch.cat has no fp8 kernel on every build)
        name = f"p{page}_{dtype}"
        for split in (False, True):
            hs = _heads(page, dtype, split)
            if not hs:
                continue
            for q_len in (1, 2):
                sub = _gpu_case(case.q[:, :q_len, :hs[0]], kv, table, case.seq_lens, case.softmax_scale,
                                case.k_scale)
                ref = mla_decode_reference(sub.q, kv_ref, table_ref.cuda(), sub.seq_lens, sub.softmax_scale,
                                           k_scale=sub.k_scale)
                for n in (((2, 3) if dtype in FP8S else (2, 5)) if split else (1,)):
                    _assert_takes_tma(_launch_key(hs[0], page, dtype, n), table.shape[1] * page, n)
                    label = f"{name} heads={hs[0]} q_len={q_len} num_kv_splits={n} holes={holes}"
                    got = _runs(sub, n, ("require", "off"), dtype)
                    _assert_matches(got["off"], ref, f'tma="off" (cp.async), page id -1 reads zeros, {label}', dtype)
                    _assert_bitwise(got["require"], got["off"], f'page id -1: tma="require" vs tma="off", {label}')


# ------------------------------------------------------------------------------------------------
# 4. tma="require": encodes an ordinary cache; refuses the legal caches TMA cannot address
#
# The API accepts any cache whose strides over dimensions of size > 1 are non-negative multiples of 8
# elements (16 bytes) with a 16-byte aligned start, so a token stride that is not a multiple of 16
# bytes cannot reach the launcher. The tensor map's encoder also refuses strides <= 0, and strides of
# a size-1 dimension are not checked by the API, so these legal caches cannot be encoded:
#   - pages expanded from one page (page stride 0), tokens expanded from one row (token stride 0);
#   - a one-page cache whose page stride is not a multiple of 8 elements.
# Under tma="require" they fail with cudaErrorNotSupported (801); by default they fall back to cp.async
# for every tile and must still be right.

def _check_require_modes(jobs: list[_Job], refused: set) -> None:
    """Runs each job by default, with tma="off" and with tma="require". The default must match the
    reference and tma="off" bit for bit (a refused map falls back to cp.async); under "require", the
    jobs in `refused` (indices) must fail with 801 and the others match tma="off" bit for bit."""
    for i, job in enumerate(jobs):
        got = _runs(job.case, job.num_kv_splits, ("require", "off", DEFAULT), job.dtype)
        label = job.label
        _assert_matches(got[DEFAULT], job.ref, f"{_mode_name(DEFAULT)}, {label}", job.dtype)
        _assert_bitwise(got[DEFAULT], got["off"], f'{_mode_name(DEFAULT)} vs tma="off", {label}')
        if i in refused:
            _assert_refused(got["require"], f'tma="require", {label}')
        else:
            _assert_matches(got["require"], job.ref, f'tma="require", {label}', job.dtype)
            _assert_bitwise(got["require"], got["off"], f'tma="require" vs tma="off", {label}')


def _first_dtype(page):
    got = [d for p, d in PAGE_DTYPES if p == page and d not in FP8S]  # these cases build 16-bit caches
    return got[0] if got else None


def _job(label: str, q, kv, block_table, seq_lens, softmax_scale: float, num_kv_splits: int = 1,
         k_scale=None, dtype: str = "bf16") -> _Job:
    case = _gpu_case(q, kv, block_table, seq_lens, softmax_scale, k_scale)
    return _Job(label, case, num_kv_splits, _reference(case), dtype)


def _unencodable_jobs(page: int, dtype: str) -> list[_Job]:
    heads = _heads(page, dtype)[0]
    g = torch.Generator().manual_seed(4000 + page)
    scale = (128 + 64) ** -0.5
    q = (torch.randn(2, 2, heads, 576, generator=g) * 0.1).to(DT[dtype])
    lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
    jobs = []
    # pages expanded from one page: page stride 0
    base = (torch.randn(1, page, 576, generator=g) * 0.1).to(DT[dtype]).cuda()
    kv = base.as_strided((4, page, 576), (0, 576, 1), 0)
    table = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    jobs.append(_job(f"p{page} {dtype} page stride 0 (expanded pages)", q, kv, table, lens, scale))
    # tokens expanded from one row per page: token stride 0
    base = (torch.randn(5, 1, 576, generator=g) * 0.1).to(DT[dtype]).cuda()
    kv = base.as_strided((5, page, 576), (576, 0, 1), 0)
    table = torch.tensor([[4, 0, 2, 1], [1, 3, -1, -1]], dtype=torch.int32)
    jobs.append(_job(f"p{page} {dtype} token stride 0 (expanded rows)", q, kv, table, lens, scale))
    # one page, page stride page * 576 + 4 elements (not 16-byte aligned; legal: the dimension has size 1)
    base = (torch.randn(page * 576 + 8, generator=g) * 0.1).to(DT[dtype]).cuda()
    kv = base.as_strided((1, page, 576), (page * 576 + 4, 576, 1), 0)
    table = torch.zeros(2, 1, dtype=torch.int32)
    one_lens = torch.tensor([page, page // 2 + 3], dtype=torch.int32)
    jobs.append(_job(f"p{page} {dtype} one page with page stride {page * 576 + 4}", q, kv, table, one_lens, scale))
    return jobs


def test_require_encodes_a_contiguous_cache_and_refuses_what_tma_cannot_address():
    jobs, encodable = [], set()
    for page in TMA_PAGES:
        dtype = _first_dtype(page)
        if dtype is None:
            continue
        g = torch.Generator().manual_seed(5000 + page)
        case = make_paged_case([3 * page + 5, page, 0, 200], _heads(page, dtype)[0], page, 2, DT[dtype],
                               device="cpu", generator=g)
        encodable.add(len(jobs))
        jobs.append(_job(f"p{page} {dtype} contiguous cache", case.q, case.kv_cache.cuda(), case.block_table,
                         case.seq_lens, case.softmax_scale))
        jobs += _unencodable_jobs(page, dtype)
    if not jobs:
        pytest.skip("no bf16/fp16 variant whose own kernel loads full tiles by TMA is compiled")
    _check_require_modes(jobs, set(range(len(jobs))) - encodable)


def test_require_with_overlapping_token_rows():
    """A cache whose token rows overlap (token stride 64 elements = 128 bytes < one 1152-byte row) is
    legal for the API and passes the library's own checks before encoding; whether
    cuTensorMapEncodeTiled accepts a dimension-1 stride smaller than the row is up to the driver. Either
    tma="require" succeeds and matches cp.async bit for bit, or it fails with 801; the default mode
    must be right either way."""
    page = next((p for p in TMA_PAGES if _first_dtype(p)), None)
    if page is None:
        pytest.skip("no bf16/fp16 variant whose own kernel loads full tiles by TMA is compiled")
    dtype = _first_dtype(page)
    heads = _heads(page, dtype)[0]
    g = torch.Generator().manual_seed(6000 + page)
    pages, tok, pg = 6, 64, 64 * page + 512
    base = (torch.randn((pages - 1) * pg + (page - 1) * tok + 576, generator=g) * 0.1).to(DT[dtype]).cuda()
    kv = base.as_strided((pages, page, 576), (pg, tok, 1), 0)
    q = (torch.randn(2, 1, heads, 576, generator=g) * 0.1).to(DT[dtype])
    table = torch.tensor([[5, 0, 3, 1], [2, 4, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3 * page + 40, 2 * page], dtype=torch.int32)
    job = _job(f"p{page} {dtype} overlapping token rows", q, kv, table, lens, (128 + 64) ** -0.5)
    got = _runs(job.case, job.num_kv_splits, ("require", "off", DEFAULT))
    _assert_matches(got[DEFAULT], job.ref, f"{_mode_name(DEFAULT)}, overlapping token rows")
    _assert_bitwise(got[DEFAULT], got["off"], f'{_mode_name(DEFAULT)} vs tma="off", overlapping token rows')
    err = got["require"].get("error")
    if err is not None:
        assert err.startswith("RuntimeError") and NOT_SUPPORTED in err, err
        pytest.skip(f"the driver does not encode a tensor map with overlapping token rows ({err}); "
                    "the default mode falls back to cp.async and is right (checked)")
    _assert_bitwise(got["require"], got["off"], 'tma="require" vs tma="off", overlapping token rows')


def test_require_refuses_an_fp8_cache_tma_cannot_address():
    """The fp8 64-token kernel encodes its map over bytes, the fast kernel its swizzled one: under
    tma="require" a cache whose pages are expanded from one page (page stride 0) must fail with 801,
    which proves the launch tried to encode one (a kernel without a TMA path would launch and pass
    silently); by default and with tma="off" the same cache goes through cp.async and matches the
    reference."""
    from mla_variants.fp8 import quantize_kv
    page_dtypes = [(p, d) for p, d in PAGE_DTYPES if d in FP8S]
    if not page_dtypes:
        pytest.skip("no fp8 variant whose own kernel loads full tiles by TMA is compiled")
    jobs = []
    for page, dtype in page_dtypes:
        heads = _heads(page, dtype)[0]
        g = torch.Generator().manual_seed(7000 + page)
        base = quantize_kv(torch.randn(1, page, 576, generator=g) * 0.1, FP8_K_SCALE).cuda()
        kv = base.as_strided((4, page, 576), (0, 576, 1), 0)
        q = (torch.randn(2, 1, heads, 576, generator=g) * 0.1).to(torch.bfloat16)
        table = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
        lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
        _assert_takes_tma(_launch_key(heads, page, dtype, 1), table.shape[1] * page, 1)
        jobs.append(_job(f"p{page} {dtype} heads={heads} page stride 0 (expanded pages)", q, kv, table, lens,
                         (128 + 64) ** -0.5, k_scale=FP8_K_SCALE, dtype=dtype))
    _check_require_modes(jobs, set(range(len(jobs))))


def test_require_shows_which_kernel_a_17_to_32_head_launch_runs():
    """bf16/fp16 variants of 17..32 heads (second_kernel "rows64") run the transposed kernel (cp.async
    only) unless every split holds at most facts.second_max_split_keys keys (960 in the default build:
    splits shorter than 1024 keys; counted in whole 64-key tiles of the block table's capacity here),
    when they run their 64-row kernel, which loads pages of a multiple of 64 tokens by TMA
    (facts.second_tma). On a cache TMA cannot address (pages expanded from one page), tma="require"
    must refuse (801) the launch whose block table holds 4 pages (256 / 512 keys) and run the one whose
    table holds just more than second_max_split_keys keys (1024): that shows the choice in both
    directions and that the 64-row launch encodes its map. By default and with tma="off" both match the
    reference, bit for bit with each other."""
    groups: dict = {}
    for k in LIB.table:
        f = _facts(k)
        if k[2] in ("bf16", "fp16") and f.second_kernel == "rows64" and f.second_max_split_keys > 0 and f.second_tma:
            groups.setdefault((k[1], k[2]), set()).add(k[0])
    jobs, short = [], set()
    for page, dtype in sorted(groups):
        heads = max(groups[page, dtype])
        key = _launch_key(heads, page, dtype, 1)
        f = _facts(key)
        if f.second_kernel != "rows64" or f.second_max_split_keys == 0 or not f.second_tma:
            continue
        long_pages = f.second_max_split_keys // page + 1  # capacity above second_max_split_keys: transposed
        if _max_split_keys(f, 4 * page, 1) > f.second_max_split_keys or long_pages <= 4:
            continue  # no 4-page table short enough for the 64-row kernel at this page size
        g = torch.Generator().manual_seed(8000 + page + _SEED[dtype])
        base = (torch.randn(1, page, 576, generator=g) * 0.1).to(DT[dtype]).cuda()
        q = (torch.randn(2, 1, heads, 576, generator=g) * 0.1).to(DT[dtype])
        lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
        for pages in (4, long_pages):
            kv = base.as_strided((pages, page, 576), (0, 576, 1), 0)
            table = torch.stack([torch.arange(pages), torch.arange(pages).flip(0)]).to(torch.int32)
            tma = _loads_by_tma(key, pages * page, 1)
            assert tma == (pages == 4), (_key_id(key), pages, f)  # the short table runs the 64-row kernel
            if tma:
                short.add(len(jobs))
            jobs.append(_job(f"p{page} {dtype} heads={heads} {pages * page}-key table, page stride 0", q, kv,
                             table, lens, (128 + 64) ** -0.5))
    if not jobs:
        pytest.skip("no bf16/fp16 variant of 17..32 heads whose 64-row kernel loads by TMA is compiled")
    # the short tables run the 64-row kernel (TMA: refused on this cache), the long ones the transposed one
    _check_require_modes(jobs, short)
