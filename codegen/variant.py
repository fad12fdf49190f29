"""The identity of one compiled kernel variant.

A variant is the tuple (num_heads, page_size, dtype, split). Its ``name`` is a pure function of those
fields and is the single string used for the generated file, the exported C symbol, the manifest
entry and the dispatch key; :meth:`Variant.from_name` parses it back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: dtype token in variants.yaml -> (C++ kv_cache element type, torch dtype name of the kv_cache).
#: bf16 and fp16 variants take q and write out in the cache's dtype; fp8_e4m3 variants read a
#: float8_e4m3fn cache with a per-tensor k_scale and take q / write out in bf16.
DTYPES: dict[str, tuple[str, str]] = {
    "bf16": ("cutlass::bfloat16_t", "bfloat16"),
    "fp16": ("cutlass::half_t", "float16"),
    "fp8_e4m3": ("cutlass::float_e4m3_t", "float8_e4m3fn"),
}

_NAME_RE = re.compile(r"^mla_decode_h(?P<h>[1-9][0-9]*)_p(?P<p>[1-9][0-9]*)_(?P<d>[a-z0-9]+(?:_[a-z0-9]+)*?)_(?P<s>split|nosplit)$")


@dataclass(frozen=True, order=True)
class Variant:
    """One (num_heads, page_size, dtype, split) kernel.

    num_heads: query heads the kernel is compiled for; calls with fewer heads mask the extra rows.
    page_size: KV-cache tokens per page (compile-time divisor of the block_table lookup).
    dtype: "bf16" or "fp16" (q, kv_cache and out share it), or "fp8_e4m3" (float8_e4m3fn kv_cache with a
        per-tensor k_scale; q and out bf16).
    split: True when the kernel writes split-KV partials to a workspace and a combine kernel merges
        them; False when it writes out/lse directly (num_kv_splits must be 1).
    """

    num_heads: int
    page_size: int
    dtype: str
    split: bool

    def __post_init__(self) -> None:
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads < 1:
            raise ValueError(f"Variant.num_heads: expected a positive int, got {self.num_heads!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"Variant.page_size: expected a positive int, got {self.page_size!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Variant.dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.split, bool):
            raise ValueError(f"Variant.split: expected a bool, got {self.split!r}")

    @property
    def name(self) -> str:
        split = "split" if self.split else "nosplit"
        return f"mla_decode_h{self.num_heads}_p{self.page_size}_{self.dtype}_{split}"

    @property
    def key(self) -> tuple[int, int, str, bool]:
        """The dispatch-table key."""
        return (self.num_heads, self.page_size, self.dtype, self.split)

    @property
    def cpp_type(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def units(self) -> tuple[tuple[str, str], ...]:
        """The variant's generated translation units as (file relative to generated/variants, template in
        templates/): ``<name>.cu`` (its launcher and own kernels) from variant.cu.j2 and, for fp8 split
        variants, ``<name>_short.cu`` (the short-split kernel, templates/mla/short_split.cuh), for bf16 /
        fp16 variants of 17..32 heads ``<name>_rows64.cu`` (their 64-row kernel beside the transposed
        one, templates/mla/rows64.cuh). A second unit compiles to an unused stub where launch.cuh's
        kHasShortKernel / kHasRows64Kernel is false (e.g. built with -DMLA_ST32=0)."""
        own = (f"{self.name}.cu", "variant.cu.j2")
        if self.dtype == "fp8_e4m3" and self.split:
            return (own, (f"{self.name}_short.cu", "variant_short.cu.j2"))
        if self.dtype != "fp8_e4m3" and 16 < self.num_heads <= 32:
            return (own, (f"{self.name}_rows64.cu", "variant_rows64.cu.j2"))
        return (own,)

    @property
    def sources(self) -> tuple[str, ...]:
        """The files of :attr:`units`."""
        return tuple(f for f, _ in self.units)

    @classmethod
    def from_name(cls, name: str) -> "Variant":
        """Parse a name produced by :attr:`name`; raises ValueError for anything else."""
        m = _NAME_RE.match(name)
        if m is None or m.group("d") not in DTYPES:
            raise ValueError(
                f"variant name: expected 'mla_decode_h<num_heads>_p<page_size>_<{'|'.join(sorted(DTYPES))}>_<split|nosplit>', "
                f"got {name!r}"
            )
        return cls(int(m.group("h")), int(m.group("p")), m.group("d"), m.group("s") == "split")
