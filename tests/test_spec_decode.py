"""examples/spec_decode.py: speculative steps in the varlen layout (draft lengths differing per request,
an empty slot, rewinds of rejected tokens), checked against a dense per-request copy of the cache. On
the CPU through the fp32 reference (in CI), on the GPU through MLADecodePlan.run_varlen replayed in a
CUDA graph."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "spec_decode.py"


def _run(*args):
    p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "PASS" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.parametrize("extra", [[], ["--kv-dtype", "fp8_e4m3", "--num-heads", "128", "--page-size", "64", "--steps", "2"],
                                   ["--page-size", "1", "--max-draft", "7", "--batch", "9"]])
def test_spec_decode_cpu(extra):
    out = _run("--device", "cpu", *extra)
    assert out.count(": ok") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("heads, page, kv", [(16, 16, "bf16"), (128, 64, "fp8_e4m3"), (64, 1, "bf16")])
def test_spec_decode_gpu(heads, page, kv):
    _run("--device", "cuda", "--num-heads", str(heads), "--page-size", str(page), "--kv-dtype", kv, "--steps", "6")
