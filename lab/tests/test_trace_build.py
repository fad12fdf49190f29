"""The one diagnostic build axis, MLA_TRACE, keeps compiling on every kernel path without spills (a
build of a few variants, several minutes on two cores: lab tests only, never the default run)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The 64-row path with TMA pages and with page-1 gathers (whose 40-register producer spilled in a first
# trace build), the 64-row fp8 path and its short-split kernel, the transposed path for 16-bit and fp8
# caches at 16 and 32 rows, and a 17..32-head variant's 64-row second kernel.
TRACED = ["h64_p64_bf16_nosplit", "h128_p1_bf16_split", "h128_p64_fp8_e4m3_split", "h16_p1_bf16_split",
          "h16_p64_fp8_e4m3_split", "h32_p64_fp8_e4m3_split", "h32_p64_bf16_split"]


def test_trace_build_compiles_without_spills(tmp_path):
    try:
        from codegen.build import find_nvcc
        find_nvcc()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no CUDA compiler: {e}")
    filters = [arg for name in TRACED for arg in ("--filter", name)]
    p = subprocess.run([sys.executable, "-m", "codegen", "build", *filters, "--generated-dir", str(tmp_path / "g"),
                        "--build-dir", str(tmp_path / "b")], capture_output=True, text=True, cwd=ROOT,
                       env={**__import__("os").environ, "CUDAFLAGS": "-DMLA_TRACE=1"})
    assert p.returncode == 0, p.stdout + p.stderr
    usage = json.loads((tmp_path / "b" / "resource_usage.json").read_text())
    assert len(usage) == len(TRACED)
    for name, rec in usage.items():
        assert max(rec["spill_store_bytes"], rec["spill_load_bytes"], rec["stack_bytes"]) == 0, (name, rec)
    manifest = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert manifest["cudaflags"] == "-DMLA_TRACE=1"  # a traced library says so at run time
    import ctypes
    lib = ctypes.CDLL(str(tmp_path / "b" / "libmla_variants.so"))
    assert lib.mla_variants_trace_enable(0) == 0 and lib.mla_variants_trace_enable(1) == 0
