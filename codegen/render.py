"""Render the selected variants into generated/: one .cu per variant (two for a variant with a second
kernel, see Variant.units), sources.cmake, and the manifest, manifest.json: the build's one dispatch
artifact (every variant's key, launcher symbol, sources and path facts, and the library's path), which
the Python runtime loads. The manifest is written only once the library links (:func:`write_manifest`),
so a failed build leaves the previous manifest and library consistent.

Rendering is deterministic (sorted inputs, no timestamps, no absolute paths), each file is rewritten
only when its bytes change (so ninja recompiles nothing after a no-op run), and each file is headed
"generated, do not edit" with a SHA-256 over every input that determines it: the generator's own
source files, the template, the part of variants.yaml it depends on, the extra nvcc flags (CUDAFLAGS)
and the compiler's version; the manifest's hash also covers the kernel headers (templates/mla).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .config import Config
from .paths import PACKAGE as CODEGEN, templates_dir
from .variant import Variant


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def generator_digest() -> str:
    """Hash of the generator's own code (every codegen/*.py file, by name and content)."""
    files = sorted(CODEGEN.glob("*.py"))
    return _sha256(*(p.name + "\0" + p.read_text() for p in files))


def kernel_digest() -> str:
    """Hash of the kernel sources every unit compiles (templates/mla, by name and content)."""
    files = sorted((templates_dir() / "mla").iterdir())
    return _sha256(*(p.name + "\0" + p.read_text() for p in files if p.is_file()))


def cudaflags() -> str:
    """The extra nvcc flags of a build (the CUDAFLAGS environment variable, e.g. -DMLA_TRACE=1), with
    runs of whitespace made single spaces (so spacing alone changes no hash)."""
    return " ".join(os.environ.get("CUDAFLAGS", "").split())


@lru_cache(maxsize=None)
def _compiler_version(nvcc: str | None) -> str:
    if nvcc is None:
        return "nvcc not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "nvcc not runnable"
    return out.strip().splitlines()[-1] if out.strip() else "nvcc without a version"


def compiler_version() -> str:
    """The last line of `nvcc --version` (its build tag), or why there is none."""
    from .build import BuildError, find_nvcc
    try:
        nvcc = find_nvcc()
    except BuildError:
        nvcc = None
    return _compiler_version(nvcc)


def write_if_changed(path: Path, content: str) -> bool:
    """Write `content` to `path` unless the file already holds exactly it; returns True if written."""
    if path.exists() and path.read_text() == content:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content)
    os.replace(tmp, path)
    return True


@dataclass
class RenderResult:
    variants: list[Variant]
    written: list[Path]
    removed: list[Path]
    manifest: dict
    manifest_path: Path


def _env():
    import jinja2  # here, not at the top: the runtime imports this module for its digests alone

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(config: Config, variants: list[Variant], generated_dir: Path, library_path: Path) -> RenderResult:
    """Render `variants` into `generated_dir`; `library_path` is where the build puts the library
    (recorded relative to `generated_dir` in the manifest). The manifest is held in the result for
    :func:`write_manifest`, which the build calls once the library links."""
    generated_dir = Path(generated_dir)
    variants = sorted(set(variants), key=lambda v: v.name)
    env = _env()
    gen = generator_digest()
    flags, compiler = cudaflags(), compiler_version()
    written: list[Path] = []

    def emit(path: Path, text: str) -> None:
        if write_if_changed(path, text):
            written.append(path)

    dims_key = json.dumps({"arch": config.arch, "dims": config.dims}, sort_keys=True)
    sources = []
    for v in variants:
        for file, template in v.units:
            src = (templates_dir() / template).read_text()
            h = _sha256(gen, src, dims_key, file, flags, compiler)
            path = generated_dir / "variants" / file
            emit(path, env.get_template(template).render(v=v, facts_cpp=v.facts.cpp(), inputs_hash=h))
            sources.append(path)

    # Sources of variants that variants.yaml still describes stay on disk when a build selects fewer
    # (--preset/--filter), so their objects stay valid and selecting them again recompiles nothing;
    # sources of variants the yaml no longer describes are removed.
    known = {f for v in config.variants() for f in v.sources} | {
        f for p in config.presets.values() for v in p.variants() for f in v.sources}
    removed = []
    for stale in sorted((generated_dir / "variants").glob("*.cu")):
        if stale not in sources and stale.name not in known and stale.read_text().startswith("// generated, do not edit"):
            stale.unlink()
            removed.append(stale)
    for stale in (generated_dir / "dispatch.py",):  # the dispatch table of builds before the manifest was it
        if stale.exists() and stale.read_text().startswith("# generated, do not edit"):
            stale.unlink()
            removed.append(stale)

    lib_rel = os.path.relpath(Path(library_path).resolve(), generated_dir.resolve())
    names = "\n".join(v.name for v in variants)
    whole = _sha256(gen, config.text, names, lib_rel, flags, compiler, kernel_digest(),
                    *(p.read_text() for p in sorted(templates_dir().glob("*.j2"))))

    emit(generated_dir / "sources.cmake",
         env.get_template("sources.cmake.j2").render(inputs_hash=whole, variants=variants))
    manifest = {
        "generated": "do not edit: written by `mla-variants build` once the library links",
        "inputs_hash": whole,
        "arch": config.arch,
        "dims": config.dims,
        "cudaflags": flags,
        "compiler": compiler,
        "library": lib_rel,
        "variants": [
            {"name": v.name, "num_heads": v.num_heads, "page_size": v.page_size, "dtype": v.dtype,
             "split": v.split, "sources": [f"variants/{f}" for f in v.sources], "facts": v.facts.to_json()}
            for v in variants
        ],
    }
    return RenderResult(variants, written, removed, manifest, generated_dir / "manifest.json")


def write_manifest(result: RenderResult) -> bool:
    """Write the manifest that :func:`render` prepared (after a successful build)."""
    return write_if_changed(result.manifest_path, json.dumps(result.manifest, indent=2, sort_keys=True) + "\n")
