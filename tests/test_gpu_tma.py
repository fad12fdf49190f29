"""The TMA path of 64-row kernels with pages of 64 or 128 tokens (more than 32 heads; skipped without an
sm_90 GPU, or when the build has no such variant): bf16/fp16, and fp8_e4m3 (MLA_FP8_TMA).

Full 64-token tiles of these variants are loaded with TMA (producer.cuh kTmaPages,
launch.cuh encode_kv_map; for fp8 the raw bytes, before the copy warps widen them); the tile holding a
request's or split's end keeps cp.async with zero fill, and so does the fp8 short-split kernel (a
launch whose every split has at most MLA_FP8_SHORT_SPLIT_KEYS keys), so the fp8 cases here keep
their splits long.
MLA_TMA is read once per process at the first launch: "0" sends every tile through cp.async,
"require" makes a launch whose tensor map cannot be encoded fail (RuntimeError) instead of falling
back. So the TMA-vs-cp.async comparisons run the same saved inputs in two subprocesses
(tests/_tma_worker.py) that differ only in MLA_TMA, and compare their outputs bit for bit: both paths
put the same bytes in shared memory and the math is the same, so out and lse must be identical.

- test_tma_variant_against_reference: every compiled p64/p128 variant of the 64-row path
  (the transposed path of smaller head counts gathers with cp.async; in this process, TMA on
  unless MLA_TMA=0 here) on seq_lens {0, 1, 63, 64, 65, 127, 128, 129, 65536, 65537, 65599} in one
  batch, q_len 1 and 2, forced splits, NaN-prefilled outputs, against the fp32 reference (for fp8: on
  the dequantized cache, k_scale 0.0625, within mla_variants.testing.FP8_TOLERANCE).
- test_tma_bitwise_equals_cp_async: MLA_TMA=require vs MLA_TMA=0, p64 and p128, split and not.
- test_negative_page_id_in_a_full_tile: block_table entries of -1 inside a request's range (full
  tiles): cp.async zero-fills them, TMA reads an out-of-bounds box as zeros; both must agree bitwise
  and match the reference on a cache where those entries name an all-zero page.
- test_require_* (16-bit caches): MLA_TMA=require encodes an ordinary cache, and refuses (CUDA error 801) the legal
  caches TMA cannot address (stride-0 pages or tokens, a one-page cache with an odd page stride),
  which the default mode serves correctly through cp.async.
- test_require_refuses_an_fp8_cache_tma_cannot_address: the same refusal for the fp8 64-token kernel's
  byte map (proof that the fp8 launch encodes one), and the cp.async fallback right.
- test_require_shows_which_kernel_a_17_to_32_head_launch_runs: the same refusal for the 64-row kernel
  of a 17..32-head variant (short splits), none for its transposed kernel (long splits).
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # also skip when run outside the repo's conftest
    pytest.skip("no CUDA GPU on this machine (GPU tests run on an sm_90 device)", allow_module_level=True)

import mla_variants  # noqa: E402
from mla_variants import LibraryNotBuiltError, _binding, mla_decode_reference  # noqa: E402
from mla_variants.api import _uses_st  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, PagedCase, compare, make_paged_case, run_nan_prefilled  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
FP8 = "fp8_e4m3"
FP8_K_SCALE = 0.0625  # stored value x k_scale = real value: far from 1, so a scale applied twice or not at all fails
TMA_PAGES = (64, 128)
REPO = Path(mla_variants.__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("_tma_worker.py")
NOT_SUPPORTED = "CUDA error 801"  # cudaErrorNotSupported: what MLA_TMA=require returns when encoding fails


def _tma_keys():
    try:
        table = _binding.library().table
    except LibraryNotBuiltError as e:
        pytest.skip(f"kernels not built: {e}", allow_module_level=True)
    # The transposed path (api._uses_st) always gathers with cp.async (producer.cuh kTmaPages).
    keys = sorted((k for k in table if k[1] in TMA_PAGES and k[2] in DT and not _uses_st(k[0], k[2] == FP8)),
                  key=lambda k: (k[1], k[2], k[0], k[3]))
    if not keys:
        pytest.skip("no variant of the 64-row path (more than 32 heads) with page_size 64 or 128 "
                    "is compiled (only those take the TMA path)", allow_module_level=True)
    return keys


KEYS = _tma_keys()
PAGE_DTYPES = sorted({(k[1], k[2]) for k in KEYS})


def _key_id(k):
    return f"h{k[0]}_p{k[1]}_{k[2]}_{'split' if k[3] else 'nosplit'}"


def _heads(page, dtype, split=None):
    return sorted({k[0] for k in KEYS if k[1] == page and k[2] == dtype and (split is None or k[3] == split)})


def _splits_of(split: bool):
    return (2, 7, 64) if split else (1,)


def _q_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == FP8 else DT[dtype]


def _k_scale(dtype: str):
    return FP8_K_SCALE if dtype == FP8 else None


def _tolerance(dtype: str) -> dict:
    return FP8_TOLERANCE if dtype == FP8 else {}


_SEED = {"bf16": 0, "fp16": 1, FP8: 2}
FP8_SHORT_SPLIT_KEYS = 128  # constants.cuh MLA_FP8_SHORT_SPLIT_KEYS (the default build's; these tests assume it)


def _assert_long_splits(dtype: str, max_seq_len: int, num_kv_splits: int) -> None:
    """An fp8 launch whose splits all have at most FP8_SHORT_SPLIT_KEYS keys takes the short-split
    kernel, which loads by cp.async only: such a case would compare cp.async with itself. Pass the bound
    the launcher sees: run_nan_prefilled gives no max_seq_len, so launch.cuh's short_split_keys takes the
    block table's capacity (max_pages x page_size), in whole 64-key tiles per split."""
    if dtype == FP8:
        tiles = -(-max_seq_len // 64)
        keys = -(-tiles // num_kv_splits) * 64
        assert keys > FP8_SHORT_SPLIT_KEYS, f"fp8 case with {keys} keys per split would not take the TMA path"


# ------------------------------------------------------------------------------------------------
# 1. Every p64/p128 variant of the 64-row path against the reference, 64K-token requests among short ones

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
    if os.environ.get("MLA_TMA") == "0":
        pytest.skip("MLA_TMA=0 in this process: these launches would not take the TMA path "
                    "(run without it, or with MLA_TMA=require)")
    heads, page, dtype, split = key
    case, refs = _long_case(page, dtype)
    for q_len in (1, 2):
        sub = PagedCase(case.q[:, :q_len, :heads].contiguous(), case.kv_cache, case.block_table, case.seq_lens,
                        case.softmax_scale, case.k_scale)
        ref_out, ref_lse = refs[q_len]
        ref_out, ref_lse = ref_out[:, :, :heads], ref_lse[:, :heads]
        for n in _splits_of(split):
            _assert_long_splits(dtype, case.block_table.shape[1] * page, n)
            out, lse = run_nan_prefilled(sub, n)
            problems = compare(out, lse, ref_out, ref_lse, **_tolerance(dtype))
            assert not problems, f"{_key_id(key)} q_len={q_len} num_kv_splits={n} seq_lens={LENS}: {problems}"


# ------------------------------------------------------------------------------------------------
# Subprocess runs: the same inputs under different MLA_TMA settings

class _Jobs:
    """Inputs for tests/_tma_worker.py: shared cache buffers (bases) and decode jobs on views of them."""

    def __init__(self):
        self.bases, self.jobs, self.labels = {}, [], []

    def add_base(self, name: str, t: torch.Tensor) -> None:
        self.bases[name] = t.detach().cpu().contiguous()

    def view(self, name: str, size, stride, offset: int = 0) -> torch.Tensor:
        """The cache the worker will see, built the same way here (on the GPU) for the reference."""
        return self.bases[name].cuda().as_strided(tuple(size), tuple(stride), offset)

    def add(self, label: str, q, kv_spec, block_table, seq_lens, softmax_scale: float, num_kv_splits: int,
            k_scale: float | None = None) -> int:
        self.jobs.append({"q": q.detach().cpu().contiguous(), "kv": kv_spec,
                          "block_table": block_table.detach().cpu().contiguous(),
                          "seq_lens": seq_lens.detach().cpu().contiguous(),
                          "softmax_scale": float(softmax_scale), "num_kv_splits": int(num_kv_splits),
                          "k_scale": None if k_scale is None else float(k_scale)})
        self.labels.append(label)
        return len(self.jobs) - 1

    def run(self, tmp_path: Path, modes) -> dict:
        """{mode: [result per job]} with one worker process per mode (None: MLA_TMA unset)."""
        spec = tmp_path / "jobs.pt"
        torch.save({"bases": self.bases, "jobs": self.jobs}, spec)
        return {mode: _run_worker(spec, tmp_path / f"results_{mode or 'unset'}.pt", mode) for mode in modes}


def _run_worker(spec: Path, results: Path, mode):
    env = dict(os.environ)  # MLA_VARIANTS_GENERATED, CUDA_VISIBLE_DEVICES, ... pass through unchanged
    if mode is None:
        env.pop("MLA_TMA", None)
    else:
        env["MLA_TMA"] = mode
    # the worker imports the same mla_variants package (hence the same generated/ and library) as this process
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, str(WORKER), str(spec), str(results)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"worker with MLA_TMA={mode!r} exited with status {proc.returncode}:\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    got = torch.load(results)
    assert got["mla_tma"] == mode, (got["mla_tma"], mode)
    assert got["library"] == str(_binding.library().path), \
        f"the worker loaded {got['library']}, this process {_binding.library().path}"
    return got["results"]


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
    problems = compare(out.cuda(), lse.cuda(), *ref, **_tolerance(dtype))
    assert not problems, f"{what}: {problems}"


def _contiguous_spec(name, kv):
    return (name, tuple(kv.shape), tuple(kv.stride()), 0)


# ------------------------------------------------------------------------------------------------
# 3. TMA (MLA_TMA=require) and cp.async (MLA_TMA=0) give the same bits

def test_tma_bitwise_equals_cp_async(tmp_path):
    jobs, refs = _Jobs(), []
    for page, dtype in PAGE_DTYPES:
        g = torch.Generator().manual_seed(2000 + page + _SEED[dtype])
        lens = [0, 1, 63, 64, 65, 127, 128, 129, 2 * page + 64, 4097, 4160]  # 4160: 65 full tiles
        heads_all = _heads(page, dtype)
        case = make_paged_case(lens, max(heads_all), page, 2, DT[dtype], device="cpu", generator=g,
                               k_scale=_k_scale(dtype))
        name = f"p{page}_{dtype}"
        jobs.add_base(name, case.kv_cache)
        spec = _contiguous_spec(name, case.kv_cache)
        kv = jobs.view(*spec)
        for split in (False, True):
            hs = _heads(page, dtype, split)
            for heads in sorted({hs[0], hs[-1]}) if hs else ():
                for q_len in (1, 2):
                    q = case.q[:, :q_len, :heads]
                    ref = mla_decode_reference(q.cuda(), kv, case.block_table.cuda(), case.seq_lens.cuda(),
                                               case.softmax_scale, k_scale=case.k_scale)
                    # fp8: 64 splits of 4160 keys would be short (the short-split kernel, no TMA)
                    for n in (((2, 3) if dtype == FP8 else (3, 64)) if split else (1,)):
                        _assert_long_splits(dtype, case.block_table.shape[1] * page, n)
                        jobs.add(f"{name} heads={heads} q_len={q_len} num_kv_splits={n}", q, spec,
                                 case.block_table, case.seq_lens, case.softmax_scale, n, case.k_scale)
                        refs.append((ref, dtype))
    got = jobs.run(tmp_path, ("require", "0"))
    for i, label in enumerate(jobs.labels):
        ref, dtype = refs[i]
        _assert_matches(got["require"][i], ref, f"MLA_TMA=require, {label}", dtype)
        _assert_bitwise(got["require"][i], got["0"][i], f"MLA_TMA=require vs MLA_TMA=0, {label}")


# ------------------------------------------------------------------------------------------------
# 2. A block_table entry of -1 inside a request's range, on full tiles

def test_negative_page_id_in_a_full_tile(tmp_path):
    """Today's cp.async path (producer.cuh) zero-fills a row whose page id is negative: the keys of
    such a page score 0 and add nothing to O. TMA gets coordinate -1 in the page dimension, which is
    out of the map's bounds, so the box reads zeros too. The reference refuses negative ids, so it runs
    on the cache plus one all-zero page, with those entries pointing at it."""
    jobs, refs = _Jobs(), []
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
        kv_ref = torch.cat([case.kv_cache.view(torch.uint8), torch.zeros_like(case.kv_cache[:1].view(torch.uint8))]
                           ).view(case.kv_cache.dtype).cuda()  # (bytes: torch.cat has no fp8 kernel on every build)
        name = f"p{page}_{dtype}"
        jobs.add_base(name, case.kv_cache)
        spec = _contiguous_spec(name, case.kv_cache)
        for split in (False, True):
            hs = _heads(page, dtype, split)
            if not hs:
                continue
            for q_len in (1, 2):
                q = case.q[:, :q_len, :hs[0]]
                ref = mla_decode_reference(q.cuda(), kv_ref, table_ref.cuda(), case.seq_lens.cuda(), case.softmax_scale,
                                           k_scale=case.k_scale)
                for n in (((2, 3) if dtype == FP8 else (2, 5)) if split else (1,)):
                    _assert_long_splits(dtype, table.shape[1] * page, n)
                    jobs.add(f"{name} heads={hs[0]} q_len={q_len} num_kv_splits={n} holes={holes}", q, spec, table,
                             case.seq_lens, case.softmax_scale, n, case.k_scale)
                    refs.append((ref, dtype))
    got = jobs.run(tmp_path, ("require", "0"))
    for i, label in enumerate(jobs.labels):
        ref, dtype = refs[i]
        _assert_matches(got["0"][i], ref, f"MLA_TMA=0 (cp.async), page id -1 reads zeros, {label}", dtype)
        _assert_bitwise(got["require"][i], got["0"][i], f"page id -1: MLA_TMA=require vs MLA_TMA=0, {label}")


# ------------------------------------------------------------------------------------------------
# 4. MLA_TMA=require: encodes an ordinary cache; refuses the legal caches TMA cannot address
#
# The API accepts any cache whose strides over dimensions of size > 1 are non-negative multiples of 8
# elements (16 bytes) with a 16-byte aligned start, so a token stride that is not a multiple of 16
# bytes cannot reach the launcher. encode_kv_map also refuses strides <= 0 and strides of a size-1
# dimension are not checked by the API, so these legal caches cannot be encoded:
#   - pages expanded from one page (page stride 0), tokens expanded from one row (token stride 0);
#   - a one-page cache whose page stride is not a multiple of 8 elements.
# Under MLA_TMA=require they fail with cudaErrorNotSupported (801); by default they fall back to
# cp.async for every tile and must still be right.

def _run_require_modes(tmp_path, jobs: _Jobs, refs, refused, dtype: str = "bf16") -> None:
    """Runs the jobs with MLA_TMA unset, 0 and require. Unset must match the reference and MLA_TMA=0 bit
    for bit (a refused map falls back to cp.async); under require, the jobs in `refused` must fail with
    801 and the others match MLA_TMA=0 bit for bit."""
    got = jobs.run(tmp_path, ("require", "0", None))
    for i, label in enumerate(jobs.labels):
        _assert_matches(got[None][i], refs[i], f"MLA_TMA unset, {label}", dtype)
        _assert_bitwise(got[None][i], got["0"][i], f"MLA_TMA unset vs MLA_TMA=0, {label}")
        if i in refused:
            err = got["require"][i].get("error")
            assert err is not None, f"MLA_TMA=require, {label}: launched, but its tensor map should be refused"
            assert err.startswith("RuntimeError") and NOT_SUPPORTED in err, f"MLA_TMA=require, {label}: {err}"
        else:
            _assert_matches(got["require"][i], refs[i], f"MLA_TMA=require, {label}", dtype)
            _assert_bitwise(got["require"][i], got["0"][i], f"MLA_TMA=require vs MLA_TMA=0, {label}")


def _first_dtype(page):
    got = [d for p, d in PAGE_DTYPES if p == page and d != FP8]  # these cases build 16-bit caches
    return got[0] if got else None


def _unencodable_jobs(jobs: _Jobs, page: int, dtype: str, refs: dict):
    heads = _heads(page, dtype)[0]
    g = torch.Generator().manual_seed(4000 + page)
    scale = (128 + 64) ** -0.5
    q = (torch.randn(2, 2, heads, 576, generator=g) * 0.1).to(DT[dtype])
    lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
    # pages expanded from one page: page stride 0
    name = f"one_page_p{page}"
    jobs.add_base(name, (torch.randn(1, page, 576, generator=g) * 0.1).to(DT[dtype]))
    spec = (name, (4, page, 576), (0, 576, 1), 0)
    table = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    i = jobs.add(f"p{page} {dtype} page stride 0 (expanded pages)", q, spec, table, lens, scale, 1)
    refs[i] = mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), lens.cuda(), scale)
    # tokens expanded from one row per page: token stride 0
    name = f"one_row_p{page}"
    jobs.add_base(name, (torch.randn(5, 1, 576, generator=g) * 0.1).to(DT[dtype]))
    spec = (name, (5, page, 576), (576, 0, 1), 0)
    table = torch.tensor([[4, 0, 2, 1], [1, 3, -1, -1]], dtype=torch.int32)
    i = jobs.add(f"p{page} {dtype} token stride 0 (expanded rows)", q, spec, table, lens, scale, 1)
    refs[i] = mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), lens.cuda(), scale)
    # one page, page stride page * 576 + 4 elements (not 16-byte aligned; legal: the dimension has size 1)
    name = f"odd_stride_p{page}"
    jobs.add_base(name, (torch.randn(page * 576 + 8, generator=g) * 0.1).to(DT[dtype]))
    spec = (name, (1, page, 576), (page * 576 + 4, 576, 1), 0)
    table = torch.zeros(2, 1, dtype=torch.int32)
    one_lens = torch.tensor([page, page // 2 + 3], dtype=torch.int32)
    i = jobs.add(f"p{page} {dtype} one page with page stride {page * 576 + 4}", q, spec, table, one_lens, scale, 1)
    refs[i] = mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), one_lens.cuda(), scale)


