import contextlib
import importlib.util
import pathlib
import sys

import pytest
import torch

ROOT_DIR = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT_DIR / "benchmarks"


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


def _build_is_subset() -> bool:
    """Whether the loaded library holds fewer variants than variants.yaml's full cross product (a
    `--filter` / `--preset` build, as the device A/B scripts make)."""
    import mla_variants
    from codegen.config import load_config
    full = {v.key for v in load_config(ROOT_DIR / "variants.yaml").variants()}
    try:
        built = set(mla_variants.list_variants())
    except mla_variants.LibraryNotBuiltError:
        return False
    return not full <= built


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU test that needs a variant the build left out (VariantNotCompiledError) is reported skipped
    in a subset build, naming the variant, and stays a failure in a build of every variant, where a
    missing one is a bug."""
    outcome = yield
    rep = outcome.get_result()
    if call.when != "call" or call.excinfo is None or "gpu" not in item.keywords:
        return
    from mla_variants import VariantNotCompiledError
    if call.excinfo.errisinstance(VariantNotCompiledError) and _build_is_subset():
        rep.outcome = "skipped"
        rep.longrepr = (item.location[0], (item.location[1] or 0) + 1, f"Skipped: a subset build: {call.excinfo.value}")


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
