"""examples/tp_decode.py on the CPU: a world of 2 (and 4) ranks over gloo, the fp32 reference for the
attention, the TP-N layer's output against TP-1's every step (the example exits 1 on a mismatch)."""
import subprocess
import sys

import pytest

from conftest import ROOT_DIR


@pytest.mark.parametrize("extra", [[], ["--kv-dtype", "fp8_e4m3", "--q-len", "2", "--page-size", "1"],
                                   ["--world-size", "4", "--hidden", "1024", "--page-size", "64"]])
def test_tp_decode_matches_one_rank_on_cpu(extra):
    cmd = [sys.executable, str(ROOT_DIR / "examples" / "tp_decode.py"), "--device", "cpu", "--world-size", "2", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith(" ok") for line in steps)
    assert "per decode step" in proc.stdout
