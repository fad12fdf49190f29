"""`pip install .` without a checkout: the wheel carries the kernel sources, CMakeLists.txt and
variants.yaml as package data, and an installed package renders from them (codegen/paths.py)."""
import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

from codegen.paths import CHECKOUT, PACKAGE


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is not installed")
def test_the_wheel_holds_what_a_build_reads(tmp_path):
    # From a copy: setuptools builds in the source tree's build/, the folder `mla-variants build` uses.
    src = tmp_path / "src"
    shutil.copytree(CHECKOUT, src, ignore=shutil.ignore_patterns(".git", "build", "generated", "*.egg-info", ".venv",
                                                                 "__pycache__", ".whl", "shared", ".calls"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(src)], capture_output=True, text=True)
    if "invalid command 'bdist_wheel'" in proc.stderr:
        pytest.skip("setuptools here cannot build wheels (no `wheel` package)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("mla_variants-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernel = {f"codegen/kernel_sources/{p.relative_to(CHECKOUT / 'templates').as_posix()}"
              for p in (CHECKOUT / "templates").rglob("*") if p.is_file()}
    assert kernel and kernel <= names, sorted(kernel - names)
    assert {"codegen/project_files/variants.yaml", "codegen/project_files/CMakeLists.txt"} <= names
    assert {f"codegen/{p.name}" for p in PACKAGE.glob("*.py")} <= names
    assert {"mla_variants/__init__.py", "mla_variants/jit.py", "mla_variants/integrations/__init__.py"} <= names
    assert not any(n.startswith(("tests/", "lab/", "docs/", "benchmarks/")) for n in names)
