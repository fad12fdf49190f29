"""The only place that touches the compiled library: read the build's manifest (generated/manifest.json:
the variants, their launcher symbols and path facts, the library's path), load the shared library once
through ctypes, and call a launcher with an ``MlaDecodeArgs`` struct (templates/mla/abi.h: raw
pointers, int64 strides and sizes, the CUDA stream)."""
from __future__ import annotations

import ctypes
import os
import struct
import threading
import warnings
from pathlib import Path

ABI_VERSION = 7  # must equal MLA_ABI_VERSION in templates/mla/abi.h

# MlaDecodeArgs.tma_mode (abi.h MlaTmaMode): how full KV tiles on TMA pages are loaded.
TMA_MODES = {"auto": 0, "off": 1, "require": 2}

_i32, _i64, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class MlaDecodeArgs(ctypes.Structure):
    """Mirror of the C struct MlaDecodeArgs in templates/mla/abi.h (same field order and types)."""

    _fields_ = [
        ("abi_version", _i32), ("batch", _i32), ("q_len", _i32), ("num_heads", _i32),
        ("max_pages_per_seq", _i32), ("num_kv_splits", _i32), ("max_seq_len", _i32),
        ("q_nope", _vp), ("q_nope_stride_batch", _i64), ("q_nope_stride_token", _i64), ("q_nope_stride_head", _i64),
        ("q_pe", _vp), ("q_pe_stride_batch", _i64), ("q_pe_stride_token", _i64), ("q_pe_stride_head", _i64),
        ("kv_cache", _vp), ("kv_stride_page", _i64), ("kv_stride_token", _i64),
        ("k_scale", _f32), ("k_scale_ptr", _vp),
        ("block_table", _vp), ("block_table_stride", _i64), ("seq_lens", _vp),
        ("softmax_scale", _f32),
        ("out", _vp), ("out_stride_batch", _i64), ("out_stride_token", _i64), ("out_stride_head", _i64),
        ("lse", _vp), ("lse_stride_batch", _i64), ("lse_stride_head", _i64), ("lse_stride_token", _i64),
        ("workspace", _vp), ("workspace_bytes", _i64),
        ("schedule", _vp), ("sched_ctas", _i32), ("total_q_tokens", _i32), ("query_start_loc", _vp),
        ("tma_mode", _i32),
        ("stream", _vp),
    ]


# The same struct as bytes: struct.pack with native alignment lays fields out as the C compiler does,
# and packing is several times faster than filling a ctypes.Structure on every call.
_CODES = {_i32: "i", _i64: "q", _vp: "Q", _f32: "f"}
_PACKER = struct.Struct("@" + "".join(_CODES[t] for _, t in MlaDecodeArgs._fields_))
assert _PACKER.size == ctypes.sizeof(MlaDecodeArgs), "MlaDecodeArgs packing disagrees with ctypes"
assert MlaDecodeArgs.stream.offset == _PACKER.size - 8, "stream must be the last field (BoundDecode relies on it)"


def pack_args(*fields) -> bytes:
    """MlaDecodeArgs as bytes: every field after abi_version, in declaration order (pointers as ints)."""
    return _PACKER.pack(ABI_VERSION, *fields)


class LibraryNotBuiltError(RuntimeError):
    """No manifest or library was found: run ``mla-variants build`` first."""


def generated_dir() -> Path:
    """Where the manifest of `mla-variants build` lives (codegen.paths.default_generated_dir):
    $MLA_VARIANTS_GENERATED (~ expanded), else <checkout>/generated, else <cache>/aot/generated."""
    from codegen.paths import default_generated_dir
    return default_generated_dir()


def read_manifest(gen_dir: Path) -> dict:
    """The build's manifest.json in `gen_dir` (written by `mla-variants build` once the library linked),
    without loading the library. Raises LibraryNotBuiltError if there is none."""
    path = gen_dir / "manifest.json"
    if not path.is_file():
        if os.environ.get("MLA_VARIANTS_GENERATED"):  # a folder the caller chose: build into it
            raise LibraryNotBuiltError(
                f"no manifest at {path} (MLA_VARIANTS_GENERATED): build into that folder with "
                f"`mla-variants build --generated-dir {gen_dir}` (and a --build-dir of your choice), or unset "
                f"MLA_VARIANTS_GENERATED to use the repository's generated/")
        raise LibraryNotBuiltError(
            f"no manifest at {path}: build the kernels first with `mla-variants build` "
            f"(or point MLA_VARIANTS_GENERATED at a generated/ folder)")
    from codegen.manifest import ManifestError, load_manifest
    try:
        return load_manifest(path)
    except ManifestError as e:
        raise LibraryNotBuiltError(str(e)) from None


