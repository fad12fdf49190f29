"""Variant choice: which compiled launcher serves a call, as a pure function of the dispatch table
(the build's manifest: (num_heads, page_size, dtype, split) -> launcher symbol, and each variant's facts).

Rule (docs/design.md section 8): page_size and dtype must match a compiled variant exactly (dtype as
codegen.variant.call_dtype maps it: fp8_e4m3_fast calls of at most 32 heads run fp8_e4m3). num_heads is
served by the exact compiled head count if there is one, else by the smallest compiled count above
it with the extra rows masked; more heads than the largest compiled count are cut into head groups
of that size, each launched separately. Split-KV calls (num_kv_splits > 1) need a split variant.
For unsplit calls the head count (and the head-group size) is chosen over nosplit and split variants
alike; at that head count the nosplit variant is preferred, else the split one runs with one split
(the default build has nosplit variants only where they measured faster: variants.yaml's exclude
rules).
"""
from __future__ import annotations

from dataclasses import dataclass

# Which kernels a variant runs: codegen computes the facts once and writes them into the manifest; the
# runtime reads them back into the same record (PathFacts.from_json) and never derives them.
from codegen.variant import PathFacts, call_dtype

Key = tuple[int, int, str, bool]  # (num_heads, page_size, dtype, split)


class VariantNotCompiledError(LookupError):
    """No compiled variant can serve the call; the message names the nearest compiled variants and
    the variants.yaml change that would add one. `request` is the call's (num_heads, page_size, dtype,
    split), or None."""

    def __init__(self, message: str, request: tuple[int, int, str, bool] | None = None):
        super().__init__(message)
        self.request = request


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: heads [head_start, head_start + num_heads) on variant `key`, whose
    path facts are `facts` (None in a table without them)."""

    key: Key
    symbol: str
    head_start: int
    num_heads: int
    facts: PathFacts | None = None


def _nearest(table: dict[Key, str], num_heads: int, page_size: int, dtype: str, split: bool) -> str:
    ranked = sorted(table, key=lambda k: (k[1] != page_size, k[2] != dtype, k[3] != split, abs(k[0] - num_heads), k))
    return ", ".join(table[k] for k in ranked[:3]) or "none (the library is empty)"


def _missing(table: dict[Key, str], num_heads: int, page_size: int, dtype: str, split: bool, why: str) -> VariantNotCompiledError:
    from codegen.config import MAX_PAGE_SIZE
    if why == "page_size" and isinstance(page_size, int) and page_size > MAX_PAGE_SIZE:
        return VariantNotCompiledError(
            f"no MLA decode variant can have page_size={page_size}: variants.yaml takes page sizes up to "
            f"{MAX_PAGE_SIZE}. Nearest compiled: {_nearest(table, num_heads, page_size, dtype, split)}. Use pages of "
            f"at most {MAX_PAGE_SIZE} tokens (the cache's [num_pages, page_size, 576] layout and block_table follow).",
            (num_heads, page_size, dtype, split))
    axis_fix = {
        "page_size": f"add {page_size} to axes.page_size",
        "dtype": f"add {dtype} to axes.dtype",
        "split": f"add {str(split).lower()} to axes.split",
    }[why]
    return VariantNotCompiledError(
        f"no compiled MLA decode variant for num_heads={num_heads}, page_size={page_size}, dtype={dtype}, "
        f"split={str(split).lower()} (no {why} match). Nearest compiled: {_nearest(table, num_heads, page_size, dtype, split)}. "
        f"To add it: {axis_fix} in variants.yaml (if it is there already, the last build selected fewer "
        f"variants with --preset/--filter, or a rule under exclude: leaves it out) and run `mla-variants build`, "
        f"or compile it into the per-user cache: mla_variants.ensure_variant({min(num_heads, 128)}, {page_size}, "
        f"{dtype!r}, True) (JIT does that on a call's first use unless MLA_VARIANTS_JIT=0).",
        (num_heads, page_size, dtype, split))


def plan_launches(table: dict[Key, str], num_heads: int, page_size: int, dtype: str, split: bool) -> list[Launch]:
    """The launches that serve a call with `num_heads` heads; raises VariantNotCompiledError."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
    dtype = call_dtype(dtype, num_heads)  # fp8_e4m3_fast at most 32 heads runs the fp8_e4m3 variants
    # The head count decides first (it picks the tile), the split kind second: an unsplit call takes the
    # nosplit variant of the chosen head count if there is one, else that count's split variant (run with
    # one split), never a nosplit variant of a larger head count over its own count's split variant.
    kinds = (True,) if split else (False, True)
    usable = {k for k in table if k[1] == page_size and k[2] == dtype and k[3] in kinds
              and isinstance(k[0], int) and not isinstance(k[0], bool) and k[0] >= 1}
    heads = sorted({k[0] for k in usable})
    if heads:
        launches, start = [], 0
        while start < num_heads:
            n = min(num_heads - start, heads[-1])
            h = next(x for x in heads if x >= n)  # exact if compiled, else the smallest above
            key = next((h, page_size, dtype, s) for s in kinds if (h, page_size, dtype, s) in usable)
            launches.append(Launch(key, table[key], start, n))
            start += n
        return launches
    if not any(k[1] == page_size for k in table):
        why = "page_size"
    elif not any(k[1] == page_size and k[2] == dtype for k in table):
        why = "dtype"
    else:
        why = "split"
    raise _missing(table, num_heads, page_size, dtype, split, why)


def is_supported(table: dict[Key, str], num_heads: int, page_size: int, dtype: str, split: bool = False) -> bool:
    try:
        plan_launches(table, num_heads, page_size, dtype, split)
        return True
    except (VariantNotCompiledError, ValueError):
        return False
