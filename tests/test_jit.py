"""JIT on first use (mla_variants/jit.py, codegen/cache.py) and the installed-package layout
(codegen/paths.py). The builds need nvcc and the CUTLASS headers, not a GPU; they skip with a reason
where nvcc is missing. The GPU half (a JIT-built variant against the reference) is in test_gpu_jit.py."""
import os
import subprocess
import sys
import warnings

import pytest

from codegen import paths
from codegen.build import BuildError
from codegen.cache import variant_dir, variant_key
from codegen.variant import Variant
from mla_variants import _binding, ensure_variant, jit
from mla_variants.dispatch import VariantNotCompiledError

from conftest import NVCC_SKIP, needs_nvcc


V24 = (24, 16, "bf16", True)  # a head count the default build does not have


def test_cache_key_is_a_function_of_the_variant_and_the_flags(monkeypatch):
    a, b = Variant(*V24), Variant(48, 16, "bf16", True)
    monkeypatch.delenv("CUDAFLAGS", raising=False)
    key = variant_key(a)
    assert key == variant_key(Variant(*V24)) and key != variant_key(b)
    monkeypatch.setenv("CUDAFLAGS", "-DMLA_TRACE=1")
    assert variant_key(a) != key
    monkeypatch.setenv("MLA_VARIANTS_CACHE", "/some/where")
    assert variant_dir(a).parent == paths.Path("/some/where/variants")
    assert variant_dir(a).name == f"{a.name}-{variant_key(a)}"


def test_installed_layout_reads_package_data_and_builds_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "in_checkout", lambda: False)
    monkeypatch.delenv("MLA_VARIANTS_GENERATED", raising=False)
    monkeypatch.setenv("MLA_VARIANTS_CACHE", str(tmp_path))
    assert paths.templates_dir() == paths.PACKAGE / "kernel_sources"
    assert paths.default_config() == paths.PACKAGE / "project_files" / "variants.yaml"
    assert paths.default_generated_dir() == tmp_path / "aot" / "generated"
    assert paths.default_build_dir() == tmp_path / "aot" / "build"
    monkeypatch.setattr(paths, "in_checkout", lambda: True)
    assert paths.templates_dir() == paths.CHECKOUT / "templates" and (paths.templates_dir() / "mla" / "kernel.cuh").is_file()


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MLA_VARIANTS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert paths.cache_dir() == tmp_path / "mla-variants"


@pytest.mark.parametrize("args, arg", [((0, 16), "num_heads"), ((129, 16), "num_heads"), ((16, 0), "page_size"),
                                       ((16, 16, "int4"), "dtype"), ((16, 16, "bf16", 1), "split"),
                                       ((True, 16), "num_heads"), ((16, 16, ["bf16"]), "dtype")])
def test_ensure_variant_names_a_bad_argument(args, arg):
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        ensure_variant(*args)