def table_of(manifest: dict) -> dict[tuple[int, int, str, bool], str]:
    """The manifest's dispatch table: (num_heads, page_size, dtype, split) -> launcher symbol."""
    return {(e["num_heads"], e["page_size"], e["dtype"], e["split"]): e["name"] for e in manifest["variants"]}


class _Part:
    """One loaded shared library: the AOT build's, or a variant's JIT build from the cache."""

    def __init__(self, gen_dir: Path):
        from .dispatch import PathFacts
        self.manifest_path = gen_dir / "manifest.json"
        manifest = read_manifest(gen_dir)
        self.table = table_of(manifest)
        self.facts = {(e["num_heads"], e["page_size"], e["dtype"], e["split"]): PathFacts.from_json(e["facts"])
                      for e in manifest["variants"]}
        self.path = (gen_dir / manifest["library"]).resolve()
        if not self.path.is_file():
            raise LibraryNotBuiltError(f"the manifest names {self.path}, which is not a file: run `mla-variants build`")
        try:
            self.cdll = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise LibraryNotBuiltError(f"{self.path} (named by the manifest) does not load ({e}): run "
                                       f"`mla-variants build`") from None
        self.cdll.mla_variants_abi_version.restype = ctypes.c_int
        self.cdll.mla_variants_error_string.restype = ctypes.c_char_p
        self.cdll.mla_variants_error_string.argtypes = [ctypes.c_int]
        got = self.cdll.mla_variants_abi_version()
        if got != ABI_VERSION:
            raise LibraryNotBuiltError(f"{self.path} has ABI version {got}, this package expects {ABI_VERSION}: rebuild")
        self.launchers: dict[str, ctypes._CFuncPtr] = {}
        for name in self.table.values():
            try:
                fn = getattr(self.cdll, name)
            except AttributeError:
                raise LibraryNotBuiltError(
                    f"{self.path} does not export {name}, which {self.manifest_path} lists: the build is "
                    f"stale, run `mla-variants build`") from None
            fn.argtypes = [ctypes.c_char_p]  # a pack_args() buffer (or bytes(MlaDecodeArgs(...)))
            fn.restype = ctypes.c_int
            self.launchers[name] = fn
        # The balanced schedule's kernel (templates/mla/schedule.cu), one per library.
        self.cdll.mla_variants_schedule.argtypes = [_vp, _i32, _i64, _i32, _i32, _i32, _i32, _vp, _vp]
        self.cdll.mla_variants_schedule.restype = ctypes.c_int
        for name in ("mla_variants_schedule_ints", "mla_variants_schedule_kind_offset"):
            getattr(self.cdll, name).argtypes = [_i32, _i32]
            getattr(self.cdll, name).restype = _i64
        self.cdll.mla_variants_schedule_model.argtypes = [ctypes.POINTER(_f32), ctypes.POINTER(_f32)]
        self.cdll.mla_variants_schedule_model.restype = None


