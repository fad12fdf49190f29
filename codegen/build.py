"""Configure and run the CMake + ninja build of the rendered variants.

Records nvcc's resource usage (registers, stack, spills) per variant in <build>/resource_usage.json
and fails, naming the variant, when a kernel spills registers to local memory or ptxas serializes its
wgmma pipeline (notes C7511 / C7515).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import project_dir, templates_dir
from .render import cudaflags, write_if_changed
from .variant import FP8_FAST, Variant

LIBRARY_NAME = "libmla_variants.so"


class BuildError(RuntimeError):
    """The build could not run or a variant failed to compile; the message says which and why."""


def cutlass_include_dir() -> Path:
    """The CUTLASS/CuTe headers shipped in the nvidia-cutlass wheel (cutlass_library/source/include)."""
    import importlib.util

    # find the package without importing it (its __init__ pulls in optional Python dependencies)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the nvidia-cutlass package is not installed: pip install nvidia-cutlass==4.2.0.0")
    inc = Path(list(spec.submodule_search_locations)[0]).resolve() / "source" / "include"
    if not (inc / "cute" / "tensor.hpp").is_file():
        raise BuildError(f"nvidia-cutlass is installed but has no CuTe headers under {inc}")
    return inc


def _tool(module: str, exe: str) -> str:
    try:
        mod = __import__(module)
        path = Path(mod.BIN_DIR if module == "ninja" else mod.CMAKE_BIN_DIR) / exe
        if path.is_file():
            return str(path)
    except (ImportError, AttributeError):
        pass
    found = shutil.which(exe)
    if found is None:
        raise BuildError(f"{exe} not found: pip install {module}")
    return found


def find_nvcc() -> str:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    raise BuildError("nvcc not found: install the CUDA toolkit (12.8 or newer) or set CUDACXX")


# ptxas -v lines, e.g. "Compiling entry function '_ZN3mla17mla_decode_kernelIN7cutlass10bfloat16_tELi16ELi64ELb1EEE...'"
# or, for an fp8_e4m3_fast variant, '_ZN3mla4fast26mla_decode_fp8_fast_kernelILi128ELi64ELb1EEE...'
_ENTRY_RE = re.compile(r"Compiling entry function '(_ZN3mla(?:17mla_decode_kernelI|4fast26mla_decode_fp8_fast_kernelI)[^']*)'")
_MANGLED_RE = re.compile(r"mla_decode_kernelIN7cutlass(?:10bfloat16_t|6half_t|12float_e4m3_t)ELi(\d+)ELi(\d+)ELb([01])E")
_MANGLED_FAST_RE = re.compile(r"mla_decode_fp8_fast_kernelILi(\d+)ELi(\d+)ELb([01])E")
_DTYPE_OF = {"10bfloat16_t": "bf16", "6half_t": "fp16", "12float_e4m3_t": "fp8_e4m3"}
_REGS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_OBJ_RE = re.compile(r"\[(\d+)/(\d+)\] Building CUDA object .*/([A-Za-z0-9_]+)\.cu\.o")
_LINK_RE = re.compile(r"\[(\d+)/(\d+)\] Linking CUDA shared library .*?([A-Za-z0-9_.]+)$")
# ptxas's notes that it serializes a kernel's wgmma instructions (each then waits for the previous one),
# e.g. "(C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to ... in the
# function '_ZN3mla17mla_decode_kernelI...'"; C7515: "... due to non wgmma instructions defining ...".
_SERIALIZED_RE = re.compile(r"\((C751[15])\) Potential Performance Loss: wgmma.*"
                            r"'(_ZN3mla(?:17mla_decode_kernelI|4fast26mla_decode_fp8_fast_kernelI)[^']*)'")


def _variant_of_mangled(symbol: str) -> Variant | None:
    m = _MANGLED_FAST_RE.search(symbol)
    if m is not None:
        return Variant(int(m.group(1)), int(m.group(2)), FP8_FAST, m.group(3) == "1")
    m = _MANGLED_RE.search(symbol)
    if m is None:
        return None
    dtype = next(d for token, d in _DTYPE_OF.items() if f"cutlass{token}" in symbol)
    return Variant(int(m.group(1)), int(m.group(2)), dtype, m.group(3) == "1")


def _variant_of_unit(stem: str) -> Variant | None:
    """The variant whose unit (Variant.units) an object's stem names, e.g. <name>_second; None for the
    library-wide units (exports, schedule)."""
    try:
        return Variant.from_name(stem.removesuffix("_second"))
    except ValueError:
        return None


def parse_resource_usage(log: str) -> dict[str, dict]:
    """Map variant name -> {registers, stack_bytes, spill_store_bytes, spill_load_bytes} from ptxas -v output,
    plus wgmma_serialized (ptxas's codes, e.g. ["C7511"]) for a variant one of whose kernels ptxas
    serializes the wgmma pipeline in. A variant has several kernels (the balanced-schedule instantiation
    in its unit; the fp8 short-split one or the 64-row one of a 17..32-head 16-bit variant in its second
    unit, Variant.units): each field is the largest over them, so a spill in any kernel shows.
    A kernel counts for the variant whose unit compiled it (ninja prints a unit's "Building CUDA object"
    line before its ptxas output), so the exact short-split kernel of an fp8_e4m3_fast variant's second
    unit counts for that variant; without such a line, for the variant its mangled name spells."""
    usage: dict[str, dict] = {}
    unit: Variant | None = None
    current: Variant | None = None
    for line in log.splitlines():
        if (m := _OBJ_RE.search(line)):
            unit, current = _variant_of_unit(m.group(3)), None
            continue
        if (m := _SERIALIZED_RE.search(line)) and (v := _variant_of_mangled(m.group(2))) is not None:
            codes = usage.setdefault((unit or v).name, {}).setdefault("wgmma_serialized", [])
            if m.group(1) not in codes:
                codes.append(m.group(1))
                codes.sort()
            continue
        m = _ENTRY_RE.search(line)
        if m:
            current = _variant_of_mangled(m.group(1))
            if current is not None and unit is not None:
                current = unit
            continue
        if current is None:
            continue
        rec = usage.setdefault(current.name, {})
        if (m := _SPILL_RE.search(line)):
            for key, value in zip(("stack_bytes", "spill_store_bytes", "spill_load_bytes"), m.groups()):
                rec[key] = max(rec.get(key, 0), int(value))
        elif (m := _REGS_RE.search(line)):
            rec["registers"] = max(rec.get("registers", 0), int(m.group(1)))
            current = None
    return usage


@dataclass
class BuildSummary:
    variants: int
    compiled: int
    seconds: float
    library: Path
    library_bytes: int
    usage: dict[str, dict]


def configure_args(generated_dir: Path, build_dir: Path) -> list[str]:
    """The CMake configure command for a build folder (its JSON is the folder's configure stamp).

    Extra nvcc flags (the diagnostic build's -DMLA_TRACE=1) come from the CUDAFLAGS environment variable
    (also part of every generated file's inputs hash and of the manifest) and are passed explicitly: CMake itself reads CUDAFLAGS only when a build folder is first configured,
    so a changed value would be ignored; here it changes the stamp, which reconfigures, and ninja then
    recompiles every object whose command line changed."""
    return [
        _tool("cmake", "cmake"), "-S", str(project_dir()), "-B", str(build_dir), "-G", "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={_tool('ninja', 'ninja')}", f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
        f"-DMLA_GENERATED_DIR={generated_dir}", f"-DMLA_TEMPLATES_DIR={templates_dir()}",
        f"-DCUTLASS_INCLUDE_DIR={cutlass_include_dir()}",
        "-DCMAKE_CUDA_ARCHITECTURES=90a", "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_CUDA_FLAGS={cudaflags()}",
    ]


def check_usage(usage: dict[str, dict], variants: list[Variant], generated_dir: Path, build_dir: Path) -> None:
    """Raise BuildError naming the variants whose kernels spill registers to local memory or whose wgmma
    pipeline ptxas serializes (parse_resource_usage), after touching their sources so that the next
    build compiles them again and reports it again."""
    spilled = [n for n, r in usage.items() if max(r.get("spill_store_bytes", 0), r.get("spill_load_bytes", 0),
                                                  r.get("stack_bytes", 0)) > 0]
    serialized = [n for n, r in usage.items() if r.get("wgmma_serialized")]
    by_name = {v.name: v for v in variants}
    for name in spilled + serialized:
        for file in by_name[name].sources:
            (Path(generated_dir) / "variants" / file).touch()
    if spilled:
        raise BuildError("register spills to local memory in: " + ", ".join(
            f"{n} ({usage[n].get('spill_store_bytes', 0)} B stores, {usage[n].get('stack_bytes', 0)} B stack)" for n in spilled))
    if serialized:  # every wgmma then waits for the previous one: results are right, speed is not
        raise BuildError("ptxas serializes the wgmma pipeline (each wgmma waits for the previous one) in: " + ", ".join(
            f"{n} ({'/'.join(usage[n]['wgmma_serialized'])})" for n in serialized)
            + f"; ptxas's notes are in {Path(build_dir) / 'last_build.log'}")


def build(generated_dir: Path, build_dir: Path, variants: list[Variant], jobs: int | None = None,
          echo=print) -> BuildSummary:
    """Configure (when needed) and build the library from `generated_dir` into `build_dir`."""
    t0 = time.monotonic()
    generated_dir, build_dir = Path(generated_dir).resolve(), Path(build_dir).resolve()
    args = configure_args(generated_dir, build_dir)
    cmake = args[0]
    build_dir.mkdir(parents=True, exist_ok=True)
    stamp = build_dir / "mla_configure.json"
    if write_if_changed(stamp, json.dumps(args, indent=1) + "\n") or not (build_dir / "build.ninja").exists():
        echo(f"configuring CMake in {build_dir}")
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            stamp.unlink(missing_ok=True)
            raise BuildError(f"CMake configuration failed:\n{proc.stdout}\n{proc.stderr}")

    jobs = jobs or os.cpu_count() or 1
    cmd = [cmake, "--build", str(build_dir), "--", f"-j{jobs}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NINJA_STATUS": "[%f/%t] "})
    log_lines, compiled = [], 0
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log_lines.append(line)
            m = _OBJ_RE.search(line)
            if m:
                compiled += m.group(3).startswith("mla_decode_")  # the variants' units (not exports / schedule)
                echo(f"  [{m.group(1)}/{m.group(2)}] compiling {m.group(3)}")
            elif (m := _LINK_RE.search(line.rstrip())):
                echo(f"  [{m.group(1)}/{m.group(2)}] linking {m.group(3)}")
    except BaseException:  # the caller stops (Ctrl-C, a closed output pipe): stop the compilers too
        proc.kill()
        proc.wait()
        raise
    rc = proc.wait()
    log = "".join(log_lines)
    (build_dir / "last_build.log").write_text(log)
    if rc != 0:
        failed = sorted(set(re.findall(r"FAILED: .*?(mla_decode_[a-z0-9_]+)\.cu\.o", log)))
        raise BuildError(f"build failed{' in ' + ', '.join(failed) if failed else ''} "
                         f"(full log: {build_dir / 'last_build.log'}):\n{log[-6000:]}")

    usage_path = build_dir / "resource_usage.json"
    usage = json.loads(usage_path.read_text()) if usage_path.exists() else {}
    usage.update(parse_resource_usage(log))
    # The file keeps the records of every variant whose source is still in generated/ (render keeps the
    # sources of variants left out of this selection, whose objects a later build relinks without
    # recompiling, so ptxas would not report them again); the summary covers this selection.
    selected = {v.name for v in variants}
    kept = selected | {f.stem for f in (generated_dir / "variants").glob("*.cu")}
    write_if_changed(usage_path, json.dumps({k: usage[k] for k in sorted(usage) if k in kept}, indent=2,
                                            sort_keys=True) + "\n")
    usage = {k: usage[k] for k in sorted(usage) if k in selected}
    check_usage(usage, variants, generated_dir, build_dir)

    lib = build_dir / LIBRARY_NAME
    if not lib.is_file():
        raise BuildError(f"the build finished but {lib} is missing")
    return BuildSummary(len(variants), compiled, time.monotonic() - t0, lib, lib.stat().st_size, usage)


def echo_flush(msg: str) -> None:
    print(msg, flush=True)
