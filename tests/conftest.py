import contextlib
import importlib.util
import os
import pathlib
import sys

import pytest
import torch

# The suite tests the build it is given: a head count the build lacks runs masked on a larger one (as
# in a deployment with MLA_VARIANTS_JIT=0), never compiles. tests/test_jit.py and test_gpu_jit.py turn
# JIT on where they test it.
os.environ.setdefault("MLA_VARIANTS_JIT", "0")

ROOT_DIR = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT_DIR / "benchmarks"
pytest_plugins = ["pytester"]  # tests/test_dispatch.py runs an inner session with this conftest


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on an sm_90 device)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"kernels are built for sm_90a; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


GPU_SKIP = _gpu_reason()


def _nvcc_reason() -> str | None:
    from codegen.build import BuildError, find_nvcc
    try:
        find_nvcc()
        return None
    except BuildError as e:
        return str(e)


NVCC_SKIP = _nvcc_reason()
# Tests that compile (no GPU needed): skipped with the reason where nvcc is missing.
needs_nvcc = pytest.mark.skipif(NVCC_SKIP is not None, reason=f"no CUDA compiler: {NVCC_SKIP}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPU_SKIP is not None and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP), append=False)  # the first skip mark is the reason shown
            continue
        # A GPU test parametrized over the build's variants of some kind gets pytest's bare "got empty
        # parameter set" when the build has none: say which build that is.
        for mark in item.iter_markers("skip"):
            if str(mark.kwargs.get("reason", "")).startswith("got empty parameter set"):
                item.add_marker(pytest.mark.skip(
                    reason=f"{item.originalname}: the build has no variant of the kind this test is parametrized over "
                           f"(a subset build, or none; `mla-variants build` builds them all)"), append=False)
                break


def _built_table() -> dict | None:
    """The dispatch table of the build the GPU tests use, read from its manifest (not from the loaded
    library, whose table tests may narrow), or None when there is no build."""
    from mla_variants import _binding
    try:
        return _binding.table_of(_binding.read_manifest(_binding.generated_dir()))
    except _binding.LibraryNotBuiltError:
        return None


def _full_table() -> dict:
    """variants.yaml's default build (its axes less its exclude rules), as a dispatch table."""
    from codegen.config import load_config
    return {v.key: v.name for v in load_config(ROOT_DIR / "variants.yaml").variants()}


def _left_out_by_subset(error, built: dict | None, full: dict) -> bool:
    """Whether a VariantNotCompiledError only says that the build is a subset: the session's build
    holds fewer variants than variants.yaml's default build, and the whole build would serve the
    request that failed."""
    from mla_variants.dispatch import VariantNotCompiledError, plan_launches
    if built is None or set(full) <= set(built) or getattr(error, "request", None) is None:
        return False
    try:
        plan_launches(full, *error.request)
    except VariantNotCompiledError:
        return False
    return True


def pytest_sessionstart(session):
    # Taken before any test runs (tests narrow the loaded table with monkeypatch).
    gpu = GPU_SKIP is None
    session.config._mla_tables = (_built_table(), _full_table()) if gpu else (None, {})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU test that fails with VariantNotCompiledError for a variant that a subset build (a --filter
    build on the device) left out is reported skipped, naming the variant; in a build of every variant,
    or for a request the whole build would not serve either, it stays a failure."""
    outcome = yield
    rep = outcome.get_result()
    if call.when != "call" or call.excinfo is None or "gpu" not in item.keywords:
        return
    from mla_variants import VariantNotCompiledError
    built, full = getattr(item.config, "_mla_tables", (None, {}))
    if call.excinfo.errisinstance(VariantNotCompiledError) and _left_out_by_subset(call.excinfo.value, built, full):
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
