"""The identity of one compiled kernel variant, and its path facts.

A variant is the tuple (num_heads, page_size, dtype, split). Its ``name`` is a pure function of those
fields and is the single string used for the generated file, the exported C symbol, the manifest
entry and the dispatch key; :meth:`Variant.from_name` parses it back.

:class:`PathFacts` says which kernels a variant runs (rows per CTA, its second kernel and when that one
runs, TMA, the balanced schedule). Computed here once per variant, the facts are rendered into the
variant's translation unit, where templates/mla/launch.cuh static_asserts them against the C++ traits
(templates/mla/config.cuh VariantTraits), and written into the build's manifest.json, which the Python
runtime reads: no other place derives them.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

#: dtype token in variants.yaml -> (C++ cache type of templates/mla/config.cuh CacheTypes, torch dtype name
#: of the kv_cache). bf16 and fp16 variants take q and write out in the cache's dtype; fp8_e4m3 variants
#: read a float8_e4m3fn cache with a per-tensor k_scale and take q / write out in bf16, multiplying in
#: fp16 on exactly widened values; fp8_e4m3_fast variants read the same cache with fp8 tensor-core math
#: (q and P rounded to e4m3; templates/mla/fp8_fast.cuh), chosen per call with fp8_mode="fast".
DTYPES: dict[str, tuple[str, str]] = {
    "bf16": ("cutlass::bfloat16_t", "bfloat16"),
    "fp16": ("cutlass::half_t", "float16"),
    "fp8_e4m3": ("cutlass::float_e4m3_t", "float8_e4m3fn"),
    "fp8_e4m3_fast": ("mla::Fp8FastCache", "float8_e4m3fn"),
}
FP8_FAST = "fp8_e4m3_fast"  # the fast-mode dtype token (fp8_mode="fast")

# The C++ policy values the facts depend on (templates/mla/config.cuh; the build checks they agree).
TILE_KEYS = 64                # kBlockN: keys per tile; splits hold whole tiles
ROWS_64 = 64                  # kBlockM: query rows per CTA of the 64-row path
ST_MAX_HEADS = 32             # kUseSt: at most this many heads run the transposed path
ST_MAX_ROWS = 32              # kStMaxRows: the largest row block of the transposed path (above: the 64-row kernel)
ST32_MIN_KEYS = 1024          # kSt32MinKeys: 17..32-head 16-bit launches with shorter splits run the 64-row kernel
FP8_SHORT_SPLIT_KEYS = 128    # kFp8ShortSplitKeys: fp8 64-row split launches with splits this short run 32-token tiles


def call_dtype(dtype: str, num_heads: int) -> str:
    """The dtype token of the variants that serve a call of `dtype` with num_heads heads: `dtype` itself,
    except that fp8_e4m3_fast (fp8_mode="fast") at most ST_MAX_HEADS heads runs the fp8_e4m3 variants:
    the transposed path has no fast kernel, and its exact one is faster there (docs/design.md 3.3).
    So no fp8_e4m3_fast variant of at most ST_MAX_HEADS heads is built (codegen.config) or dispatched to
    (mla_variants.dispatch, mla_variants.ensure_variant)."""
    return "fp8_e4m3" if dtype == FP8_FAST and num_heads <= ST_MAX_HEADS else dtype


@dataclass(frozen=True)
class PathFacts:
    """Which kernels a variant runs; the same fields, in order, as templates/mla/config.cuh PathFacts.

    rows_per_cta: query rows (q_len x heads) per CTA of the variant's own kernel: 8 / 16 / 32 on the
        transposed path (at most 32 heads), 64 on the 64-row path and for fp8_e4m3_fast variants at every
        head count (their one kernel, templates/mla/fp8_fast.cuh, masks the rows of missing heads).
    second_kernel: None, "short_split" (fp8 split variants of the 64-row path, exact and fast alike: the
        exact kernel with 32-token tiles; docs/design.md 3.3 for why fast variants run it) or "rows64"
        (transposed bf16/fp16 variants: the 64-row kernel); it runs instead of the own kernel when every
        split of a launch holds at most second_max_split_keys keys (0: never for that reason; 17..32-head
        bf16/fp16 variants run the 64-row kernel below ST32_MIN_KEYS) with second_rows_per_cta rows per
        CTA, and "rows64" also when rows_for gives 64 rows (a request of more than ST_MAX_ROWS rows).
    tma / second_tma: whether the own / second kernel loads full tiles by TMA (64-row kernels on pages
        that are multiples of 64).
    balanced_schedule: whether MLADecodePlan's balanced schedule can run (split variants of the 64-row
        path with a 16-bit cache, of the transposed path (one CTA per segment; not where a request's rows
        take a transposed 16-bit variant's 64-row second kernel, `balances`), and split fp8_e4m3_fast
        variants: the fast kernel's scheduled instantiation; exact fp8 variants of the 64-row path have none).
    tile_keys: keys per tile (splits are whole tiles).
    max_rows_per_cta: the largest row block of a launch (64; 32 for transposed fp8 variants): a launch
        with q_len > 1 takes the smallest of rows_per_cta, 2 x, 4 x ... up to it that holds the request's
        q_len x num_heads rows (rows_for), so they share one read of the keys; 8-32 rows run the transposed
        kernels, 64 the 64-row one (a transposed bf16/fp16 variant's second kernel).
    segment_ctas: whether the own kernel's scheduled form runs one CTA per entry of the schedule's
        segment table (the transposed kernels of a balanced variant) rather than one per run of segments
        (the 64-row and fast kernels); the schedule kernel writes that table only for these (runs_segments).
    """

    rows_per_cta: int
    second_kernel: str | None
    second_max_split_keys: int
    tma: bool
    second_tma: bool
    balanced_schedule: bool
    tile_keys: int = TILE_KEYS
    second_rows_per_cta: int = ROWS_64
    max_rows_per_cta: int = ROWS_64
    segment_ctas: bool = False

    @classmethod
    def of(cls, num_heads: int, page_size: int, dtype: str, split: bool) -> "PathFacts":
        if dtype == FP8_FAST:  # the fast kernel: 64 rows, TMA pages, balanced schedule; short splits run the exact one
            return cls(rows_per_cta=ROWS_64, second_kernel="short_split" if split else None,
                       second_max_split_keys=FP8_SHORT_SPLIT_KEYS if split else 0,
                       tma=page_size % TILE_KEYS == 0, second_tma=False, balanced_schedule=split)
        fp8 = dtype == "fp8_e4m3"
        transposed = num_heads <= ST_MAX_HEADS
        rows = (8 if num_heads <= 8 else 16 if num_heads <= 16 else 32) if transposed else ROWS_64
        second = ("rows64" if transposed and not fp8 else "short_split" if fp8 and split and not transposed
                  else None)
        max_keys = (FP8_SHORT_SPLIT_KEYS if second == "short_split"
                    else ST32_MIN_KEYS - TILE_KEYS if second == "rows64" and rows == 32 else 0)
        tma_pages = page_size % TILE_KEYS == 0
        return cls(rows_per_cta=rows, second_kernel=second, second_max_split_keys=max_keys,
                   tma=tma_pages and rows == ROWS_64, second_tma=second == "rows64" and tma_pages,
                   balanced_schedule=split and (transposed or not fp8),
                   max_rows_per_cta=ST_MAX_ROWS if transposed and fp8 else ROWS_64,
                   segment_ctas=split and transposed)

    @classmethod
    def from_json(cls, d: dict) -> "PathFacts":
        """The facts as the manifest records them (to_json), read back by the runtime."""
        return cls(**{name: d[name] for name in cls.__dataclass_fields__})

    def max_split_keys(self, max_seq_len: int, num_kv_splits: int) -> int:
        """The most keys one split of a launch can get: whole tiles per split for the longest request
        (launch.cuh max_split_keys; max_seq_len is the call's bound, at most the block table's capacity)."""
        tiles = -(-max_seq_len // self.tile_keys)
        return -(-tiles // num_kv_splits) * self.tile_keys

    def runs_second(self, max_seq_len: int, num_kv_splits: int) -> bool:
        """Whether a launch with this bound and split count runs the second kernel (launch.cuh)."""
        return self.second_max_split_keys > 0 and self.max_split_keys(max_seq_len, num_kv_splits) <= self.second_max_split_keys

    def rows_for(self, q_rows: int) -> int:
        """Rows per CTA of the own kernel for q_rows = q_len x the variant's num_heads rows per request
        (config.cuh rows_for): the smallest of rows_per_cta, 2 x, 4 x ... that holds them, at most
        max_rows_per_cta."""
        rows = self.rows_per_cta
        while rows < q_rows and rows < self.max_rows_per_cta:
            rows *= 2
        return rows

    def launch_rows(self, max_seq_len: int, num_kv_splits: int, q_rows: int = 1) -> int:
        """Query rows per CTA of the kernel such a launch runs (q_rows: q_len x the variant's num_heads); 64
        on a transposed variant is its second kernel."""
        return self.second_rows_per_cta if self.runs_second(max_seq_len, num_kv_splits) else self.rows_for(q_rows)

    def balances(self, q_rows: int) -> bool:
        """Whether a balanced schedule can run for requests of q_rows = q_len x the variant's num_heads rows:
        balanced_schedule, and the launch's kernel has a scheduled form (not the 64-row second kernel of a
        transposed 16-bit variant, which rows_for picks for more than ST_MAX_ROWS rows)."""
        return self.balanced_schedule and (self.rows_per_cta == ROWS_64 or self.rows_for(q_rows) < ROWS_64)

    def runs_segments(self, q_rows: int) -> bool:
        """Whether a balanced launch for requests of q_rows rows runs one CTA per entry of the schedule's
        segment table (segment_ctas), so the schedule kernel must write that table."""
        return self.balances(q_rows) and self.segment_ctas

    def cpp(self) -> str:
        """The facts as the C++ type launch.cuh checks (mla::PathFacts<...>)."""
        kind = {None: "kNone", "short_split": "kShortSplit", "rows64": "kRows64"}[self.second_kernel]
        b = lambda v: "true" if v else "false"  # noqa: E731
        return (f"mla::PathFacts<{self.rows_per_cta}, mla::SecondKernel::{kind}, {self.second_max_split_keys}, "
                f"{b(self.tma)}, {b(self.second_tma)}, {b(self.balanced_schedule)}, {self.tile_keys}, "
                f"{self.second_rows_per_cta}, {self.max_rows_per_cta}, {b(self.segment_ctas)}>")

    def to_json(self) -> dict:
        return asdict(self)


_NAME_RE = re.compile(r"^mla_decode_h(?P<h>[1-9][0-9]*)_p(?P<p>[1-9][0-9]*)_(?P<d>[a-z0-9]+(?:_[a-z0-9]+)*?)_(?P<s>split|nosplit)$")


@dataclass(frozen=True, order=True)
class Variant:
    """One (num_heads, page_size, dtype, split) kernel.

    num_heads: query heads the kernel is compiled for; calls with fewer heads mask the extra rows.
    page_size: KV-cache tokens per page (compile-time divisor of the block_table lookup).
    dtype: "bf16" or "fp16" (q, kv_cache and out share it), or "fp8_e4m3" / "fp8_e4m3_fast" (float8_e4m3fn
        kv_cache with a per-tensor k_scale; q and out bf16; exact fp16 math or fp8 tensor-core math).
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
    def facts(self) -> PathFacts:
        return PathFacts.of(self.num_heads, self.page_size, self.dtype, self.split)

    @property
    def path(self) -> str:
        """The kernel path of the variant's own kernel: "transposed" (at most 32 heads) or "rows64" (more
        heads, and every fp8_e4m3_fast variant, whose one kernel has 64 rows at any head count)."""
        return "rows64" if self.facts.rows_per_cta == ROWS_64 else "transposed"

    @property
    def units(self) -> tuple[tuple[str, str], ...]:
        """The variant's generated translation units as (file relative to generated/variants, template in
        templates/): ``<name>.cu`` (its launcher and own kernels) from variant.cu.j2 and, for a variant
        with a second kernel (:class:`PathFacts`), ``<name>_second.cu`` from variant_second.cu.j2."""
        own = (f"{self.name}.cu", "variant.cu.j2")
        if self.facts.second_kernel is not None:
            return (own, (f"{self.name}_second.cu", "variant_second.cu.j2"))
        return (own,)

    @property
    def sources(self) -> tuple[str, ...]:
        """The files of :attr:`units`."""
        return tuple(f for f, _ in self.units)

    @classmethod
    def from_name(cls, name: str) -> "Variant":
        """Parse a name produced by :attr:`name`; raises ValueError for anything else."""
        m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None  # fullmatch: no trailing newline
        if m is None or m.group("d") not in DTYPES:
            raise ValueError(
                f"variant name: expected 'mla_decode_h<num_heads>_p<page_size>_<{'|'.join(sorted(DTYPES))}>_<split|nosplit>', "
                f"got {name!r}"
            )
        return cls(int(m.group("h")), int(m.group("p")), m.group("d"), m.group("s") == "split")
