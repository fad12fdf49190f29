"""The README's result tables and the issues' target checks, from benchmarks/bench.py result files.

    python lab/report.py docs/bench/v3.28.json [--fp8 docs/bench/v3.28-fp8.json]
                                [--fp8-peers docs/bench/fp8-exact-mode.json]

The first file is a bf16 run over the 200 anchor cases (bench.py --check --json ...). With --fp8 (the
same 200 cases with an fp8 cache, bench.py --dtype fp8_e4m3 --anchors .../anchors-h200.json) the fp8
targets are checked against that run's bf16 times and the best bf16 peer; --fp8-peers (bench.py
--dtype fp8_e4m3, the 28 fp8 cases of anchors-h200-modes.json) adds the table against the fp8 peers.
Printed as markdown. Targets (issue 3, issue 5):
  memory-bound bf16: num_heads * q_len <= 64, batch >= 32, seq >= 4096: >= 4.3 TB/s
  compute-bound bf16: 128 heads, batch >= 32, seq >= 16384: >= 680 TFLOP/s
  batch 1 x 1024: <= 12 us cold, <= 8 us in a CUDA graph; geomean best peer / ours >= 1.10
  fp8 memory-bound shapes: <= 0.55x the best bf16 peer; 128 heads <= our bf16; batch 1 = our bf16
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import geomean  # noqa: E402  # one geometric mean for bench.py's summary and these tables

ROWS = [(16, 1, 1024, False), (16, 8, 16384, False), (16, 32, 16384, False), (16, 128, 16384, False),
        (16, 32, 4096, True), (32, 32, 16384, False), (32, 128, 4096, False), (64, 32, 16384, False),
        (128, 1, 16384, False), (128, 32, 4096, True), (128, 128, 16384, False)]
PAGES = (1, 16, 64, 128)


def key(c: dict) -> tuple:
    return c["num_heads"], c["batch"], c["seq_mean"], c["ragged"], c["page_size"]


def gmean(xs) -> float:
    g = geomean(list(xs))
    return float("nan") if g is None else g


def span(xs, fmt="{:.2f}") -> str:
    xs = sorted(xs)
    return "-" if not xs else fmt.format(xs[0]) if len(xs) == 1 else f"{fmt.format(xs[0])}-{fmt.format(xs[-1])}"


def memory_bound(c: dict) -> bool:
    return c["num_heads"] * c.get("q_len", 1) <= 64 and c["batch"] >= 32 and c["seq_mean"] >= 4096


def bf16_report(run: dict) -> None:
    cases = {key(c): c for c in run["cases"] if "cold_us" in c}
    s = run["summary"]
    env = run["environment"]
    print(f"bf16: {s['cases_run']} cases, {env.get('date', '?')}, commit {env.get('git_commit', '?')}, "
          f"{env.get('gpu', '?')}\n")
    print("| case (heads, batch, seq) | page 1 | page 16 | page 64 | page 128 | TB/s / TFLOP/s at page 64 "
          "| graph us at page 64 (peer) |")
    print("|---|---|---|---|---|---|---|")
    for h, b, sq, rag in ROWS:
        cells = []
        for p in PAGES:
            c = cases.get((h, b, sq, rag, p))
            cells.append(f"{c['cold_us']:.1f} ({c['best_us']:.1f})" if c else "-")
        c = cases.get((h, b, sq, rag, 64))
        roof = (f"{c['tbps']:.2f} TB/s ({c['pct_read']:.0f}%) / {c['tflops']:.0f} TFLOP/s ({c['pct_matmul']:.0f}%)"
                if c else "-")
        graph = f"{c['graph_us']:.1f} ({c['best_graph_us']:.1f})" if c else "-"
        print(f"| {h}, {b}, {sq}{' ragged' if rag else ''} | " + " | ".join(cells) + f" | {roof} | {graph} |")
    print(f"\nGeomean best peer / ours: **{s['geomean_peer_over_ours_cold']:.3f} cold, "
          f"{s['geomean_peer_over_ours_graph']:.3f} in a CUDA graph**; at or below the peer in "
          f"{s['at_or_below_peer_cold']} / {s['at_or_below_peer_graph']} of {s['compared_cold']} cases.\n")
    groups = defaultdict(list)
    for c in cases.values():
        r = c["best_us"] / c["cold_us"]
        groups[("heads", c["num_heads"])].append(r)
        groups[("page", c["page_size"])].append(r)
        groups[("batch", "ragged" if c["ragged"] else c["batch"])].append(r)
    for axis in ("heads", "batch", "page"):
        items = sorted(((k[1], v) for k, v in groups.items() if k[0] == axis), key=lambda kv: str(kv[0]).zfill(8))
        print(f"- by {axis}: " + ", ".join(f"{k} {gmean(v):.3f} ({sum(x >= 1 for x in v)}/{len(v)})" for k, v in items))
    print("\n| target (issue 3) | measured | met |\n|---|---|---|")
    mem = [c for c in cases.values() if memory_bound(c)]
    for p in PAGES:
        tb = [c["tbps"] for c in mem if c["page_size"] == p]
        print(f"| memory-bound >= 4.3 TB/s, page {p} | {span(tb)} TB/s | {'yes' if tb and min(tb) >= 4.3 else 'no'} |")
    comp = [c["tflops"] for c in cases.values() if c["num_heads"] == 128 and c["batch"] >= 32 and c["seq_mean"] >= 16384
            and not c["ragged"]]
    print(f"| 128 heads, batch >= 32, seq >= 16384: >= 680 TFLOP/s | {span(comp, '{:.0f}')} | "
          f"{'yes' if comp and min(comp) >= 680 else 'no'} |")
    b1 = [c for c in cases.values() if c["batch"] == 1 and c["seq_mean"] == 1024]
    cold, graph = [c["cold_us"] for c in b1], [c["graph_us"] for c in b1]
    print(f"| batch 1 x 1024: <= 12 us cold | {span(cold, '{:.1f}')} us | {'yes' if cold and max(cold) <= 12 else 'no'} |")
    print(f"| batch 1 x 1024: <= 8 us in a graph | {span(graph, '{:.1f}')} us | {'yes' if graph and max(graph) <= 8 else 'no'} |")
    g = s["geomean_peer_over_ours_cold"]
    print(f"| geomean best peer / ours >= 1.10 | {g:.3f} | {'yes' if g >= 1.10 else 'no'} |")
    n = s["at_or_below_peer_cold"]
    print(f"| every case at or below the peer (cold) | {n} of {s['compared_cold']} | {'yes' if n == s['compared_cold'] else 'no'} |")
    misses = sorted((c for c in cases.values() if c["cold_us"] > c["best_us"]), key=lambda c: c["best_us"] / c["cold_us"])
    print("\nCases above the peer (cold), worst first: " + "; ".join(
        f"{c['num_heads']}x{c['batch']}x{c['seq_mean']}{'r' if c['ragged'] else ''} p{c['page_size']} "
        f"{c['best_us'] / c['cold_us']:.2f}" for c in misses))


def fp8_report(run: dict, bf16: dict) -> None:
    ours16 = {key(c): c for c in bf16["cases"] if "cold_us" in c}
    rows = [(c, ours16.get(key(c))) for c in run["cases"] if "cold_us" in c]
    print("\n| fp8 target (issue 5) | by head count | measured |\n|---|---|---|")
    heads = sorted({c["num_heads"] for c, _ in rows})
    for h in heads:
        mem = [c["cold_us"] / c["best_us"] for c, _ in rows if c["num_heads"] == h and memory_bound(c)]
        tb = [c["seq_total"] * 576 / c["cold_us"] / 1e6 for c, _ in rows if c["num_heads"] == h and memory_bound(c)]
        if mem:
            print(f"| memory-bound shapes: <= 0.55x the best bf16 peer | {h} heads | {span(mem)}x ({span(tb)} TB/s of fp8 bytes) |")
    for h in heads:
        r = [c["cold_us"] / b["cold_us"] for c, b in rows if b and c["num_heads"] == h]
        b1 = [c["cold_us"] / b["cold_us"] for c, b in rows if b and c["num_heads"] == h and c["batch"] == 1]
        print(f"| fp8 / our bf16 (geomean; batch 1 range) | {h} heads | {gmean(r):.3f} ({span(b1)}) |")


def fp8_peers_report(run: dict, bf16: dict | None) -> None:
    ours16 = {key(c): c for c in bf16["cases"]} if bf16 else {}
    s = run["summary"]
    print("\n| case (heads, batch, seq) | page | fp8 us | TB/s | best fp8 peer us | peer / ours | our bf16 us |")
    print("|---|---|---|---|---|---|---|")
    for c in run["cases"]:
        if "cold_us" not in c or c["page_size"] not in (1, 64):
            continue
        b = ours16.get(key(c))
        tb = c["seq_total"] * 576 / c["cold_us"] / 1e6
        ours_bf16 = f"{b['cold_us']:.1f}" if b else "-"
        print(f"| {c['num_heads']}, {c['batch']}, {c['seq_mean']}{' ragged' if c['ragged'] else ''} | {c['page_size']} | "
              f"{c['cold_us']:.1f} | {tb:.2f} | {c['best_us']:.1f} ({c['best_peer']}) | {c['best_us'] / c['cold_us']:.2f} | "
              f"{ours_bf16} |")
    print(f"\nfp8 peers: geomean best fp8 peer / ours {s['geomean_peer_over_ours_cold']:.2f} cold, "
          f"{s['geomean_peer_over_ours_graph']:.2f} in a graph; at or below the peer in {s['at_or_below_peer_cold']} of "
          f"{s['compared_cold']}.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bf16", help="bench.py result over the 200 bf16 anchor cases")
    ap.add_argument("--fp8", help="bench.py --dtype fp8_e4m3 result over the same 200 cases")
    ap.add_argument("--fp8-peers", help="bench.py --dtype fp8_e4m3 result over the fp8 cases of anchors-h200-modes.json")
    args = ap.parse_args()
    bf16 = json.load(open(args.bf16))
    bf16_report(bf16)
    if args.fp8:
        fp8_report(json.load(open(args.fp8)), bf16)
    if args.fp8_peers:
        fp8_peers_report(json.load(open(args.fp8_peers)), bf16)


if __name__ == "__main__":
    main()
