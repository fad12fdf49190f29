"""Design checks that run on the host (no GPU): the protocol simulations of the KV rings
(tests/design/seesaw_protocol_sim.py for the 64-row path, fast_ring_protocol_sim.py for the fp8 fast
kernel, st_ring_protocol_sim.py for the transposed path), the fp8 register path's index math (st_fp8_regs_sim.py), and the host-side checks of the kernels'
index math against CuTe's layouts (tile_layout_check.cu for the 64-row path, st_layout_check.cu for the
transposed one), compiled against templates/mla/layouts.cuh. They check the design, not the compiled
kernels: the GPU tests do that. (The device recipes and diagnostics live in lab/, with their own tests.)"""
import runpy
import subprocess
from pathlib import Path

import pytest

from codegen.build import BuildError, find_nvcc

ROOT = Path(__file__).resolve().parents[1]
DESIGN = Path(__file__).resolve().parent / "design"


def test_seesaw_protocol_simulation_passes(capsys):
    """The 64-row ring's barrier protocol: the fp8 kernels with the in-place widening producer (two stages
    of 64 tokens, tile a released before S(b), with cp.async copies and with TMA pages' copies; the
    short-split kernel's four stages of 32, S first) and the 16-bit kernels (two stages of 64, S first),
    uniform and on the balanced schedule (segments of 0-9 tiles, Q refilled after q_empty): no deadlock,
    stale phase, over-arrival, data race (Q's included) or unbalanced named barrier over num_tiles 1-12
    and five scheduling policies (6 random interleavings each here; the script's default is 200)."""
    sim = runpy.run_path(str(DESIGN / "seesaw_protocol_sim.py"))
    assert sim["main"](6) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count(" OK: ") == 5, out


@pytest.mark.parametrize("mutation, configs", [("full32", 3), ("early_release", 5), ("no_w8", 3), ("tma_no_bar", 1),
                                               ("q_release_first", 1), ("no_phase_carry", 1), ("no_q_wait", 1),
                                               ("no_end_bar", 2)])
def test_seesaw_protocol_simulation_catches_protocol_bugs(capsys, mutation, configs):
    """The simulation can fail: a kv_full count for one widening warp, warpgroup 0 releasing its half of
    V before P V reads it, widening warps that overwrite raw bytes without their barrier, TMA pages'
    copy warps without their named barrier, math warps that release Q before their S wgmmas read it, a
    scheduled walk that does not carry the stages' parities, math warps that skip q_full's wait (Q lands
    late in half the runs) and warpgroups that read each other's row sums without kBarEnd are each
    reported in every configuration they apply to."""
    sim = runpy.run_path(str(DESIGN / "seesaw_protocol_sim.py"))
    assert sim["main"](2, mutation=mutation) == configs, capsys.readouterr().out
    capsys.readouterr()


def test_fast_ring_protocol_simulation_passes(capsys):
    """The fp8 fast kernel's ring, its softmax and P V warpgroups and the epilogue, uniform (one segment of 1-12 tiles) and on the
    balanced schedule (segments of 0-9 tiles, each from stage 0 with the stages' parities carried): no
    deadlock, stale or lapped phase, over-arrival, read of the wrong data or unbalanced barrier (6
    random interleavings per case and policy here; the script's default is 200)."""
    sim = runpy.run_path(str(DESIGN / "fast_ring_protocol_sim.py"))
    assert sim["main"](6) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count(" OK: ") == 2, out


@pytest.mark.parametrize("mutation, configs", [("tma_no_bar", 2), ("early_release", 2), ("p_full_early", 2), ("no_end_bar", 2),
                                               ("no_phase_carry", 1), ("no_segment_bar", 1), ("stage_in_ring", 1)])
def test_fast_ring_protocol_simulation_catches_protocol_bugs(capsys, mutation, configs):
    """The simulation can fail: producer warps that copy a partial tile without first meeting warp 0 at
    kBarProducer (so they wait on a stage a phase ahead), a P V warpgroup releasing its stage before its P V wgmma is done, the
    softmax warpgroup signalling a tile's P before writing it, an epilogue without its barrier (both
    walks), a scheduled walk that does not carry the stages' parities, math warpgroups that do not
    meet between segments and O staged in the ring (which the producer is already refilling) are each
    reported in every configuration they apply to."""
    sim = runpy.run_path(str(DESIGN / "fast_ring_protocol_sim.py"))
    assert sim["main"](3, mutation=mutation) == configs, capsys.readouterr().out
    capsys.readouterr()


def _compile_and_run(tmp_path, source: str) -> str:
    try:
        nvcc = find_nvcc()
    except BuildError as e:
        pytest.skip(f"no CUDA compiler: {e}")
    from codegen.build import cutlass_include_dir
    exe = tmp_path / Path(source).stem
    p = subprocess.run([str(nvcc), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
                        f"-I{ROOT / 'templates'}", f"-I{cutlass_include_dir()}", "-o", str(exe),
                        str(DESIGN / source)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
    return run.stdout


def test_tile_layout_check_passes(tmp_path):
    """The widening's and P's shared-memory offsets, V^T as the KV tile's transpose and the S fragment's
    mapping, at 64-token tiles and at the short-split kernel's 32 (host code: no GPU)."""
    out = _compile_and_run(tmp_path, "tile_layout_check.cu")
    assert "tile 64:" in out and "tile 32:" in out, out


def test_st_layout_check_passes(tmp_path):
    """The transposed path's Q and P^T offsets, its S^T and O^T fragment mappings and V^T as the KV
    tile's transpose, against CuTe's layouts (host code: no GPU)."""
    out = _compile_and_run(tmp_path, "st_layout_check.cu")
    assert "rows 16:" in out and "rows  8:" in out, out


def test_ring_protocol_simulation_passes(capsys):
    runpy.run_path(str(DESIGN / "st_ring_protocol_sim.py"), run_name="__main__")
    assert "no hang" in capsys.readouterr().out


def test_ring_protocol_simulation_catches_a_ring_shallower_than_the_warpgroups():
    """The model is not vacuous: a 2-stage ring with 3 math warpgroups (which layouts.cuh refuses)
    lets a consumer pass on another tile's data in some interleaving."""
    simulate = runpy.run_path(str(DESIGN / "st_ring_protocol_sim.py"))["simulate"]
    with pytest.raises(AssertionError, match="another tile's data"):
        for seed in range(300):
            simulate(12, 3, ring=2, seed=seed)


def test_fp8_register_path_index_math(capsys):
    """The fp8 register path's precomputed V^T offsets match raw_offset, its 16-byte loads and the
    float4 merge's stores are bank-conflict-free (4 wavefronts per warp), and store_rows_st reads every
    O value where the merge wrote it, at 32, 16 and 8 rows."""
    pytest.importorskip("numpy")
    runpy.run_path(str(DESIGN / "st_fp8_regs_sim.py"))
    out = capsys.readouterr().out
    assert "offset mismatches: 0" in out, out
    assert "K 4, V 4 (4 = conflict-free)" in out, out
    for rows in (32, 16, 8):
        assert f"kRows {rows}: read-back mismatches 0, worst wavefronts per merge float4 store 4" in out, out
