"""JIT on first use: a call whose head count the loaded build lacks gets that variant compiled alone into
the per-user cache (codegen/cache.py: keyed by a hash of the sources, generator, flags, compiler and
arch; a file lock so that concurrent processes build it once), loaded beside the AOT library. Later
calls, and later processes, load the cached build in milliseconds.

When it runs: at num_heads <= 128 (the largest compiled count; more heads are cut into head groups),
when the loaded build has no variant of exactly that head count at the call's page_size and dtype that
can serve the call. The JIT build is the split variant (it also serves unsplit calls, with one split).
Without JIT such a call runs on the next larger compiled head count with the extra rows masked, or
raises VariantNotCompiledError.

Opt out with MLA_VARIANTS_JIT=0 (deployments that must load only what `mla-variants build` made);
:func:`ensure_variant` builds ahead of time either way.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

MAX_JIT_HEADS = 128  # codegen.config.MAX_NUM_HEADS: above it, calls are cut into head groups


_ON, _OFF = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether calls may compile a missing variant: MLA_VARIANTS_JIT unset or 1 / true / yes / on (any
    case). 0 / false / no / off turn it off, and so does any other value (with a warning): a deployment
    that tried to turn JIT off stays strict even when the value is misspelt."""
    value = os.environ.get("MLA_VARIANTS_JIT", "1").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        warnings.warn(f"MLA_VARIANTS_JIT={value!r} is none of 1/true/yes/on or 0/false/no/off: JIT stays off",
                      RuntimeWarning, stacklevel=2)
    return False


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cached(num_heads: int, page_size: int, dtype: str, split: bool) -> Path | None:
    """The generated/ folder of the variant's complete cache entry (built earlier by any process, e.g.
    ensure_variant), or None; never builds."""
    from codegen.cache import cached_generated_dir
    from codegen.variant import Variant
    return cached_generated_dir(Variant(num_heads, page_size, dtype, split))


def cached_build(num_heads: int, page_size: int, dtype: str, split: bool) -> Path:
    """The generated/ folder (with manifest.json) of the variant's cached build, compiling it first if
    needed (one line on stderr when it does). Raises codegen.build.BuildError when it cannot build."""
    from codegen.cache import build_variant
    from codegen.variant import Variant
    return build_variant(Variant(num_heads, page_size, dtype, split), echo=_echo)


def ensure_variant(num_heads: int, page_size: int, dtype: str = "bf16", split: bool = True) -> Path:
    """Make sure the (num_heads, page_size, dtype, split) variant exists and return the path of a shared
    library that holds it: the AOT library of `mla-variants build` when its manifest lists the variant,
    else the variant's build in the per-user cache (compiled now if it is not there: 15-20 s on 16
    cores, 25-55 s on 2, one line of progress on stderr; later calls and processes return at once).

    num_heads: 1 to 128; page_size: tokens per page, 1 to 1024; dtype: 'bf16', 'fp16', 'fp8_e4m3' or 'fp8_e4m3_fast' (the
    kv_cache dtype token of variants.yaml; 'fp8_e4m3_fast' at most 32 heads means the 'fp8_e4m3' variant, which such
    calls run) or torch.bfloat16 / float16 / float8_e4m3fn; split: whether the variant splits keys over CTAs (a split
    variant also serves unsplit calls; a call loads a cached nosplit variant too). Needs nvcc (CUDA
    12.8+) and the nvidia-cutlass headers, not a GPU. The cache folder is $MLA_VARIANTS_CACHE, else $XDG_CACHE_HOME/mla-variants, else
    ~/.cache/mla-variants. Works whatever MLA_VARIANTS_JIT says.

    Raises MLAInputError (a ValueError) for a variant outside those bounds and codegen.build.BuildError
    when it cannot be built (no nvcc, a compile error, a cache folder that cannot be written).
    """
    from codegen.config import MAX_NUM_HEADS, MAX_PAGE_SIZE
    from .validation import MLAInputError
    from codegen.variant import DTYPES
    for name, v, hi in (("num_heads", num_heads, MAX_NUM_HEADS), ("page_size", page_size, MAX_PAGE_SIZE)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise MLAInputError(f"{name}: expected an int from 1 to {hi}, got {v!r}")
    import torch
    if isinstance(dtype, torch.dtype):  # as is_supported and MLADecodePlan take it
        from .validation import DTYPE_TOKEN
        dtype = DTYPE_TOKEN.get(dtype, dtype)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MLAInputError(f"dtype: expected one of {', '.join(sorted(DTYPES))} (a variants.yaml dtype token), got {dtype!r}")
    if not isinstance(split, bool):
        raise MLAInputError(f"split: expected a bool, got {split!r}")
    from . import _binding
    from codegen.variant import call_dtype
    key = (num_heads, page_size, call_dtype(dtype, num_heads), split)  # the variant such a call runs
    aot = _binding.generated_dir()
    try:
        manifest = _binding.read_manifest(aot)
        if key in _binding.table_of(manifest) and (aot / manifest["library"]).is_file():
            return (aot / manifest["library"]).resolve()
    except _binding.LibraryNotBuiltError:
        pass
    gen = cached_build(*key)
    return (gen / _binding.read_manifest(gen)["library"]).resolve()