def test_require_encodes_a_contiguous_cache_and_refuses_what_tma_cannot_address(tmp_path):
    jobs, refs, encodable = _Jobs(), {}, set()
    for page in TMA_PAGES:
        dtype = _first_dtype(page)
        if dtype is None:
            continue
        g = torch.Generator().manual_seed(5000 + page)
        case = make_paged_case([3 * page + 5, page, 0, 200], _heads(page, dtype)[0], page, 2, DT[dtype],
                               device="cpu", generator=g)
        name = f"contiguous_p{page}"
        jobs.add_base(name, case.kv_cache)
        spec = _contiguous_spec(name, case.kv_cache)
        i = jobs.add(f"p{page} {dtype} contiguous cache", case.q, spec, case.block_table, case.seq_lens,
                     case.softmax_scale, 1)
        encodable.add(i)
        refs[i] = mla_decode_reference(case.q.cuda(), jobs.view(*spec), case.block_table.cuda(), case.seq_lens.cuda(),
                                       case.softmax_scale)
        _unencodable_jobs(jobs, page, dtype, refs)
    if not jobs.jobs:
        pytest.skip("no bf16/fp16 variant of the 64-row path with page_size 64 or 128 is compiled")
    _run_require_modes(tmp_path, jobs, refs, set(range(len(jobs.jobs))) - encodable)


