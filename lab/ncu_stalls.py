"""The stall ledger of one kernel from Nsight Compute's source page (lab/ncu_stalls.sh makes it).

    python3 lab/ncu_stalls.py stalls_source.csv [--top N]

`ncu --import R --page source --csv --print-source sass` writes one row per SASS instruction with its
warp-state samples in total and per stall reason. This prints the instructions that hold the most
samples (address, share of all samples, the instruction, its three main reasons), the instructions
that cover half of all samples, and the totals per reason. The column names differ between ncu
versions, so they are found by pattern: the total is "Warp Stall Sampling (All Samples)" (or "#
Samples"), the reasons are the columns named stall_* (or "... Stall ..." columns other than the total).
"""
from __future__ import annotations

import argparse
import csv
import io
import sys


def _num(text: str) -> float:
    try:
        return float(text.replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def parse(text: str) -> tuple[list[dict], str, list[str], str, str]:
    """Rows of the source page (dicts), the total-samples column, the reason columns, the address
    column and the instruction column. Raises ValueError if no header with an address and samples."""
    lines = list(csv.reader(io.StringIO(text)))
    for i, row in enumerate(lines):
        names = [c.strip() for c in row]
        addr = next((c for c in names if c in ("Address", "# Address")), None)
        total = next((c for c in names if c.startswith("Warp Stall Sampling (All")), None) or \
            next((c for c in names if c == "# Samples"), None)
        if addr and total:
            src = next((c for c in names if c == "Source"), None) or next((c for c in names if "Source" in c), addr)
            reasons = [c for c in names if c.lower().startswith("stall_")] or \
                [c for c in names if "stall" in c.lower() and c != total and not c.startswith("Warp Stall Sampling")]
            rows = [dict(zip(names, r)) for r in lines[i + 1:] if len(r) == len(names)]
            return rows, total, reasons, addr, src
    raise ValueError("no header row with an address and a warp-stall-sampling column: not an ncu source page")


def ledger(text: str, top: int = 30) -> str:
    rows, total, reasons, addr, src = parse(text)
    all_samples = sum(_num(r[total]) for r in rows)
    if all_samples <= 0:
        return "no warp-state samples in this source page"
    ranked = sorted(rows, key=lambda r: -_num(r[total]))
    out = [f"{len(rows)} instructions, {int(all_samples)} samples; top {min(top, len(ranked))} by samples:",
           f"{'address':>10} {'share':>6}  {'instruction':<48} main reasons"]
    for r in ranked[:top]:
        s = _num(r[total])
        if s <= 0:
            break
        why = sorted(((_num(r[c]), c) for c in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{c.removeprefix('stall_')} {v / s:.0%}" for v, c in why if v > 0)
        out.append(f"{r[addr]:>10} {s / all_samples:>6.1%}  {r[src].strip()[:48]:<48} {why_text}")
    acc, n = 0.0, 0
    for r in ranked:
        acc += _num(r[total])
        n += 1
        if acc >= all_samples / 2:
            break
    out.append(f"half of all samples lie in {n} of {len(rows)} instructions")
    if reasons:
        out.append("samples by reason:")
        totals = sorted(((sum(_num(r[c]) for r in rows), c) for c in reasons), reverse=True)
        out += [f"  {c.removeprefix('stall_'):<28} {v / all_samples:>6.1%}" for v, c in totals if v > 0]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="the exported source page")
    ap.add_argument("--top", type=int, default=30, help="instructions to list (default 30)")
    args = ap.parse_args(argv)
    try:
        print(ledger(open(args.csv).read(), args.top))
    except (OSError, ValueError) as e:
        print(f"ncu_stalls.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
