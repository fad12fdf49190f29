import contextlib
import importlib.util
import pathlib
import sys

import pytest
import torch

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on an sm_90 device)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"kernels are built for sm_90a; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


GPU_SKIP = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def benchmark_module(name: str):
    """Import benchmarks/<name>.py (not a package; its siblings import each other by plain name)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH_DIR))
