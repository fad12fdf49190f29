"""Shared by lab/tests (not collected by the default `python -m pytest`, whose testpaths is tests/):
import a lab tool (lab/<name>.py) or the benchmark (benchmarks/<name>.py) by path. Neither folder is a
package; the lab tools import bench by putting benchmarks/ on sys.path, as done here too."""
import contextlib
import importlib.util
import pathlib
import sys

import pytest

ROOT_DIR = pathlib.Path(__file__).resolve().parents[2]
LAB_DIR = ROOT_DIR / "lab"
BENCH_DIR = ROOT_DIR / "benchmarks"

if str(ROOT_DIR) not in sys.path:  # this checkout's mla_variants and codegen (pytest run from elsewhere)
    sys.path.insert(0, str(ROOT_DIR))


@contextlib.contextmanager
def _lab_module(name: str):
    """lab/<name>.py, else benchmarks/<name>.py, imported under its plain name, with benchmarks/ on
    sys.path while it loads (the lab tools' own insert stays, as when run as a script)."""
    path = LAB_DIR / f"{name}.py"
    if not path.exists():
        path = BENCH_DIR / f"{name}.py"
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="session")
def lab_module():
    """A context manager factory: `with lab_module("trace") as trace: ...`."""
    return _lab_module
