"""Command line: ``mla-variants`` (console script) or ``python -m codegen``.

    mla-variants build  [--preset NAME] [--filter PATTERN ...] [-j N]   render, configure, compile, write the manifest
    mla-variants generate [--preset NAME] [--filter PATTERN ...]        render sources only (no manifest)
    mla-variants list                                                    print the manifest of the last build
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from pathlib import Path

from .build import LIBRARY_NAME, BuildError, build, echo_flush
from .config import ConfigError, load_config, raw_product
from .manifest import ManifestError, load_manifest
from .paths import default_build_dir, default_config, default_generated_dir
from .render import render, write_manifest
from .variant import Variant, call_dtype


def _positive_int(text: str) -> int:
    """argparse type of -j: an int >= 1 (ninja refuses the rest only after CMake has configured)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {n}")
    return n


def _count(n: int, noun: str) -> str:
    """'1 variant', '2 variants', '0 files' (the build's one-line reports)."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def select(variants: list[Variant], patterns: list[str] | None) -> list[Variant]:
    """Keep variants whose name contains a match of any pattern: a substring (``h16_p64``) or a shell
    glob matched anywhere in the name (``h16_p*_bf16``)."""
    if not patterns:
        return list(variants)
    def hit(name: str, pat: str) -> bool:
        return fnmatch.fnmatchcase(name, f"*{pat}*") if any(c in pat for c in "*?[") else pat in name
    return [v for v in variants if any(hit(v.name, p) for p in patterns)]


def _selected(args) -> list[Variant]:
    config = load_config(args.config)
    if args.preset is not None:
        if args.preset not in config.presets:
            raise ConfigError(config.path, None, f"unknown preset {args.preset!r}; presets: {', '.join(config.presets)}")
        selection = config.presets[args.preset]
    else:
        selection = config
    base = selection.variants()
    chosen = select(base, args.filter)
    # --filter patterns that match only variants an exclude rule leaves out (of this preset's selection)
    left_out = {}
    for pat in args.filter or ():
        if not select(chosen, [pat]):
            hit = [v for v in select(selection.cross_product(), [pat]) if config.excluded_by(v)]
            if hit:
                left_out[pat] = hit[0]
    for pat, v in left_out.items():
        lines = ", ".join(str(r.line) for r in config.excluded_by(v))
        message = (f"--filter {pat}: {v.name} is left out by the exclude rule(s) at {config.path} line(s) {lines}; "
                   f"remove or narrow them to build it")
        if not chosen:
            raise ConfigError(config.path, config.excluded_by(v)[0].line, message)
        echo_flush(f"note: {message}")
    # --filter patterns that match only variants no call dispatches to (call_dtype), so none is ever built
    never = [v for v in raw_product(selection.axes) if call_dtype(v.dtype, v.num_heads) != v.dtype]
    for pat in args.filter or ():
        hit = select(never, [pat]) if not select(chosen, [pat]) and pat not in left_out else []
        if hit:
            v = hit[0]
            served = Variant(v.num_heads, v.page_size, call_dtype(v.dtype, v.num_heads), v.split)
            message = (f"--filter {pat}: {v.name} is never built: a call of dtype {v.dtype} at {v.num_heads} heads "
                       f"runs {served.name} (codegen.variant.call_dtype)")
            if not chosen:
                raise ConfigError(config.path, None, f"{message}; filter on that one instead")
            echo_flush(f"note: {message}")
    if not chosen:
        raise ConfigError(config.path, None, f"--filter {args.filter} matches none of the {len(base)} variants "
                                             f"(names look like {base[0].name})")
    return config, chosen


def cmd_list(args) -> int:
    path = Path(args.generated_dir) / "manifest.json"
    if not path.is_file():
        print(f"no manifest in {args.generated_dir}: run `mla-variants build --generated-dir {args.generated_dir}` "
              f"first (`generate` writes none)", file=sys.stderr)
        return 1
    try:
        manifest = load_manifest(path)
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The registers come from the build that made the manifest's library (its folder), else --build-dir.
    library = (Path(args.generated_dir) / manifest["library"]).resolve()
    usage = {}
    for usage_path in (library.parent / "resource_usage.json", Path(args.build_dir) / "resource_usage.json"):
        if usage_path.exists():
            usage = json.loads(usage_path.read_text())
            break
    print(f"{'num_heads':>9} {'page_size':>9} {'dtype':>8} {'split':>5} {'rows':>4} {'second kernel':>13}  "
          f"{'registers':>9}  launcher")
    entries = sorted(manifest["variants"], key=lambda e: (e["num_heads"], e["page_size"], e["dtype"], e["split"]))
    for e in entries:
        f = e["facts"]
        regs = usage.get(e["name"], {}).get("registers", "?")
        print(f"{e['num_heads']:>9} {e['page_size']:>9} {e['dtype']:>8} {str(e['split']).lower():>5} "
              f"{f['rows_per_cta']:>4} {f['second_kernel'] or '-':>13}  {regs:>9}  {e['name']}")
    flags = f", CUDAFLAGS {manifest['cudaflags']!r}" if manifest.get("cudaflags") else ""
    print(f"{_count(len(entries), 'variant')}, library {library}{flags}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mla-variants", description="Generate, build and list MLA decode kernel variants.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("build", "render, compile and write the manifest (the runtime's dispatch table)"),
                        ("generate", "render the sources and sources.cmake only (the manifest, which the runtime "
                                     "loads, is written by build once the library links)"),
                        ("list", "print the variants of the last build (its manifest)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", default=str(default_config()), help="variants file (default: %(default)s)")
        p.add_argument("--generated-dir", default=str(default_generated_dir()),
                       help="rendered sources and the manifest, which the runtime loads (default: "
                            "$MLA_VARIANTS_GENERATED, else %(default)s)")
        p.add_argument("--build-dir", default=str(default_build_dir()), help="CMake build tree (default: %(default)s)")
        if name != "list":
            p.add_argument("--preset", help=f"{name} only this preset's variants (a name under presets: in "
                                            "variants.yaml; an unknown name lists them)")
            p.add_argument("--filter", action="append", metavar="PATTERN",
                           help="keep variants whose name matches (glob, or substring); repeatable")
        if name == "build":
            p.add_argument("-j", "--jobs", type=_positive_int, default=None, help="parallel compile jobs (default: all cores)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            return cmd_list(args)
        config, chosen = _selected(args)
        gen, bdir = Path(args.generated_dir), Path(args.build_dir)
        # the manifest is written only after the library links, so a failed build leaves the previous
        # manifest and library consistent
        res = render(config, chosen, gen, bdir / LIBRARY_NAME)
        echo_flush(f"rendered {_count(len(chosen), 'variant')} into {gen} ({_count(len(res.written), 'file')} written, "
                   f"{len(res.removed)} stale removed)")
        if args.cmd == "generate":
            return 0
        s = build(gen, bdir, chosen, args.jobs, echo=echo_flush)
        write_manifest(res)
        regs = [r.get("registers") for r in s.usage.values() if r.get("registers")]
        echo_flush(f"built {_count(s.variants, 'variant')} ({_count(s.compiled, 'translation unit')} compiled) in {s.seconds:.1f} s; "
                   f"library {s.library} ({s.library_bytes / 2**20:.1f} MiB)"
                   + (f"; registers {min(regs)}-{max(regs)}, no spills" if regs else ""))
        return 0
    except (ConfigError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `mla-variants list | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        # a listing that was cut is fine; a build whose output reader left was stopped (build() ends its
        # compilers), which is not a success
        return 0 if args.cmd == "list" else 1
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"error: a build record is corrupt ({e}); delete it or rebuild", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
