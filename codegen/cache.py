"""Build one variant into the per-user cache (JIT on first use, and `mla_variants.ensure_variant`).

A cached variant is a complete one-variant build: <cache>/variants/<variant name>-<key>/ holds its
generated/ folder (sources and manifest.json, which the runtime loads like the AOT build's) and its
build/ folder (CMake tree and libmla_variants.so). The key is a SHA-256 over everything that decides
the machine code: the kernel headers and templates, the generator's code, CMakeLists.txt, the
dims and arch (fixed by codegen.config), the variant's name, the extra nvcc flags (CUDAFLAGS,
NVCC_PREPEND_FLAGS, NVCC_APPEND_FLAGS), the nvcc and host compiler versions and the CUTLASS headers'
version. Any change gives a new folder; nothing is ever rebuilt in place, except an entry whose
library no longer has the size and SHA-256 its stamp recorded, which is built again. A file lock per folder makes concurrent processes build a variant once:
the first builds, the others wait and then load its result.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from .paths import cache_dir, default_config, project_dir

_BUILD_LOCK_TIMEOUT_S = 3600  # a waiting process gives up after an hour (a build takes well under a minute)


def _host_compiler() -> str:
    """The first line of the host C++ compiler's --version (nvcc's -ccbin default: $CXX, else c++)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{cxx}: not runnable"
    return out.strip().splitlines()[0] if out.strip() else f"{cxx}: no version"


def _cutlass_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "nvidia-cutlass not installed"


@lru_cache(maxsize=None)
def _inputs_digest(flags: str, prepend: str, append: str) -> str:
    """Every input but the variant's name (computed once per process and set of flags)."""
    from .config import FIXED_DIMS, SUPPORTED_ARCHS
    from .paths import templates_dir
    from .render import compiler_version, generator_digest, kernel_digest
    h = hashlib.sha256()
    parts = [
        kernel_digest(), generator_digest(),
        *((p.name + "\0" + p.read_text()) for p in sorted(templates_dir().glob("*.j2"))),
        (project_dir() / "CMakeLists.txt").read_text(),
        json.dumps({"arch": SUPPORTED_ARCHS, "dims": FIXED_DIMS}, sort_keys=True),
        flags, prepend, append, compiler_version(), _cutlass_version(), _host_compiler(),
    ]
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def variant_key(variant) -> str:
    """The cache key of `variant` (a codegen.variant.Variant): 16 hex digits of a SHA-256 over every input
    of its machine code (module docstring). variants.yaml's dims and arch are fixed (config.FIXED_DIMS,
    SUPPORTED_ARCHS), so its other keys (axes, presets) change no cached variant."""
    from .render import cudaflags
    # nvcc reads NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS itself: they change the code as CUDAFLAGS does
    digest = _inputs_digest(cudaflags(), os.environ.get("NVCC_PREPEND_FLAGS", ""), os.environ.get("NVCC_APPEND_FLAGS", ""))
    return hashlib.sha256((digest + variant.name).encode()).hexdigest()[:16]


def variant_dir(variant) -> Path:
    """The cache folder of `variant` (it may not exist yet)."""
    return cache_dir() / "variants" / f"{variant.name}-{variant_key(variant)}"


_STAMP = "complete.json"  # written last: the library's size and SHA-256, so a damaged entry is rebuilt


def _library_digest(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def cached_generated_dir(variant) -> Path | None:
    """The generated/ folder of `variant`'s complete, undamaged cache entry, or None: the entry's stamp
    names the library's size and SHA-256, and the file on disk must still have them (a truncated or
    replaced library would crash the process that loads it)."""
    folder = variant_dir(variant)
    try:
        stamp = json.loads((folder / _STAMP).read_text())
        lib = folder / "build" / stamp["library"]
        if lib.stat().st_size != stamp["bytes"] or _library_digest(lib) != {k: stamp[k] for k in ("bytes", "sha256")}:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder / "generated" if (folder / "generated" / "manifest.json").is_file() else None


_SHELL_CHARS = "$`\"'\\"


def build_variant(variant, echo=print, jobs: int | None = None) -> Path:
    """The generated/ folder (with manifest.json) of `variant` in the cache, built first if there is no
    complete, undamaged entry (cached_generated_dir): renders and compiles the variant alone (its units,
    the library exports and the schedule kernel) with the shipped variants.yaml's dims and arch. `echo`
    gets one line when a build starts. Raises codegen.build.BuildError (no nvcc, a compile error, a
    spill, a cache folder that cannot be written or whose path holds shell characters) or
    filelock.Timeout."""
    import filelock

    from .build import LIBRARY_NAME, build
    from .config import load_config
    from .render import render, write_manifest

    got = cached_generated_dir(variant)
    if got is not None:
        return got
    from .build import BuildError

    folder = variant_dir(variant)
    gen, bdir = folder / "generated", folder / "build"
    where = "the cache folder ($MLA_VARIANTS_CACHE, else $XDG_CACHE_HOME/mla-variants, else ~/.cache/mla-variants)"
    odd = sorted(set(str(folder)) & set(_SHELL_CHARS))
    if odd:  # nvcc hands the host compile's paths to a shell
        raise BuildError(f"{where} is {cache_dir()}, whose path holds {' '.join(odd)}, which nvcc's host compile "
                         "would expand; choose a folder without them")
    lock = filelock.FileLock(str(folder) + ".lock", timeout=_BUILD_LOCK_TIMEOUT_S)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()  # making the lock file also shows the folder is writable
    except OSError as e:
        raise BuildError(f"{where} is {cache_dir()}, which cannot be written ({e.strerror or e}: {e.filename or folder}); "
                         "point MLA_VARIANTS_CACHE at a writable folder") from e
    try:
        got = cached_generated_dir(variant)  # another process built it while this one waited
        if got is not None:
            return got
        shutil.rmtree(folder, ignore_errors=True)  # what a killed build or a damaged entry left behind
        echo(f"mla-variants: compiling {variant.name} for its first use (once; cached in {folder})")
        res = render(load_config(default_config()), [variant], gen, bdir / LIBRARY_NAME)
        build(gen, bdir, [variant], jobs, echo=lambda _line: None)
        write_manifest(res)
        stamp = {"library": LIBRARY_NAME, **_library_digest(bdir / LIBRARY_NAME)}
        tmp = folder / (_STAMP + ".tmp")
        tmp.write_text(json.dumps(stamp, indent=1) + "\n")
        tmp.replace(folder / _STAMP)  # last: a stamp means a complete build
    finally:
        lock.release()
    return gen
