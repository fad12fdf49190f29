"""Render the selected variants into generated/: one .cu per variant (two for fp8 split variants and for
bf16 / fp16 variants of 17..32 heads, see Variant.units), sources.cmake, manifest.json and the dispatch
table dispatch.py.

Rendering is deterministic (sorted inputs, no timestamps, no absolute paths), each file is rewritten
only when its bytes change (so ninja recompiles nothing after a no-op run), and each file is headed
"generated, do not edit" with a SHA-256 over every input that determines it: the generator's own
source files, the template, and the part of variants.yaml it depends on.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .config import Config
from .variant import Variant

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
CODEGEN = Path(__file__).resolve().parent


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
    dispatch_path: Path
    dispatch_text: str


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(config: Config, variants: list[Variant], generated_dir: Path, library_path: Path,
           dispatch: bool = True) -> RenderResult:
    """Render `variants` into `generated_dir`; `library_path` is where the build puts the library
    (recorded relative to `generated_dir` in the dispatch table). With dispatch=False the dispatch
    table is held in the result for :func:`write_dispatch` once the library is built."""
    generated_dir = Path(generated_dir)
    variants = sorted(set(variants), key=lambda v: v.name)
    env = _env()
    gen = generator_digest()
    written: list[Path] = []

    def emit(path: Path, text: str) -> None:
        if write_if_changed(path, text):
            written.append(path)

    dims_key = json.dumps({"arch": config.arch, "dims": config.dims}, sort_keys=True)
    sources = []
    for v in variants:
        for file, template in v.units:
            src = (TEMPLATES / template).read_text()
            h = _sha256(gen, src, dims_key, file)
            path = generated_dir / "variants" / file
            emit(path, env.get_template(template).render(v=v, cpp_type=v.cpp_type, inputs_hash=h))
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

    lib_rel = os.path.relpath(Path(library_path).resolve(), generated_dir.resolve())
    names = "\n".join(v.name for v in variants)
    whole = _sha256(gen, config.text, names, lib_rel, *(p.read_text() for p in sorted(TEMPLATES.glob("*.j2"))))

    emit(generated_dir / "sources.cmake",
         env.get_template("sources.cmake.j2").render(inputs_hash=whole, variants=variants))
    dispatch_text = env.get_template("dispatch.py.j2").render(inputs_hash=whole, variants=variants, library=lib_rel,
                                                              arch=config.arch)
    if dispatch:
        emit(generated_dir / "dispatch.py", dispatch_text)
    manifest = {
        "generated": "do not edit",
        "inputs_hash": whole,
        "arch": config.arch,
        "dims": config.dims,
        "library": lib_rel,
        "variants": [
            {"name": v.name, "num_heads": v.num_heads, "page_size": v.page_size, "dtype": v.dtype,
             "split": v.split, "source": f"variants/{v.name}.cu", "sources": [f"variants/{f}" for f in v.sources]}
            for v in variants
        ],
    }
    emit(generated_dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return RenderResult(variants, written, removed, manifest, generated_dir / "dispatch.py", dispatch_text)


def write_dispatch(result: RenderResult) -> bool:
    """Write the dispatch table that :func:`render` prepared (after a successful build)."""
    return write_if_changed(result.dispatch_path, result.dispatch_text)