def test_require_with_overlapping_token_rows(tmp_path):
    """A cache whose token rows overlap (token stride 64 elements = 128 bytes < one 1152-byte row) is
    legal for the API and passes encode_kv_map's own checks; whether cuTensorMapEncodeTiled accepts a
    dimension-1 stride smaller than the row is up to the driver. Either MLA_TMA=require succeeds and
    matches cp.async bit for bit, or it fails with 801; the default mode must be right either way."""
    page = 64 if _first_dtype(64) else 128
    dtype = _first_dtype(page)
    if dtype is None:
        pytest.skip("no bf16/fp16 variant of the 64-row path with page_size 64 or 128 is compiled")
    heads = _heads(page, dtype)[0]
    g = torch.Generator().manual_seed(6000 + page)
    pages, tok, pg = 6, 64, 64 * page + 512
    jobs = _Jobs()
    jobs.add_base("overlap", (torch.randn((pages - 1) * pg + (page - 1) * tok + 576, generator=g) * 0.1).to(DT[dtype]))
    spec = ("overlap", (pages, page, 576), (pg, tok, 1), 0)
    q = (torch.randn(2, 1, heads, 576, generator=g) * 0.1).to(DT[dtype])
    table = torch.tensor([[5, 0, 3, 1], [2, 4, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3 * page + 40, 2 * page], dtype=torch.int32)
    jobs.add(f"p{page} {dtype} overlapping token rows", q, spec, table, lens, (128 + 64) ** -0.5, 1)
    ref = mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), lens.cuda(), (128 + 64) ** -0.5)
    got = jobs.run(tmp_path, ("require", "0", None))
    _assert_matches(got[None][0], ref, "MLA_TMA unset, overlapping token rows")
    _assert_bitwise(got[None][0], got["0"][0], "MLA_TMA unset vs MLA_TMA=0, overlapping token rows")
    err = got["require"][0].get("error")
    if err is not None:
        assert err.startswith("RuntimeError") and NOT_SUPPORTED in err, err
        pytest.skip(f"the driver does not encode a tensor map with overlapping token rows ({err}); "
                    "the default mode falls back to cp.async and is right (checked)")
    _assert_bitwise(got["require"][0], got["0"][0], "MLA_TMA=require vs MLA_TMA=0, overlapping token rows")


