"""B against A per case, from bench.py result files of interleaved passes (A, B, A, B, ... on one
machine, so drift between passes shows in both sides alike):

    python lab/ab_compare.py A1.json B1.json [A2.json B2.json ...]

A case's A and B times are the medians of its cold (and CUDA-graph) times over the passes; cases
missing from any file (not built, skipped, failed) are left out. Prints one line per case, B/A cold
and graph, the best peer's time and peer/B (and, for runs with --check, both sides' max abs out error
and the fastest peer's), then the geomeans. Exit status 0; 2 on bad arguments."""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import geomean  # noqa: E402  # the benchmark's one geometric mean (None for no values)


def cases(path: str) -> dict:
    """(num_heads, batch, seq_mean, page_size, ragged, q_len) -> the bench.py case record, timed ones only."""
    rows = json.load(open(path))["cases"]
    return {(c["num_heads"], c["batch"], c["seq_mean"], c["page_size"], c["ragged"], c.get("q_len", 1)): c
            for c in rows if "cold_us" in c}


def gm(values: list) -> float:
    """bench.py's geomean, NaN for no values."""
    return geomean(values) or math.nan


def compare(files: list) -> list:
    """Lines of the comparison of A files files[0::2] against B files files[1::2]."""
    runs_a, runs_b = [cases(f) for f in files[0::2]], [cases(f) for f in files[1::2]]
    keys = sorted(set.intersection(*(set(r) for r in runs_a + runs_b)))
    out = [f"{len(keys)} cases, {len(runs_a)} pass(es) per side; times are medians over the passes (us)",
           f"{'case':<28} {'A cold':>8} {'B cold':>8} {'B/A':>6} {'A graph':>8} {'B graph':>8} {'B/A':>6} "
           f"{'peer':>8} {'peer/B':>6}"]
    cold, graph, peer_b, peer_a = [], [], [], []
    for k in keys:
        ac = statistics.median(r[k]["cold_us"] for r in runs_a)
        bc = statistics.median(r[k]["cold_us"] for r in runs_b)
        ag = [r[k]["graph_us"] for r in runs_a if r[k].get("graph_us")]
        bg = [r[k]["graph_us"] for r in runs_b if r[k].get("graph_us")]
        ag, bg = (statistics.median(ag), statistics.median(bg)) if ag and bg else (math.nan, math.nan)
        peer = runs_a[0][k].get("best_us")
        cold.append(bc / ac)
        if ag == ag:
            graph.append(bg / ag)
        if peer:
            peer_b.append(peer / bc)
            peer_a.append(peer / ac)
        name = f"h{k[0]} b{k[1]} s{k[2]} p{k[3]}{' ragged' if k[4] else ''} q{k[5]}"
        line = (f"{name:<28} {ac:>8.1f} {bc:>8.1f} {bc / ac:>6.3f} {ag:>8.1f} {bg:>8.1f} {bg / ag:>6.3f} "
                f"{peer or math.nan:>8.1f} {peer / bc if peer else math.nan:>6.3f}")
        # bench.py --check's max abs out error, the largest over the passes, and the fastest peer's.
        err_a = [r[k]["max_abs_err"] for r in runs_a if r[k].get("max_abs_err") is not None]
        err_b = [r[k]["max_abs_err"] for r in runs_b if r[k].get("max_abs_err") is not None]
        if err_a and err_b:
            peer_err = runs_b[0][k].get("best_peer_err")
            line += f"  err {max(err_a):.1e} -> {max(err_b):.1e}" + (f" (peer {peer_err:.1e})" if peer_err else "")
        out.append(line)
    out.append(f"geomean B/A: cold {gm(cold):.3f}, graph {gm(graph):.3f} (below 1: B is faster); "
               f"worst cold {max(cold, default=math.nan):.3f}; peer/ours: A {gm(peer_a):.3f}, "
               f"B {gm(peer_b):.3f}, B at or below the peer in {sum(x >= 1 for x in peer_b)} of {len(peer_b)}")
    return out


def main(argv: list) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(compare(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
