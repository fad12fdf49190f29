"""Build one variant into the per-user cache (JIT on first use, and `mla_variants.ensure_variant`).

A cached variant is a complete one-variant build: <cache>/variants/<variant name>-<key>/ holds its
generated/ folder (sources and manifest.json, which the runtime loads like the AOT build's) and its
build/ folder (CMake tree and libmla_variants.so). The key is a SHA-256 over everything that decides
the machine code: the kernel headers and templates, the generator's code, CMakeLists.txt, the
dims and arch (fixed by codegen.config), the variant's name, the extra nvcc flags (CUDAFLAGS), the nvcc version,
the CUTLASS headers' version and the GPU architecture. Any change gives a new folder; nothing is ever
rebuilt in place. A file lock per folder makes concurrent processes build a variant once: the first
builds, the others wait and then load its result.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

from .paths import cache_dir, default_config, project_dir

_BUILD_LOCK_TIMEOUT_S = 3600  # a waiting process gives up after an hour (a build takes well under a minute)


def _cutlass_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "nvidia-cutlass not installed"


@lru_cache(maxsize=None)
def _inputs_digest(flags: str) -> str:
    """Every input but the variant's name (computed once per process and CUDAFLAGS value)."""
    from .config import FIXED_DIMS, SUPPORTED_ARCHS
    from .paths import templates_dir
    from .render import compiler_version, generator_digest, kernel_digest
    h = hashlib.sha256()
    parts = [
        kernel_digest(), generator_digest(),
        *((p.name + "\0" + p.read_text()) for p in sorted(templates_dir().glob("*.j2"))),
        (project_dir() / "CMakeLists.txt").read_text(),
        json.dumps({"arch": SUPPORTED_ARCHS, "dims": FIXED_DIMS}, sort_keys=True),
        flags, compiler_version(), _cutlass_version(),
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
    return hashlib.sha256((_inputs_digest(cudaflags()) + variant.name).encode()).hexdigest()[:16]


def variant_dir(variant) -> Path:
    """The cache folder of `variant` (it may not exist yet)."""
    return cache_dir() / "variants" / f"{variant.name}-{variant_key(variant)}"


def build_variant(variant, echo=print, jobs: int | None = None) -> Path:
    """The generated/ folder (with manifest.json) of `variant` in the cache, built first if it is not
    there: renders and compiles the variant alone (its units, the library exports and the schedule
    kernel) with the shipped variants.yaml's dims and arch. `echo` gets one line when a build starts.
    Raises codegen.build.BuildError (no nvcc, a compile error, a spill) or filelock.Timeout."""
    import filelock

    from .build import LIBRARY_NAME, build
    from .config import load_config
    from .render import render, write_manifest

    folder = variant_dir(variant)
    gen, bdir = folder / "generated", folder / "build"
    if (gen / "manifest.json").is_file():
        return gen
    folder.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder) + ".lock", timeout=_BUILD_LOCK_TIMEOUT_S):
        if (gen / "manifest.json").is_file():  # another process built it while this one waited
            return gen
        shutil.rmtree(folder, ignore_errors=True)  # what a build that was killed left behind
        echo(f"mla-variants: compiling {variant.name} for its first use (once; cached in {folder})")
        res = render(load_config(default_config()), [variant], gen, bdir / LIBRARY_NAME)
        build(gen, bdir, [variant], jobs, echo=lambda _line: None)
        write_manifest(res)  # last: a manifest means a complete build
    return gen
