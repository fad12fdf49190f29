"""Where things are: the kernel sources, the CMake project and the default variants.yaml (in a checkout,
or as package data of an installed wheel), the per-user cache, and the default build folders. Every
other module reads these functions; none spells a path of its own. Imports nothing heavy (the runtime
reads it at first load).

In a checkout (this package next to templates/ and pyproject.toml) the sources are the checkout's, and a
build goes to <checkout>/generated and <checkout>/build. Installed from a wheel (``pip install .``), the
sources are the package data codegen/kernel_sources and codegen/project_files (pyproject.toml maps them
from templates/ and the checkout's root), and the default build goes under the cache folder.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent


def in_checkout() -> bool:
    """True when running from a source checkout (editable install or PYTHONPATH), not an installed wheel."""
    return (CHECKOUT / "templates" / "mla").is_dir() and (CHECKOUT / "pyproject.toml").is_file()


def templates_dir() -> Path:
    """The Jinja2 templates and the kernel headers (mla/*.cuh)."""
    return CHECKOUT / "templates" if in_checkout() else PACKAGE / "kernel_sources"


def project_dir() -> Path:
    """The folder holding CMakeLists.txt (and, in a checkout, variants.yaml)."""
    return CHECKOUT if in_checkout() else PACKAGE / "project_files"


def default_config() -> Path:
    """The shipped variants.yaml."""
    return project_dir() / "variants.yaml"


def _expanded(value: str) -> Path:
    try:
        return Path(value).expanduser()
    except RuntimeError:  # ~user that does not exist: the path as written
        return Path(value)


def cache_dir() -> Path:
    """The per-user cache: $MLA_VARIANTS_CACHE (~ expanded, made absolute), else
    $XDG_CACHE_HOME/mla-variants when that is an absolute path (the XDG spec ignores relative ones),
    else ~/.cache/mla-variants. JIT-built variants live under its variants/ folder."""
    env = os.environ.get("MLA_VARIANTS_CACHE", "").strip()
    if env:
        return _expanded(env).absolute()
    xdg = _expanded(os.environ.get("XDG_CACHE_HOME", "").strip())
    return (xdg if xdg.is_absolute() else Path.home() / ".cache") / "mla-variants"


def default_generated_dir() -> Path:
    """Rendered sources and the manifest of `mla-variants build`, which the runtime loads:
    $MLA_VARIANTS_GENERATED (~ expanded), else <checkout>/generated, else <cache>/aot/generated."""
    env = os.environ.get("MLA_VARIANTS_GENERATED")
    if env:
        return Path(env).expanduser()
    return CHECKOUT / "generated" if in_checkout() else cache_dir() / "aot" / "generated"


def default_build_dir() -> Path:
    """The CMake build tree of `mla-variants build`: <checkout>/build, else <cache>/aot/build."""
    return CHECKOUT / "build" if in_checkout() else cache_dir() / "aot" / "build"
