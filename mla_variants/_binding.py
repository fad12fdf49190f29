"""The only place that touches the compiled library: locate the generated dispatch table, load the
shared library once through ctypes, and call a launcher with an ``MlaDecodeArgs`` struct
(templates/mla/abi.h: raw pointers, int64 strides and sizes, the CUDA stream)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
import threading
from pathlib import Path

ABI_VERSION = 4  # must equal MLA_ABI_VERSION in templates/mla/abi.h

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
        ("schedule", _vp), ("sched_ctas", _i32),
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
    """No dispatch table or library was found: run ``mla-variants build`` first."""


def generated_dir() -> Path:
    """Where the dispatch table lives: $MLA_VARIANTS_GENERATED, else <repository>/generated."""
    env = os.environ.get("MLA_VARIANTS_GENERATED")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "generated"


def read_dispatch_table(gen_dir: Path):
    """The generated dispatch.py of `gen_dir` as a module (VARIANTS: key -> symbol, LIBRARY, ARCH,
    INPUTS_HASH), without loading the library. Raises LibraryNotBuiltError if there is none."""
    table = gen_dir / "dispatch.py"
    if not table.is_file():
        if os.environ.get("MLA_VARIANTS_GENERATED"):  # a folder the caller chose: build into it
            raise LibraryNotBuiltError(
                f"no dispatch table at {table} (MLA_VARIANTS_GENERATED): build into that folder with "
                f"`mla-variants build --generated-dir {gen_dir}` (and a --build-dir of your choice), or unset "
                f"MLA_VARIANTS_GENERATED to use the repository's generated/")
        raise LibraryNotBuiltError(
            f"no dispatch table at {table}: build the kernels first with `mla-variants build` "
            f"(or point MLA_VARIANTS_GENERATED at a generated/ folder)")
    spec = importlib.util.spec_from_file_location("mla_variants_dispatch_table", table)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Library:
    """A loaded build: the dispatch table (key -> symbol) and the ctypes launchers."""

    def __init__(self, gen_dir: Path):
        table = gen_dir / "dispatch.py"
        module = read_dispatch_table(gen_dir)
        self.table: dict[tuple[int, int, str, bool], str] = dict(module.VARIANTS)
        self.path = (gen_dir / module.LIBRARY).resolve()
        if not self.path.is_file():
            raise LibraryNotBuiltError(f"the dispatch table names {self.path}, which does not exist: run `mla-variants build`")
        self.cdll = ctypes.CDLL(str(self.path))
        self.cdll.mla_variants_abi_version.restype = ctypes.c_int
        self.cdll.mla_variants_error_string.restype = ctypes.c_char_p
        self.cdll.mla_variants_error_string.argtypes = [ctypes.c_int]
        got = self.cdll.mla_variants_abi_version()
        if got != ABI_VERSION:
            raise LibraryNotBuiltError(f"{self.path} has ABI version {got}, this package expects {ABI_VERSION}: rebuild")
        self._plans: dict = {}  # memo of plan(); derived from table, so reset whenever table changes
        self._launchers: dict[str, ctypes._CFuncPtr] = {}
        for name in self.table.values():
            try:
                fn = getattr(self.cdll, name)
            except AttributeError:
                raise LibraryNotBuiltError(
                    f"{self.path} does not export {name}, which {table} lists: the build is stale, "
                    f"run `mla-variants build`") from None
            fn.argtypes = [ctypes.c_char_p]  # a pack_args() buffer (or bytes(MlaDecodeArgs(...)))
            fn.restype = ctypes.c_int
            self._launchers[name] = fn
        # The balanced schedule's kernel (templates/mla/schedule.cu), one per library.
        self.cdll.mla_variants_schedule.argtypes = [_vp, _i32, _i64, _i32, _i32, _i32, _vp, _vp]
        self.cdll.mla_variants_schedule.restype = ctypes.c_int
        for name in ("mla_variants_schedule_ints", "mla_variants_schedule_kind_offset"):
            getattr(self.cdll, name).argtypes = [_i32, _i32]
            getattr(self.cdll, name).restype = _i64

    def plan(self, num_heads: int, page_size: int, dtype: str, split: bool):
        """dispatch.plan_launches on this library's table, memoized (the table is fixed once loaded)."""
        key = (num_heads, page_size, dtype, split)
        got = self._plans.get(key)
        if got is None:
            from .dispatch import plan_launches
            got = self._plans[key] = plan_launches(self.table, *key)
        return got

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
