"""The lab's device recipes (lab/*.sh) parse and its probes (lab/*.cu) compile: both
run only on the GPU machine, where a syntax error would cost a device call. The ncu stall ledger
(lab/ncu_stalls.py) reads a source page, and the fp8 MMA accuracy study (lab/fp8_mma_accuracy.py)
separates the designs it measures (CPU), and lab/ab_compare.py takes medians over passes (CPU)."""
import json
import runpy
import subprocess
from pathlib import Path

import pytest

from codegen.build import BuildError, find_nvcc

LAB = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(LAB.glob("*.sh"))


def test_the_lab_has_its_recipes():
    assert {p.name for p in SCRIPTS} >= {"ab_bench.sh", "ab_trace.sh", "device_check.sh", "device_env.sh",
                                         "diagnose.sh", "ncu_cases.sh", "ncu_stalls.sh", "prepare_carry.sh",
                                         "split_sweep.sh", "targets.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_recipes_name_no_compile_time_switch_but_the_trace(script):
    """main has one diagnostic build axis (MLA_TRACE); A/Bs are done between trees (branches), and the
    TMA mode is a launch argument, not the MLA_TMA environment variable."""
    import re
    text = script.read_text()
    assert set(re.findall(r"-DMLA_[A-Z0-9_]+", text)) <= {"-DMLA_TRACE"}, script.name
    assert not re.search(r"\bMLA_TMA\b", text), script.name


@pytest.mark.parametrize("probe", ["store_probe.cu", "racecheck_named_barriers.cu", "fp8_fast_probe.cu",
                                   "fp8_wgmma_probe.cu", "fp8_vt_regs_probe.cu", "wgmma_rate.cu"])
def test_probe_compiles(tmp_path, probe):
    from codegen.build import cutlass_include_dir
    try:
        nvcc = find_nvcc()
    except BuildError as e:
        pytest.skip(f"no CUDA compiler: {e}")
    p = subprocess.run([str(nvcc), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "--expt-relaxed-constexpr", f"-I{cutlass_include_dir()}", "-o", str(tmp_path / "probe"),
                        str(LAB / probe)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_ncu_stall_ledger_reads_a_source_page():
    """lab/ncu_stalls.py on a source page in ncu's shape (a title line, then the header): the
    instruction with most samples comes first with its main reason, and a file without the columns
    is refused with a message instead of an empty ledger."""
    ncu_stalls = runpy.run_path(str(LAB / "ncu_stalls.py"))
    page = ('"Kernel Name","mla_decode_kernel"\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb"\n'
            '"0x10","LDS.128 R4, [R2]","1,200","100","1,100"\n'
            '"0x20","BAR.SYNC 0x8, 0x40","800","790","10"\n'
            '"0x30","IADD3 R1, R1, 0x1, RZ","0","0","0"\n')
    text = ncu_stalls["ledger"](page, top=5)
    lines = text.splitlines()
    assert lines[0].startswith("3 instructions, 2000 samples")
    assert "0x10" in lines[2] and "60.0%" in lines[2] and lines[2].rstrip().endswith("long_sb 92%, barrier 8%")
    assert "0x20" in lines[3] and "barrier 99%" in lines[3]
    assert "half of all samples lie in 1 of 3 instructions" in text
    assert "long_sb" in text.split("samples by reason:")[1].splitlines()[1]
    with pytest.raises(ValueError, match="not an ncu source page"):
        ncu_stalls["ledger"]('"a","b"\n"1","2"\n')


def test_fp8_mma_accuracy_study_separates_the_designs(lab_module):
    """lab/fp8_mma_accuracy.py (the measurement behind keeping fp16 tensor-core math for fp8 caches):
    widening to fp16 stays inside FP8_TOLERANCE, while e4m3 q for S and e4m3 P for P V leave it once
    attention is sharp (q_std 10)."""
    with lab_module("fp8_mma_accuracy") as study:
        flat = study.run(trials=3, seq=512, heads=16, q_std=0.1, seed=1)
        sharp = study.run(trials=3, seq=512, heads=16, q_std=10.0, seed=1)
    assert all(r[0] for r in flat["fp16-widen"]) and all(r[0] for r in sharp["fp16-widen"])
    assert not any(r[0] for r in sharp["s-fp8"]) and not any(r[0] for r in flat["s-fp8+pv-fp8"])


def find_cuobjdump(nvcc) -> Path | None:
    """cuobjdump on PATH, beside the (resolved) nvcc, or in the pip CUDA packages' bin folders."""
    import glob
    import shutil
    import site
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    beside = Path(nvcc).resolve().with_name("cuobjdump")
    if beside.exists():
        return beside
    for root in site.getsitepackages():
        for hit in sorted(glob.glob(f"{root}/nvidia/*/bin/cuobjdump")):
            return Path(hit)
    return None


def local_memory_in_wgmma_span(sass: str) -> list[str]:
    """Local loads and stores (LDL/STL) that lie between a function's first and last wgmma (GMMA)
    instruction of `cuobjdump -sass` output: spills inside the tensor-core loop, where they cost."""
    found, func, body = [], None, []

    def check():
        gmma = [i for i, line in enumerate(body) if "GMMA" in line]
        if gmma:
            found.extend(f"{func}: {line.strip()}" for line in body[gmma[0]:gmma[-1]]
                         if "LDL" in line or "STL" in line)

    for line in sass.splitlines():
        if line.strip().startswith("Function :"):
            check()
            func, body = line.split(":", 1)[1].strip(), []
        else:
            body.append(line)
    check()
    return found


def test_local_memory_in_wgmma_span_finds_a_spill_between_wgmmas():
    sass = """Function : k
        /*0010*/ STL [R1], R2 ;
        /*0020*/ QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0030*/ LDL R8, [R1] ;
        /*0040*/ QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;
        /*0050*/ LDL R9, [R1] ;
"""
    assert local_memory_in_wgmma_span(sass) == ["k: /*0030*/ LDL R8, [R1] ;"]


def test_fp8_fast_launchers_compile_without_spills_in_the_loop(tmp_path):
    """lab/fp8_fast_launch.cu (the fast kernel of templates/mla/fp8_fast.cuh before it is a dtype) builds
    the shared object lab/fp8_fast_check.py loads; ptxas serializes no wgmma (C7511, C7515), and no spill lies
    between a kernel's wgmma instructions (a few bytes of the CTA's work descriptor, stored at entry and
    read by the epilogue, are allowed)."""
    from codegen.build import cutlass_include_dir
    try:
        nvcc = find_nvcc()
    except BuildError as e:
        pytest.skip(f"no CUDA compiler: {e}")
    cuobjdump = find_cuobjdump(nvcc)
    if cuobjdump is None:
        pytest.skip(f"no cuobjdump (PATH, beside {nvcc}, or pip nvidia-cuda-cuobjdump)")
    so = tmp_path / "fp8_fast.so"
    p = subprocess.run([str(nvcc), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "--expt-relaxed-constexpr", "-shared", "-Xcompiler", "-fPIC", "-Xptxas=-v",
                        f"-I{LAB.parent / 'templates' / 'mla'}", f"-I{cutlass_include_dir()}",
                        "-o", str(so), str(LAB / "fp8_fast_launch.cu")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    serialized = [line for line in p.stderr.splitlines() if "C7515" in line or "C7511" in line]
    assert not serialized, serialized  # ptxas would serialize the wgmma pipeline
    sass = subprocess.run([str(cuobjdump), "-sass", str(so)], check=True, capture_output=True, text=True).stdout
    assert "GMMA" in sass
    assert not local_memory_in_wgmma_span(sass)


def _bench_file(tmp_path, name, times):
    """A bench.py result file with one case per (heads, cold_us, graph_us) entry."""
    rows = [{"num_heads": h, "batch": 32, "seq_mean": 4096, "page_size": 64, "ragged": False, "q_len": 1,
             "cold_us": cold, "graph_us": graph, "best_us": 100.0} for h, cold, graph in times]
    rows.append({"num_heads": 8, "batch": 32, "seq_mean": 4096, "page_size": 64, "ragged": False, "skipped": "x"})
    path = tmp_path / name
    path.write_text(json.dumps({"cases": rows}))
    return str(path)


def test_ab_compare_takes_medians_over_passes(lab_module, tmp_path):
    """Per case, the medians of each side's passes; cases missing from a file are left out."""
    a = [_bench_file(tmp_path, "a1.json", [(16, 100.0, 80.0), (128, 200.0, 150.0)]),
         _bench_file(tmp_path, "a2.json", [(16, 110.0, 90.0), (128, 220.0, 160.0)]),
         _bench_file(tmp_path, "a3.json", [(16, 300.0, 85.0), (128, 210.0, 155.0)])]
    b = [_bench_file(tmp_path, "b1.json", [(16, 50.0, 40.0), (128, 420.0, 300.0)]),
         _bench_file(tmp_path, "b2.json", [(16, 55.0, 45.0), (128, 440.0, 310.0)]),
         _bench_file(tmp_path, "b3.json", [(16, 52.5, 42.5)])]
    with lab_module("ab_compare") as ab:
        lines = ab.compare([a[0], b[0], a[1], b[1], a[2], b[2]])
    assert lines[0].startswith("1 cases, 3 pass(es)")  # 128 heads is missing from b3
    row = lines[2].split()
    assert row[:5] == ["h16", "b32", "s4096", "p64", "q1"]
    assert [float(x) for x in row[5:8]] == [110.0, 52.5, round(52.5 / 110.0, 3)]
    assert lines[-1].startswith(f"geomean B/A: cold {52.5 / 110.0:.3f}, graph {42.5 / 85.0:.3f}")
    with lab_module("ab_compare") as ab:
        assert ab.main([a[0]]) == 2


def test_ab_compare_shows_checked_errors(lab_module, tmp_path):
    """With --check records on both sides, a case's line ends with both sides' largest max abs error and
    the fastest peer's; without them it has no error column."""
    paths = []
    for name, err in (("a.json", 2e-4), ("b.json", 1.5e-4)):
        row = {"num_heads": 128, "batch": 1, "seq_mean": 4096, "page_size": 64, "ragged": False, "q_len": 1,
               "cold_us": 20.0, "graph_us": 15.0, "best_us": 19.7, "max_abs_err": err, "best_peer_err": 3.7e-4}
        (tmp_path / name).write_text(json.dumps({"cases": [row]}))
        paths.append(str(tmp_path / name))
    with lab_module("ab_compare") as ab:
        assert ab.compare(paths)[2].endswith("err 2.0e-04 -> 1.5e-04 (peer 3.7e-04)")
        plain = [_bench_file(tmp_path, "c.json", [(16, 100.0, 80.0)]),
                 _bench_file(tmp_path, "d.json", [(16, 90.0, 70.0)])]
        assert "err" not in ab.compare(plain)[2]
