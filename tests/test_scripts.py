"""The device scripts (scripts/*.sh) parse, and the store probe (scripts/store_probe.cu) compiles: both
run only on the GPU machine, where a syntax error would cost a device call. The host-side protocol
simulations of the transposed path's KV ring (scripts/st_*_sim.py) pass, and the host-side check of
the 64-row path's index math against CuTe's layouts (scripts/tile_layout_check.cu) passes."""
import runpy
import subprocess
from pathlib import Path

import pytest

from codegen.build import BuildError, find_nvcc

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_store_probe_compiles(tmp_path):
    try:
        nvcc = find_nvcc()
    except BuildError as e:
        pytest.skip(f"no CUDA compiler: {e}")
    p = subprocess.run([str(nvcc), "-O3", "-arch=sm_90a", "-o", str(tmp_path / "store_probe"),
                        str(ROOT / "scripts" / "store_probe.cu")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_seesaw_protocol_simulation_passes(capsys):
    """The 64-row fp8 ring's barrier protocol (two stages of 64 tokens and the fp8 short-split kernel's four of 32,
    both seesaw orders; two stages with MLA_FP8_TMA's copies too) with the in-place widening producer: no deadlock, stale phase, over-arrival
    or data race over num_tiles 1-12 and five scheduling policies (6 random interleavings each here;
    the script's default is 200)."""
    sim = runpy.run_path(str(ROOT / "scripts" / "seesaw_protocol_sim.py"))
    assert sim["main"](6) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count(" OK: ") == 6, out


@pytest.mark.parametrize("mutation, configs", [("full32", 6), ("early_release", 6), ("no_w8", 6), ("tma_no_bar", 2)])
def test_seesaw_protocol_simulation_catches_protocol_bugs(capsys, mutation, configs):
    """The simulation can fail: a kv_full count for one widening warp, warpgroup 0 releasing its half of
    V before P V reads it, widening warps that overwrite raw bytes without their barrier, and
    MLA_FP8_TMA's copy warps without their named barrier are each reported in every configuration
    they apply to."""
    sim = runpy.run_path(str(ROOT / "scripts" / "seesaw_protocol_sim.py"))
    assert sim["main"](2, mutation=mutation) == configs, capsys.readouterr().out
    capsys.readouterr()


def test_tile_layout_check_passes(tmp_path):
    """The widening's and P's shared-memory offsets, V^T as the KV tile's transpose and the S fragment's
    mapping, at 64-token tiles and at the short-split kernel's 32 (host code: no GPU)."""
    try:
        nvcc = find_nvcc()
    except BuildError as e:
        pytest.skip(f"no CUDA compiler: {e}")
    from codegen.build import cutlass_include_dir
    exe = tmp_path / "tile_check"
    p = subprocess.run([str(nvcc), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
                        f"-I{ROOT / 'templates'}", f"-I{cutlass_include_dir()}", "-o", str(exe),
                        str(ROOT / "scripts" / "tile_layout_check.cu")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
    assert "tile 64:" in run.stdout and "tile 32:" in run.stdout, run.stdout


@pytest.mark.parametrize("sim", ["st_ring_protocol_sim.py"])
def test_ring_protocol_simulations_pass(sim, capsys):
    runpy.run_path(str(ROOT / "scripts" / sim), run_name="__main__")
    assert "no hang" in capsys.readouterr().out


def test_ring_protocol_simulation_catches_a_ring_shallower_than_the_warpgroups():
    """The model is not vacuous: a 2-stage ring with 3 math warpgroups (which layouts.cuh refuses)
    lets a consumer pass on another tile's data in some interleaving."""
    simulate = runpy.run_path(str(ROOT / "scripts" / "st_ring_protocol_sim.py"))["simulate"]
    with pytest.raises(AssertionError, match="another tile's data"):
        for seed in range(300):
            simulate(12, 3, ring=2, seed=seed)


def test_ncu_stall_ledger_reads_a_source_page():
    """scripts/ncu_stalls.py on a source page in ncu's shape (a title line, then the header): the
    instruction with most samples comes first with its main reason, and a file without the columns
    is refused with a message instead of an empty ledger."""
    ncu_stalls = runpy.run_path(str(ROOT / "scripts" / "ncu_stalls.py"))
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
