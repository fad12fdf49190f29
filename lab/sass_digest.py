#!/usr/bin/env python3
"""SASS digest of a rendered build: compiles every generated translation unit to an sm_90a cubin with
the library's own nvcc flags, disassembles it (cuobjdump -sass) and writes {unit: {function: sha256}}.
Two digests compare a refactoring's machine code function by function, without a GPU:

    python lab/sass_digest.py GENERATED_DIR out.json [-j N] [--templates DIR]
    python lab/sass_digest.py --compare before.json after.json

cuobjdump and nvdisasm come with the CUDA toolkit, or from pip (nvidia-cuda-cuobjdump,
nvidia-cuda-nvdisasm; their bin folder is searched too).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo",
         "-gencode=arch=compute_90a,code=sm_90a", "-cubin"]


def _tool_path() -> str:
    path = os.environ.get("PATH", "")
    try:
        import nvidia  # the pip wheels' namespace package
        for base in nvidia.__path__:
            for sub in Path(base).glob("cu*/bin"):
                path = f"{sub}{os.pathsep}{path}"
    except ImportError:
        pass
    return path


def _cutlass_include() -> str:
    sys.path.insert(0, str(ROOT))
    from codegen.build import cutlass_include_dir
    return str(cutlass_include_dir())


def digest_unit(unit: Path, templates: Path, include: str, env: dict) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "unit.cubin"
        subprocess.run(["nvcc", *FLAGS, f"-I{templates}", f"-I{include}", str(unit), "-o", str(cubin)],
                       check=True, capture_output=True, env=env)
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True,
                              env=env).stdout
    funcs: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
        elif current is not None and line.strip():
            funcs[current].append(line.strip())
    return {f: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] for f, lines in sorted(funcs.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs=2)
    ap.add_argument("--compare", action="store_true", help="compare two digests instead of making one")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--templates", default=str(ROOT / "templates"), help="include root of the kernel headers")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.paths)
        fa = {f: h for unit in a.values() for f, h in unit.items()}
        fb = {f: h for unit in b.values() for f, h in unit.items()}
        same = sorted(f for f in fa.keys() & fb.keys() if fa[f] == fb[f])
        diff = sorted(f for f in fa.keys() & fb.keys() if fa[f] != fb[f])
        print(f"{len(same)} functions identical, {len(diff)} differ, {len(fa.keys() - fb.keys())} only in the first, "
              f"{len(fb.keys() - fa.keys())} only in the second")
        for f in diff:
            print("  differs:", f)
        for f in sorted(fa.keys() - fb.keys()):
            print("  only first:", f)
        for f in sorted(fb.keys() - fa.keys()):
            print("  only second:", f)
        return 0 if not diff and fa.keys() == fb.keys() else 1
    gen, out = Path(args.paths[0]), Path(args.paths[1])
    env = {**os.environ, "PATH": _tool_path()}
    for tool in ("nvcc", "cuobjdump", "nvdisasm"):
        if shutil.which(tool, path=env["PATH"]) is None:
            sys.exit(f"{tool} not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    include = _cutlass_include()
    units = sorted((gen / "variants").glob("*.cu"))
    result: dict[str, dict[str, str]] = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(digest_unit, u, Path(args.templates), include, env): u for u in units}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            unit = futures[fut]
            result[unit.name] = fut.result()
            print(f"[{i}/{len(units)}] {unit.name}: {len(result[unit.name])} functions", flush=True)
    out.write_text(json.dumps(dict(sorted(result.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