def test_require_refuses_an_fp8_cache_tma_cannot_address(tmp_path):
    """The fp8 64-token kernel encodes its map over bytes (MLA_FP8_TMA): under MLA_TMA=require a cache
    whose pages are expanded from one page (page stride 0) must fail with 801, which proves the fp8
    launch tried to encode one (a build without the fp8 TMA path would launch and pass silently); by
    default and with MLA_TMA=0 the same cache goes through cp.async and matches the reference."""
    from mla_variants.fp8 import quantize_kv
    pages = [p for p, d in PAGE_DTYPES if d == FP8]
    if not pages:
        pytest.skip("no fp8_e4m3 variant of the 64-row path with page_size 64 or 128 is compiled")
    jobs, refs = _Jobs(), []
    for page in pages:
        heads = _heads(page, FP8)[0]
        g = torch.Generator().manual_seed(7000 + page)
        name = f"fp8_one_page_p{page}"
        jobs.add_base(name, quantize_kv(torch.randn(1, page, 576, generator=g) * 0.1, FP8_K_SCALE))
        spec = (name, (4, page, 576), (0, 576, 1), 0)
        q = (torch.randn(2, 1, heads, 576, generator=g) * 0.1).to(torch.bfloat16)
        table = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
        lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
        _assert_long_splits(FP8, table.shape[1] * page, 1)
        scale = (128 + 64) ** -0.5
        jobs.add(f"p{page} fp8 heads={heads} page stride 0 (expanded pages)", q, spec, table, lens, scale, 1, FP8_K_SCALE)
        refs.append(mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), lens.cuda(), scale,
                                         k_scale=FP8_K_SCALE))
    _run_require_modes(tmp_path, jobs, refs, set(range(len(jobs.jobs))), FP8)


