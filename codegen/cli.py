"""Command line: ``mla-variants`` (console script) or ``python -m codegen``.

    mla-variants build  [--preset NAME] [--filter PATTERN ...] [-j N]   render, configure, compile, emit dispatch
    mla-variants generate [--preset NAME] [--filter PATTERN ...]        render sources only (no dispatch table)
    mla-variants list                                                    print the dispatch table of the last build
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import sys
from pathlib import Path

from .build import LIBRARY_NAME, BuildError, build, echo_flush
from .config import ConfigError, load_config
from .render import ROOT, render, write_dispatch
from .variant import Variant


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
    if not chosen:
        raise ConfigError(config.path, None, f"--filter {args.filter} matches none of the {len(base)} variants "
                                             f"(names look like {base[0].name})")
    return config, chosen


def _load_dispatch(generated_dir: Path):
    path = generated_dir / "dispatch.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_mla_dispatch_listing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_list(args) -> int:
    mod = _load_dispatch(Path(args.generated_dir))
    if mod is None:
        print(f"no dispatch table in {args.generated_dir}: run `mla-variants build --generated-dir {args.generated_dir}` "
              f"first (`generate` writes no table)", file=sys.stderr)
        return 1
    # The registers come from the build that made the table's library (its folder), else --build-dir.
    library = (Path(args.generated_dir) / mod.LIBRARY).resolve()
    usage = {}
    for usage_path in (library.parent / "resource_usage.json", Path(args.build_dir) / "resource_usage.json"):
        if usage_path.exists():
            usage = json.loads(usage_path.read_text())
            break
    print(f"{'num_heads':>9} {'page_size':>9} {'dtype':>8} {'split':>5}  {'registers':>9}  launcher")
    for (h, p, d, s), name in sorted(mod.VARIANTS.items()):
        regs = usage.get(name, {}).get("registers", "?")
        print(f"{h:>9} {p:>9} {d:>8} {str(s).lower():>5}  {regs:>9}  {name}")
    print(f"{_count(len(mod.VARIANTS), 'variant')}, library {library}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mla-variants", description="Generate, build and list MLA decode kernel variants.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("build", "render, compile and emit the dispatch table"),
                        ("generate", "render the sources, sources.cmake and manifest only (the dispatch table is "
                                     "written by build, once the library links)"),
                        ("list", "print the dispatch table of the last build")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", default=str(ROOT / "variants.yaml"), help="variants file (default: %(default)s)")
        p.add_argument("--generated-dir", default=str(ROOT / "generated"), help="rendered sources (default: %(default)s)")
        p.add_argument("--build-dir", default=str(ROOT / "build"), help="CMake build tree (default: %(default)s)")
        if name != "list":
            p.add_argument("--preset", help=f"{name} only this preset's variants (a name under presets: in "
                                            "variants.yaml; an unknown name lists them)")
            p.add_argument("--filter", action="append", metavar="PATTERN",
                           help="keep variants whose name matches (glob, or substring); repeatable")
        if name == "build":
            p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            return cmd_list(args)
        config, chosen = _selected(args)
        gen, bdir = Path(args.generated_dir), Path(args.build_dir)
        # the dispatch table is written only after the library links, so a failed build leaves the
        # previous table and library consistent
        res = render(config, chosen, gen, bdir / LIBRARY_NAME, dispatch=False)
        echo_flush(f"rendered {_count(len(chosen), 'variant')} into {gen} ({_count(len(res.written), 'file')} written, "
                   f"{len(res.removed)} stale removed)")
        if args.cmd == "generate":
            return 0
        s = build(gen, bdir, chosen, args.jobs, echo=echo_flush)
        write_dispatch(res)
        regs = [r.get("registers") for r in s.usage.values() if r.get("registers")]
        echo_flush(f"built {_count(s.variants, 'variant')} ({_count(s.compiled, 'translation unit')} compiled) in {s.seconds:.1f} s; "
                   f"library {s.library} ({s.library_bytes / 2**20:.1f} MiB)"
                   + (f"; registers {min(regs)}-{max(regs)}, no spills" if regs else ""))
        return 0
    except (ConfigError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `mla-variants list | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"error: a build record is corrupt ({e}); delete it or rebuild", file=sys.stderr)
        return 2
