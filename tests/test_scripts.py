"""The device scripts (scripts/*.sh) parse, and the store probe (scripts/store_probe.cu) compiles: both
run only on the GPU machine, where a syntax error would cost a device call. The host-side protocol
simulations of the transposed path's KV ring (scripts/st_*_sim.py) pass."""
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


@pytest.mark.parametrize("sim", ["st_ring_protocol_sim.py"])
def test_ring_protocol_simulations_pass(sim, capsys):
    runpy.run_path(str(ROOT / "scripts" / sim), run_name="__main__")
    assert "no hang" in capsys.readouterr().out