def test_require_shows_which_kernel_a_17_to_32_head_launch_runs(tmp_path):
    """bf16/fp16 variants of 17..32 heads run the transposed kernel (cp.async only) unless every split is
    shorter than MLA_ST32_MIN_KEYS (1024 keys; launch.cuh, from the block table's capacity here), when
    they run their 64-row kernel, which loads pages of 64 and 128 tokens by TMA. On a cache TMA cannot
    address (pages expanded from one page), MLA_TMA=require must refuse (801) the launch whose block
    table holds 256 / 512 keys and run the one whose table holds 1024: that shows the choice in both
    directions and that the 64-row launch encodes its map. By default and with MLA_TMA=0 both match
    the reference, bit for bit with each other."""
    table_lib = _binding.library().table
    jobs, refs, short = _Jobs(), [], set()
    for page in TMA_PAGES:
        for dtype in ("bf16", "fp16"):
            heads = sorted({k[0] for k in table_lib if k[1] == page and k[2] == dtype and 16 < k[0] <= 32})
            if not heads:
                continue
            g = torch.Generator().manual_seed(8000 + page + _SEED[dtype])
            name = f"st32_one_page_p{page}_{dtype}"
            jobs.add_base(name, (torch.randn(1, page, 576, generator=g) * 0.1).to(DT[dtype]))
            q = (torch.randn(2, 1, heads[-1], 576, generator=g) * 0.1).to(DT[dtype])
            lens = torch.tensor([3 * page + 10, page + 1], dtype=torch.int32)
            scale = (128 + 64) ** -0.5
            for pages in (4, 1024 // page):
                spec = (name, (pages, page, 576), (0, 576, 1), 0)
                table = torch.stack([torch.arange(pages), torch.arange(pages).flip(0)]).to(torch.int32)
                i = jobs.add(f"p{page} {dtype} heads={heads[-1]} {pages * page}-key table, page stride 0", q, spec,
                             table, lens, scale, 1)
                if pages * page < 1024:
                    short.add(i)
                refs.append(mla_decode_reference(q.cuda(), jobs.view(*spec), table.cuda(), lens.cuda(), scale))
    if not jobs.jobs:
        pytest.skip("no bf16/fp16 variant of 17..32 heads with page_size 64 or 128 is compiled")
    # the short tables run the 64-row kernel (TMA: refused on this cache), the long ones the transposed one
    _run_require_modes(tmp_path, jobs, refs, short)
