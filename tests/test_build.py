"""A real CMake + nvcc build of the `ci` preset (9 variants, every kernel path: transposed and 64-row,
split and not, bf16, fp8_e4m3 and fp8_e4m3_fast, both second kernels) that links and loads, on any machine with nvcc
(no GPU needed); skipped with a reason where nvcc is missing."""
import ctypes
import json
import os
import re
import subprocess
import sys
import time

import pytest

from codegen.build import BuildError, check_usage, configure_args, parse_resource_usage
from codegen.paths import CHECKOUT as ROOT
from codegen.variant import Variant
from mla_variants import _binding

from conftest import needs_nvcc




def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="session")
def ci_build(tmp_path_factory, pytestconfig):
    """The `ci` preset built once per session; its per-unit progress lines go to the terminal as they
    come (the build takes a few minutes on two cores), past pytest's output capture."""
    d = tmp_path_factory.mktemp("ci_build")
    gen, bld = d / "generated", d / "build"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "codegen", "build", "--preset", "ci", "--generated-dir", str(gen), "--build-dir", str(bld)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    terminal = pytestconfig.pluginmanager.getplugin("terminalreporter")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if terminal is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                terminal.write_line(f"ci build: {line.rstrip()}")
    stderr = proc.stderr.read()
    p = subprocess.CompletedProcess(cmd, proc.wait(), "".join(lines), stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    return gen, bld, p, time.monotonic() - t0


@needs_nvcc
def test_build_links_loads_and_matches_manifest(ci_build):
    gen, bld, p, _ = ci_build
    assert "compiling mla_decode_h16_p64_bf16_split" in p.stdout          # per-variant progress
    assert "compiling mla_decode_h16_p64_fp8_e4m3_split" in p.stdout
    assert "compiling mla_decode_h64_p64_fp8_e4m3_fast_split" in p.stdout
    # summary: 9 variants (7 split, 2 nosplit at 64 heads: variants.yaml's exclude rules) + 4 second
    # units (the 64-head fp8 split variants' short-split kernel, exact and fast, and the 64-row kernel
    # of the 16- and 32-head bf16 ones)
    assert "built 9 variants (13 translation units compiled)" in p.stdout
    assert "MiB" in p.stdout
    manifest = json.loads((gen / "manifest.json").read_text())
    lib = ctypes.CDLL(str(bld / "libmla_variants.so"))
    header = (ROOT / "templates" / "mla" / "abi.h").read_text()
    assert lib.mla_variants_abi_version() == _binding.ABI_VERSION == int(re.search(r"MLA_ABI_VERSION (\d+)", header)[1])
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
    assert "built 9 variants (0 translation units compiled)" in p.stdout
    assert json.loads((bld / "resource_usage.json").read_text()) == before
    regs = sorted(r["registers"] for r in before.values())
    assert f"registers {regs[0]}-{regs[-1]}, no spills" in p.stdout


@needs_nvcc
def test_list_prints_the_manifest(ci_build):
    gen, bld, _, _ = ci_build
    p = _cli("list", "--generated-dir", str(gen), "--build-dir", str(bld))
    assert p.returncode == 0, p.stderr
    assert "mla_decode_h16_p64_bf16_split" in p.stdout and "mla_decode_h64_p64_fp8_e4m3_nosplit" in p.stdout
    assert "9 variants" in p.stdout
    row = next(line for line in p.stdout.splitlines() if line.endswith("mla_decode_h32_p64_bf16_split"))
    assert " 32 " in row and "rows64" in row, row  # rows per CTA and the second kernel, from the manifest
    # Without --build-dir the registers still come from the manifest's own library folder, not from build/.
    p = _cli("list", "--generated-dir", str(gen))
    assert p.returncode == 0, p.stderr
    regs = json.loads((bld / "resource_usage.json").read_text())["mla_decode_h16_p64_bf16_split"]["registers"]
    row = next(line for line in p.stdout.splitlines() if line.endswith("mla_decode_h16_p64_bf16_split"))
    assert f" {regs} " in row and "?" not in row, row


def test_cli_reports_config_errors(tmp_path):
    bad = tmp_path / "v.yaml"
    bad.write_text((ROOT / "variants.yaml").read_text().replace("dtype: [bf16, fp16, fp8_e4m3, fp8_e4m3_fast]", "dtype: [bf16, int4]"))
    p = _cli("generate", "--config", str(bad), "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "unknown dtype 'int4'" in p.stderr and f"{bad}:" in p.stderr
    p = _cli("build", "-j", "-3", "--generated-dir", str(tmp_path / "g"))  # refused before CMake runs
    assert p.returncode == 2 and "-j/--jobs: expected an int >= 1, got -3" in p.stderr, p.stderr
    p = _cli("generate", "--preset", "nope", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "unknown preset 'nope'" in p.stderr
    p = _cli("generate", "--filter", "h7_", "--generated-dir", str(tmp_path / "g"))
    assert p.returncode == 2 and "matches none" in p.stderr
    # a variant an exclude rule leaves out: the error names the rule's line
    p = _cli("generate", "--filter", "h16_p64_bf16_nosplit", "--generated-dir", str(tmp_path / "g"))
    line = next(i for i, t in enumerate((ROOT / "variants.yaml").read_text().splitlines(), 1) if "path: [transposed]}" in t)
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


def test_resource_usage_counts_a_kernel_for_the_unit_that_compiled_it():
    """An fp8_e4m3_fast split variant's second unit compiles the exact short-split kernel, whose mangled
    name spells the fp8_e4m3 variant: its spill must count for the fast variant (the unit's), and with no
    unit line the mangled name decides."""
    short = "_ZN3mla17mla_decode_kernelIN7cutlass12float_e4m3_tELi128ELi64ELb1ELb0ELb1ELi64EEEvNS_12DecodeParamsE"
    ptxas = (f"ptxas info    : Compiling entry function '{short}' for 'sm_90a'\n"
             "    16 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads\n"
             "ptxas info    : Used 168 registers, used 1 barriers\n")
    unit = ("[2/5] Building CUDA object CMakeFiles/mla_variants.dir/tmp/g/variants/"
            "mla_decode_h128_p64_fp8_e4m3_fast_split_second.cu.o\n")
    record = {"registers": 168, "stack_bytes": 16, "spill_store_bytes": 16, "spill_load_bytes": 16}
    assert parse_resource_usage(unit + ptxas) == {"mla_decode_h128_p64_fp8_e4m3_fast_split": record}
    assert parse_resource_usage(ptxas) == {"mla_decode_h128_p64_fp8_e4m3_split": record}
    exports = "[4/5] Building CUDA object CMakeFiles/mla_variants.dir/tmp/g/exports.cu.o\n"
    assert parse_resource_usage(unit + exports + ptxas) == {"mla_decode_h128_p64_fp8_e4m3_split": record}


SERIALIZED_NOTE = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                   "due to insufficient register resources for the wgmma pipeline in the function "
                   "'_ZN3mla17mla_decode_kernelIN7cutlass10bfloat16_tELi128ELi64ELb1ELb0ELb0ELi64EEEvNS_12DecodeParamsE'\n")


def test_resource_usage_records_a_serialized_wgmma_pipeline():
    """ptxas's C7511 / C7515 notes name the kernel; its variant gets them, whichever entry is being compiled."""
    usage = parse_resource_usage(SPILL_LOG + SERIALIZED_NOTE + SERIALIZED_NOTE.replace("C7511", "C7515"))
    assert usage["mla_decode_h128_p64_bf16_split"] == {"wgmma_serialized": ["C7511", "C7515"]}
    assert "wgmma_serialized" not in usage["mla_decode_h32_p16_fp16_nosplit"]
    # other notes (C7517 / C7519: injected waits and arrives) are not serialization
    assert parse_resource_usage(SERIALIZED_NOTE.replace("(C7511)", "(C7519)")) == {}


def test_check_usage_fails_on_spills_and_serialized_pipelines_and_touches_their_sources(tmp_path):
    ok, spills, serial = Variant(16, 64, "bf16", True), Variant(32, 16, "fp16", False), Variant(128, 64, "bf16", True)
    (tmp_path / "variants").mkdir()
    for v in (ok, spills, serial):
        for f in v.sources:
            (tmp_path / "variants" / f).write_text("x")
            os.utime(tmp_path / "variants" / f, (1, 1))
    clean = {ok.name: {"registers": 168, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}}
    check_usage(clean, [ok], tmp_path, tmp_path)
    with pytest.raises(BuildError, match=f"serializes the wgmma pipeline .* in: {serial.name} \\(C7511\\)"):
        check_usage({**clean, serial.name: {"wgmma_serialized": ["C7511"]}}, [ok, serial], tmp_path, tmp_path)
    assert all((tmp_path / "variants" / f).stat().st_mtime > 1 for f in serial.sources)
    assert all((tmp_path / "variants" / f).stat().st_mtime == 1 for f in ok.sources)
    with pytest.raises(BuildError, match=f"register spills to local memory in: {spills.name}"):
        check_usage({spills.name: {"stack_bytes": 8, "spill_store_bytes": 8}}, [spills], tmp_path, tmp_path)


@needs_nvcc
def test_cudaflags_are_part_of_the_configure_stamp(monkeypatch, tmp_path):
    """A changed CUDAFLAGS (the diagnostic -DMLA_TRACE=1) must change the configure command, whose JSON is
    the build folder's stamp: CMake alone reads CUDAFLAGS only at a folder's first configure and would
    ignore it."""
    monkeypatch.delenv("CUDAFLAGS", raising=False)
    plain = configure_args(tmp_path / "gen", tmp_path / "build")
    monkeypatch.setenv("CUDAFLAGS", "-DMLA_TRACE=1")
    flagged = configure_args(tmp_path / "gen", tmp_path / "build")
    assert "-DCMAKE_CUDA_FLAGS=" in plain
    assert "-DCMAKE_CUDA_FLAGS=-DMLA_TRACE=1" in flagged
    assert plain != flagged


@needs_nvcc
def test_a_default_build_has_no_trace_buffer(ci_build):
    """lab/trace.py asks the library for its trace buffer: a build without MLA_TRACE says it has
    none and refuses to read, instead of handing back stale or missing memory."""
    _, bld, _, _ = ci_build
    lib = ctypes.CDLL(str(bld / "libmla_variants.so"))
    lib.mla_variants_trace_bytes.restype = ctypes.c_int64
    lib.mla_variants_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    assert lib.mla_variants_trace_bytes() == 0
    buf = ctypes.create_string_buffer(64)
    assert lib.mla_variants_trace_read(buf, 64) != 0 and lib.mla_variants_trace_clear() != 0
    assert lib.mla_variants_trace_enable(1) != 0