class Library:
    """The loaded builds: the AOT library of `mla-variants build` (if any) and the variants compiled on
    first use (mla_variants/jit.py), merged into one dispatch table (key -> symbol), each variant's path
    facts, and the ctypes launchers."""

    def __init__(self, gen_dir: Path):
        from . import jit
        self.table: dict[tuple[int, int, str, bool], str] = {}
        self.facts: dict = {}
        self._parts: list[_Part] = []
        self._launchers: dict[str, ctypes._CFuncPtr] = {}
        self._plans: dict = {}  # memo of plan(); derived from table, so reset whenever table changes
        self._jit_lock = threading.Lock()
        self._jit_failed: dict[tuple[int, int, str], str] = {}  # (num_heads, page_size, dtype) -> why
        try:
            self.add(gen_dir)
        except LibraryNotBuiltError:
            # With JIT, a machine without an AOT build compiles each variant on first use; a library
            # that exists but does not load is an error either way.
            if not jit.enabled() or (gen_dir / "manifest.json").is_file():
                raise

    def add(self, gen_dir: Path) -> None:
        """Load the build whose manifest is in `gen_dir` beside those already loaded."""
        part = _Part(gen_dir)
        self._parts.append(part)
        self._launchers.update(part.launchers)
        self.facts.update(part.facts)
        self.table.update(part.table)
        self._plans.clear()

    @property
    def cdll(self) -> ctypes.CDLL:
        """The first loaded library (its exports: error strings, the balanced schedule)."""
        if not self._parts:
            raise LibraryNotBuiltError("no variant is built yet: call a kernel (JIT builds it) or run `mla-variants build`")
        return self._parts[0].cdll

    def schedule_model(self) -> tuple[float, float]:
        """The balanced schedule's cost model as compiled (templates/mla/config.cuh): (piece cost in
        tiles, balanced margin)."""
        piece, margin = _f32(), _f32()
        self.cdll.mla_variants_schedule_model(ctypes.byref(piece), ctypes.byref(margin))
        return piece.value, margin.value

    def plan(self, num_heads: int, page_size: int, dtype: str, split: bool):
        """dispatch.plan_launches on this library's table, each launch with its variant's facts; memoized
        (the table is fixed once loaded). dtype is mapped as dispatch maps it (codegen.variant.call_dtype)
        before anything is looked up or compiled on first use."""
        if isinstance(num_heads, int) and not isinstance(num_heads, bool):
            from codegen.variant import call_dtype
            dtype = call_dtype(dtype, num_heads)
        key = (num_heads, page_size, dtype, split)
        got = self._plans.get(key)
        if got is None:
            import dataclasses
            from .dispatch import VariantNotCompiledError, plan_launches
            self._jit_if_missing(*key)
            try:
                launches = plan_launches(self.table, *key)
            except VariantNotCompiledError as e:
                from .jit import MAX_JIT_HEADS
                failed = self._jit_failed.get((min(key[0], MAX_JIT_HEADS), key[1], key[2]))
                if failed is None:
                    raise
                raise VariantNotCompiledError(f"{e} The JIT build of the variant failed: {failed}", e.request) from None
            got = self._plans[key] = [dataclasses.replace(l, facts=self.facts.get(l.key)) for l in launches]
        return got

    def _jit_if_missing(self, num_heads: int, page_size: int, dtype: str, split: bool) -> None:
        """Compile (or load from the cache) the split variant of exactly `num_heads` heads when no
        loaded variant of that head count serves the call and JIT is on (mla_variants/jit.py). Above
        128 heads (head groups), the 128-head variant, when no loaded variant serves the call at all."""
        from . import jit
        if not jit.enabled() or isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            return
        kinds = (True,) if split else (False, True)
        if num_heads > jit.MAX_JIT_HEADS:
            if any(k[1:3] == (page_size, dtype) and k[3] in kinds for k in self.table):
                return  # head groups of the largest loaded head count serve it
            num_heads = jit.MAX_JIT_HEADS
        if any((num_heads, page_size, dtype, s) in self.table for s in kinds):
            return
        from codegen.variant import DTYPES
        from codegen.config import MAX_PAGE_SIZE
        if dtype not in DTYPES or isinstance(page_size, bool) or not 1 <= page_size <= MAX_PAGE_SIZE:
            return  # plan_launches says what is wrong
        with self._jit_lock:
            if any((num_heads, page_size, dtype, s) in self.table for s in kinds) or (num_heads, page_size, dtype) in self._jit_failed:
                return
            try:
                # A cached entry of a kind that serves the call (ensure_variant may have built the nosplit
                # one), else the split variant, compiled now.
                gen = next((g for s in kinds if (g := jit.cached(num_heads, page_size, dtype, s)) is not None), None)
                self.add(gen if gen is not None else jit.cached_build(num_heads, page_size, dtype, True))
            except Exception as e:  # BuildError, an unwritable cache, a lock timeout, a library that does not load
                # Tried once per process: the call runs on what is loaded (a larger head count, masked)
                # if anything serves it, and says why otherwise.
                why = " ".join(str(e).split())
                why = f"{type(e).__name__}: {why[:600]}{' ...' if len(why) > 600 else ''}"
                self._jit_failed[(num_heads, page_size, dtype)] = why
                warnings.warn(f"mla_variants: the JIT build of the {num_heads}-head variant (page_size {page_size}, "
                              f"{dtype}) failed, so calls use the loaded variants only. {why}", RuntimeWarning, stacklevel=2)

    def launch(self, symbol: str, args: bytes) -> None:
        """Call a launcher with a packed MlaDecodeArgs; raises RuntimeError with the CUDA error string."""
        code = self._launchers[symbol](args)
        if code != 0:
            self.raise_for(code, symbol)

    def launcher(self, symbol: str):
        """The ctypes function of one variant (takes a packed MlaDecodeArgs, returns a CUDA error code)."""
        return self._launchers[symbol]

    def raise_for(self, code: int, what: str) -> None:
        msg = self.cdll.mla_variants_error_string(code).decode()
        raise RuntimeError(f"{what} failed with CUDA error {code}: {msg}")


_lock = threading.Lock()
_library: Library | None = None


def library() -> Library:
    """The process-wide library, loaded on first use (thread-safe); later calls cost one attribute read."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = Library(generated_dir())
    return _library