def test_jit_off_keeps_a_missing_build_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_VARIANTS_JIT", "0")
    with pytest.raises(_binding.LibraryNotBuiltError, match="no manifest"):
        _binding.Library(tmp_path)
    monkeypatch.setenv("MLA_VARIANTS_JIT", "1")
    assert _binding.Library(tmp_path).table == {}  # with JIT, variants come on first use


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
    """A per-test-module cache holding the 24-head variant, built once by ensure_variant (about a minute
    on two cores). The checkout's own build is hidden meanwhile (MLA_VARIANTS_GENERATED names an empty
    folder), so a user who added 24 heads to variants.yaml and built them still gets a cache build here."""
    if NVCC_SKIP is not None:
        pytest.skip(f"no CUDA compiler: {NVCC_SKIP}")
    cache = tmp_path_factory.mktemp("jit_cache")
    old = {k: os.environ.get(k) for k in ("MLA_VARIANTS_CACHE", "MLA_VARIANTS_GENERATED")}
    os.environ["MLA_VARIANTS_CACHE"] = str(cache)
    os.environ["MLA_VARIANTS_GENERATED"] = str(tmp_path_factory.mktemp("no_aot_build"))
    print(f"\nbuilding {Variant(*V24).name} into {cache} (about a minute on two cores)", file=sys.__stderr__, flush=True)
    try:
        path = ensure_variant(*V24)
        yield cache, path
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@needs_nvcc
def test_ensure_variant_builds_once_and_returns_at_once_later(jit_cache, capfd):
    cache, path = jit_cache
    assert path.is_file() and path.is_relative_to(cache) and path.name == "libmla_variants.so"
    manifest = _binding.read_manifest(path.parent.parent / "generated")
    assert _binding.table_of(manifest) == {V24: Variant(*V24).name}
    stamp = path.stat().st_mtime_ns
    capfd.readouterr()
    assert ensure_variant(*V24) == path  # this process
    assert "compiling" not in capfd.readouterr().err
    proc = subprocess.run([sys.executable, "-c", "import mla_variants; print(mla_variants.ensure_variant(24, 16, 'bf16', True))"],
                          capture_output=True, text=True, env={**os.environ, "MLA_VARIANTS_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(path) and "compiling" not in proc.stderr  # another process
    assert path.stat().st_mtime_ns == stamp


@needs_nvcc
def test_a_call_without_its_head_count_loads_the_cached_variant(jit_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_VARIANTS_JIT", "1")
    lib = _binding.Library(tmp_path)  # no AOT build at all
    launches = lib.plan(24, 16, "bf16", False)
    assert [l.symbol for l in launches] == [Variant(*V24).name] and launches[0].facts.rows_per_cta == 32
    assert lib.cdll.mla_variants_abi_version() == _binding.ABI_VERSION

    # A JIT build that fails (here: made to) is tried once; the call runs on what is loaded (24 heads
    # serve 20, masked) with a warning, or says why nothing serves it.
    def broken(*key):
        raise BuildError("nvcc not found: install the CUDA toolkit")
    monkeypatch.setattr(jit, "cached_build", broken)
    with pytest.warns(RuntimeWarning, match="JIT build of the 20-head variant .* failed"):
        assert [l.symbol for l in lib.plan(20, 16, "bf16", True)] == [Variant(*V24).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib.plan(20, 16, "bf16", False)  # not tried again
    with pytest.warns(RuntimeWarning), pytest.raises(VariantNotCompiledError, match="JIT build of the variant failed: BuildError: nvcc not found"):
        lib.plan(16, 1, "bf16", True)


@needs_nvcc
def test_any_jit_failure_falls_back_once(jit_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_VARIANTS_JIT", "1")
    lib = _binding.Library(tmp_path)
    lib.plan(24, 16, "bf16", True)

    def unwritable(*key):
        raise PermissionError(13, "Permission denied", "/cache/variants")
    monkeypatch.setattr(jit, "cached_build", unwritable)
    with pytest.warns(RuntimeWarning, match="PermissionError: .*Permission denied"):
        assert [l.symbol for l in lib.plan(20, 16, "bf16", False)] == [Variant(*V24).name]


@needs_nvcc
def test_a_damaged_cache_entry_is_not_loaded(jit_cache, tmp_path, monkeypatch):
    """A library that lost bytes would crash the process that loads it: the entry's stamp (size and
    SHA-256) no longer matches, so the entry counts as absent and is built again."""
    import shutil
    from codegen.cache import cached_generated_dir
    cache, path = jit_cache
    entry = path.parent.parent
    monkeypatch.setenv("MLA_VARIANTS_CACHE", str(tmp_path))
    copy = tmp_path / "variants" / entry.name
    shutil.copytree(entry, copy)
    assert cached_generated_dir(Variant(*V24)) == copy / "generated"
    lib = copy / "build" / "libmla_variants.so"
    lib.write_bytes(lib.read_bytes()[:4096])
    assert cached_generated_dir(Variant(*V24)) is None
    (copy / "complete.json").unlink()
    assert cached_generated_dir(Variant(*V24)) is None


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("ON", True), (" yes ", True), ("0", False),
                                       ("False", False), ("off", False), ("nope", False), ("00", False)])
def test_jit_switch_values(monkeypatch, value, on):
    monkeypatch.setenv("MLA_VARIANTS_JIT", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jit.enabled() is on
    assert bool(caught) == (value in ("nope", "00"))  # an unknown value warns and keeps JIT off


def test_cache_dir_is_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLA_VARIANTS_CACHE", "rel/cache")
    assert paths.cache_dir() == tmp_path / "rel" / "cache"
    monkeypatch.delenv("MLA_VARIANTS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    assert paths.cache_dir() == paths.Path.home() / ".cache" / "mla-variants"


@needs_nvcc
def test_jit_off_runs_on_a_larger_head_count(jit_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_VARIANTS_JIT", "1")
    lib = _binding.Library(tmp_path)
    lib.plan(24, 16, "bf16", True)
    monkeypatch.setenv("MLA_VARIANTS_JIT", "0")
    assert [(l.symbol, l.num_heads) for l in lib.plan(20, 16, "bf16", True)] == [(Variant(*V24).name, 20)]


def test_a_cache_folder_that_cannot_be_used_is_a_build_error_naming_it(monkeypatch, tmp_path):
    """Checked before anything compiles: a cache path that is a file, and one that nvcc's host-compile
    shell would expand."""
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("MLA_VARIANTS_CACHE", str(afile))
    with pytest.raises(BuildError, match="MLA_VARIANTS_CACHE.*cannot be written"):
        ensure_variant(16, 3, "bf16", True)
    monkeypatch.setenv("MLA_VARIANTS_CACHE", str(tmp_path / "$HOME" / "x"))
    with pytest.raises(BuildError, match="holds \\$"):
        ensure_variant(16, 3, "bf16", True)
