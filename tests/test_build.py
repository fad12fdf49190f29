"""A real CMake + nvcc build of the `ci` preset (four variants: bf16 and fp8_e4m3, split and not) that links and loads, on any machine with
nvcc (no GPU needed); skipped with a reason where nvcc is missing."""
import ctypes
import json
import subprocess
import sys
import time

import pytest

from codegen.build import BuildError, configure_args, find_nvcc, parse_resource_usage
from codegen.render import ROOT
from mla_variants import _binding


def _nvcc_reason():
    try:
        find_nvcc()
        return None
    except BuildError as e:
        return str(e)


needs_nvcc = pytest.mark.skipif(_nvcc_reason() is not None, reason=f"no CUDA compiler: {_nvcc_reason()}")


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="session")
def ci_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("ci_build")
    gen, bld = d / "generated", d / "build"
    t0 = time.monotonic()
    p = _cli("build", "--preset", "ci", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stdout + p.stderr
    return gen, bld, p, time.monotonic() - t0


@needs_nvcc
def test_build_links_loads_and_matches_manifest(ci_build):
    gen, bld, p, _ = ci_build
    assert "compiling mla_decode_h16_p64_bf16_split" in p.stdout          # per-variant progress
    assert "compiling mla_decode_h16_p64_fp8_e4m3_split" in p.stdout
    # summary: 8 variants (6 split, 2 nosplit at 64 heads: variants.yaml's exclude rules), + the fp8
    # short-split units (16 and 32 heads: stubs; 64 heads: the 64-row fp8 path's) + the 32-head 16-bit
    # 64-row unit
    assert "built 8 variants (12 translation units compiled)" in p.stdout
    assert "MiB" in p.stdout
    manifest = json.loads((gen / "manifest.json").read_text())
    lib = ctypes.CDLL(str(bld / "libmla_variants.so"))
    assert lib.mla_variants_abi_version() == _binding.ABI_VERSION == 4
    for entry in manifest["variants"]:
        assert hasattr(lib, entry["name"]), entry["name"]
    from mla_variants._binding import Library
    loaded = Library(gen)
    assert sorted(loaded.table.values()) == sorted(e["name"] for e in manifest["variants"])
    usage = json.loads((bld / "resource_usage.json").read_text())
    assert set(usage) == {e["name"] for e in manifest["variants"]}
    for name, rec in usage.items():
        assert 0 < rec["registers"] <= 255 and rec["spill_store_bytes"] == 0 and rec["stack_bytes"] == 0, (name, rec)


@needs_nvcc
def test_second_build_compiles_nothing(ci_build):
    gen, bld, _, _ = ci_build
    t0 = time.monotonic()
    p = _cli("build", "--preset", "ci", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stderr
    assert "0 files written" in p.stdout and "(0 translation units compiled)" in p.stdout
    assert time.monotonic() - t0 < 30


@needs_nvcc
def test_a_narrower_build_keeps_the_others_resource_records(ci_build):
    """Building a subset relinks the library from objects already compiled; building the whole preset
    again compiles nothing, so ptxas reports nothing: the records of the variants left out must have
    survived in resource_usage.json (else `list` shows '?' and the spill check misses them)."""
    gen, bld, _, _ = ci_build
    before = json.loads((bld / "resource_usage.json").read_text())
    p = _cli("build", "--preset", "ci", "--filter", "h16_p64_bf16*", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "built 1 variant (0 translation units compiled)" in p.stdout  # h16 nosplit: excluded
    p = _cli("build", "--preset", "ci", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "built 8 variants (0 translation units compiled)" in p.stdout
    assert json.loads((bld / "resource_usage.json").read_text()) == before
    regs = sorted(r["registers"] for r in before.values())
    assert f"registers {regs[0]}-{regs[-1]}, no spills" in p.stdout


@needs_nvcc
def test_list_prints_the_dispatch_table(ci_build):
    gen, bld, _, _ = ci_build
    p = _cli("list", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stderr
    assert "mla_decode_h16_p64_bf16_split" in p.stdout and "mla_decode_h64_p64_fp8_e4m3_nosplit" in p.stdout
    assert "8 variants" in p.stdout
    # Without --build-dir the registers still come from the table's own library folder, not from build/.
    p = _cli("list", "--generated-dir", str(gen))
    assert p.returncode == 0, p.stderr
    regs = json.loads((bld / "resource_usage.json").read_text())["mla_decode_h16_p64_bf16_split"]["registers"]
    row = next(line for line in p.stdout.splitlines() if line.endswith("mla_decode_h16_p64_bf16_split"))
    assert f" {regs} " in row and "?" not in row, row


def test_cli_reports_config_errors(tmp_path):
    bad = tmp_path / "v.yaml"
    bad.write_text((ROOT / "variants.yaml").read_text().replace("dtype: [bf16, fp16, fp8_e4m3]", "dtype: [bf16, int4]"))
    p = _cli("generate", "--config", str(bad), "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "unknown dtype 'int4'" in p.stderr and f"{bad}:" in p.stderr
    p = _cli("generate", "--preset", "nope", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "unknown preset 'nope'" in p.stderr
    p = _cli("generate", "--filter", "h7_", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "matches none" in p.stderr
    # a variant an exclude rule leaves out: the error names the rule's line
    p = _cli("generate", "--filter", "h16_p64_bf16_nosplit", "--generated-dir", str(tmp_path / "g"))
    line = next(i for i, t in enumerate((ROOT / "variants.yaml").read_text().splitlines(), 1) if "num_heads: [8, 16, 32]}" in t)
    assert p.returncode == 2 and f"variants.yaml:{line}: --filter" in p.stderr and "left out by the exclude rule(s)" in p.stderr, p.stderr
    # beside a pattern that matches: a note, and the build goes on with what matched
    p = _cli("generate", "--filter", "h16_p64_bf16_nosplit", "--filter", "h16_p64_bf16_split", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 0 and "note: --filter h16_p64_bf16_nosplit" in p.stdout and "rendered 1 variant " in p.stdout, p.stdout
    # a preset that does not select the variant at all: no rule is blamed
    p = _cli("generate", "--preset", "deepseek-v3-tp1", "--filter", "h16", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "matches none of the" in p.stderr and "exclude" not in p.stderr, p.stderr


SPILL_LOG = """\
ptxas info    : Compiling entry function '_ZN3mla17mla_decode_kernelIN7cutlass6half_tELi32ELi16ELb0EEEvNS_12DecodeParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN3mla17mla_decode_kernelIN7cutlass6half_tELi32ELi16ELb0EEEvNS_12DecodeParamsE
    64 bytes stack frame, 64 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN3mla18mla_combine_kernelIN7cutlass6half_tEEEv13MlaDecodeArgs' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""


def test_resource_usage_parser_names_the_variant():
    usage = parse_resource_usage(SPILL_LOG)
    assert usage == {"mla_decode_h32_p16_fp16_nosplit": {
        "registers": 255, "stack_bytes": 64, "spill_store_bytes": 64, "spill_load_bytes": 48}}


def test_resource_usage_takes_the_worst_kernel_of_a_variant():
    """A split variant has several kernels (here the fp8 uniform one, which spills, then its short-split
    instantiation from the variant's second unit, which does not): the spill must still show, whatever
    the order."""
    uniform = "_ZN3mla17mla_decode_kernelIN7cutlass12float_e4m3_tELi64ELi64ELb1ELb0ELb0EEEvNS_12DecodeParamsE"
    short = "_ZN3mla17mla_decode_kernelIN7cutlass12float_e4m3_tELi64ELi64ELb1ELb0ELb1EEEvNS_12DecodeParamsE"
    log = (f"ptxas info    : Compiling entry function '{uniform}' for 'sm_90a'\n"
           "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n"
           f"ptxas info    : Compiling entry function '{short}' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 160 registers, used 1 barriers\n")
    assert parse_resource_usage(log) == {"mla_decode_h64_p64_fp8_e4m3_split": {
        "registers": 168, "stack_bytes": 8, "spill_store_bytes": 8, "spill_load_bytes": 8}}


@needs_nvcc
def test_cudaflags_are_part_of_the_configure_stamp(monkeypatch, tmp_path):
    """A changed CUDAFLAGS (e.g. -DMLA_TMA=0) must change the configure command, whose JSON is the build
    folder's stamp: CMake alone reads CUDAFLAGS only at a folder's first configure and would ignore it."""
    monkeypatch.delenv("CUDAFLAGS", raising=False)
    plain = configure_args(tmp_path / "gen", tmp_path / "build")
    monkeypatch.setenv("CUDAFLAGS", "-DMLA_TMA=0")
    flagged = configure_args(tmp_path / "gen", tmp_path / "build")
    assert "-DCMAKE_CUDA_FLAGS=" in plain
    assert "-DCMAKE_CUDA_FLAGS=-DMLA_TMA=0" in flagged
    assert plain != flagged


_SWITCH_BUILDS = {
    # Every kernel path with the phase trace: the 64-row path with TMA pages and with page-1 gathers
    # (whose 40-register producer and the 208-register fp8 math warpgroups spilled in a first trace
    # build), the 64-row fp8 path, and the transposed path for 16-bit and fp8 caches (the fp8 one's three
    # warpgroups spilled 4 bytes when merge_st also computed the row statistics there; its 32-row form
    # runs two warpgroups at 232 registers).
    "all-paths": ("-DMLA_Q_FIRST=1 -DMLA_TRACE=1",
                  ["mla_decode_h64_p64_bf16_nosplit", "mla_decode_h128_p1_bf16_split",
                   "mla_decode_h128_p64_fp8_e4m3_split", "mla_decode_h16_p1_bf16_split",
                   "mla_decode_h16_p64_fp8_e4m3_split", "mla_decode_h32_p64_fp8_e4m3_split"]),
    # fp32 partial outputs at 64+ heads too (MLA_PARTIAL_16=0): the 64-row pieces stored from the
    # accumulators, the combines reading fp32 (the default build has them below 64 heads).
    "fp32-partials": ("-DMLA_PARTIAL_16=0",
                      ["mla_decode_h128_p64_bf16_split", "mla_decode_h64_p64_fp16_split"]),
    # 16-bit partial outputs below 64 heads too (MLA_PARTIAL_16=2): the 64-row path's paired stores
    # straight from the accumulators (store_16_pairs), the transposed path's 16-byte stores (fp8: bf16 pieces).
    "partial-16-all": ("-DMLA_PARTIAL_16=2",
                       ["mla_decode_h32_p64_bf16_split", "mla_decode_h16_p64_fp8_e4m3_split",
                        "mla_decode_h32_p64_fp8_e4m3_split"]),
    # The fp8 split variants' short-split kernel (32-token tiles in four stages, S first; built by
    # default) under the trace, and a build without it (MLA_FP8_SHORT_SPLIT_KEYS=0, an A/B's control).
    "fp8-short-trace": ("-DMLA_TRACE=1", ["mla_decode_h64_p64_fp8_e4m3_split", "mla_decode_h128_p1_fp8_e4m3_split"]),
    "fp8-short-off": ("-DMLA_FP8_SHORT_SPLIT_KEYS=0", ["mla_decode_h64_p64_fp8_e4m3_split"]),
    # The fp8 raw bytes by cp.async only (MLA_FP8_TMA=0; TMA is the default since v3.19): a split and a
    # nosplit 64-row variant at pages 64 / 128.
    "fp8-no-tma": ("-DMLA_FP8_TMA=0", ["mla_decode_h128_p64_fp8_e4m3_split", "mla_decode_h64_p128_fp8_e4m3_nosplit"]),
    # The math warps' proxy fence after every KV slot wait, off by default since v3.20 (the control).
    "kv-reader-fence": ("-DMLA_KV_READER_FENCE=1", ["mla_decode_h128_p1_bf16_split"]),
    # The controls of v3.26's switches: merge_st adds every warpgroup's O^T (MLA_MERGE_SKIP_IDLE=0) and
    # the fp8 register path's store works out each row's scale in every pass (MLA_ST_ROW_OUT_ONCE=0).
    "s26-controls": ("-DMLA_MERGE_SKIP_IDLE=0 -DMLA_ST_ROW_OUT_ONCE=0",
                     ["mla_decode_h16_p64_bf16_split", "mla_decode_h32_p64_fp8_e4m3_split"]),
    # The timing probe without widening (wrong results by design), in the S-first order it is for.
    "fp8-probe-no-widen": ("-DMLA_FP8_PROBE_NO_WIDEN=1 -DMLA_FP8_S_FIRST=1", ["mla_decode_h128_p64_fp8_e4m3_split"]),
}


# PTX that only a switch's code path emits: the build test fails if the switch never reached a kernel.
# fp8-short-trace also holds the default build's 64-token fp8 kernel at page 64, which loads its raw
# bytes by TMA (MLA_FP8_TMA, on by default): its tensor copy must be there.
# Each entry: (PTX, how often at least). MLA_KV_READER_FENCE=1 puts a proxy fence after each of the nine
# slot waits of every S loop (h128_p1_bf16_split: 42 fences with it, 6 without).
_SWITCH_PTX = {"fp8-short-trace": ((b"wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16", 1),
                                   (b"cp.async.bulk.tensor.3d.shared::cluster.global", 1)),
               "kv-reader-fence": ((b"fence.proxy.async.shared::cta", 36),)}
# ... and PTX a switch removes.
_SWITCH_NO_PTX = {"fp8-short-off": b"wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16",
                  "fp8-no-tma": b"cp.async.bulk.tensor.3d.shared::cluster.global"}


@needs_nvcc
@pytest.mark.parametrize("build", sorted(_SWITCH_BUILDS))
def test_kernel_switches_compile_without_spills(tmp_path, build):
    """The kernel switches (MLA_Q_FIRST, on by default since v3.13: Q copies before the seq_lens load;
    MLA_TRACE: the per-CTA phase trace of benchmarks/trace.py; MLA_PARTIAL_16 0 and 2: fp32 partial
    outputs everywhere, 16-bit everywhere (the default, 1, picks by head count); MLA_FP8_TMA=0, the fp8
    cp.async-only control; MLA_KV_READER_FENCE=1, the fenced control; the MLA_FP8_PROBE_NO_WIDEN timing probe; the fp8 short-split kernel under the trace, and
    MLA_FP8_SHORT_SPLIT_KEYS=0 without it) must keep compiling, without spills (_SWITCH_BUILDS)."""
    import os
    flags, names = _SWITCH_BUILDS[build]
    env = {**os.environ, "CUDAFLAGS": flags}
    filters = [arg for name in names for arg in ("--filter", name.removeprefix("mla_decode_"))]
    p = subprocess.run([sys.executable, "-m", "codegen", "build", *filters, "--generated-dir", str(tmp_path / "generated"),
                        "--build-dir", str(tmp_path / "build")], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"built {len(names)} variant" in p.stdout  # "1 variant", "2 variants"
    usage = json.loads((tmp_path / "build" / "resource_usage.json").read_text())
    assert set(usage) == set(names)
    for name, rec in usage.items():
        assert max(rec["spill_store_bytes"], rec["spill_load_bytes"], rec["stack_bytes"]) == 0, (name, rec)
    # ptxas's C7514 ("wgmma.mma_async instructions are serialized"): a switch's control flow that ptxas
    # cannot prove safe for asynchronous wgmma costs the whole kernel its overlap (a first
    # build of a run-time wgmma order for warpgroup 1, v3.21, did, with no spill or register count to show it).
    assert "C7514" not in (tmp_path / "build" / "last_build.log").read_text(), build
    lib_path = tmp_path / "build" / "libmla_variants.so"
    for ptx, least in _SWITCH_PTX.get(build, ()):  # the switch's instructions are in the kernels' (embedded) PTX
        assert lib_path.read_bytes().count(ptx) >= least, (build, ptx, least)
    if build in _SWITCH_NO_PTX:
        assert _SWITCH_NO_PTX[build] not in lib_path.read_bytes(), (build, _SWITCH_NO_PTX[build])
    lib = ctypes.CDLL(str(lib_path))
    if "-DMLA_TRACE=1" in flags:  # a trace build has the buffer's switch
        assert lib.mla_variants_trace_enable(0) == 0 and lib.mla_variants_trace_enable(1) == 0


@needs_nvcc
def test_a_default_build_has_no_trace_buffer(ci_build):
    """benchmarks/trace.py asks the library for its trace buffer: a build without MLA_TRACE says it has
    none and refuses to read, instead of handing back stale or missing memory."""
    _, bld, _, _ = ci_build
    lib = ctypes.CDLL(str(bld / "libmla_variants.so"))
    lib.mla_variants_trace_bytes.restype = ctypes.c_int64
    lib.mla_variants_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    assert lib.mla_variants_trace_bytes() == 0
    buf = ctypes.create_string_buffer(64)
    assert lib.mla_variants_trace_read(buf, 64) != 0 and lib.mla_variants_trace_clear() != 0
    assert lib.mla_variants_trace_enable(1) != 0
