#!/usr/bin/env bash
# Forced num_kv_splits sweep on the device: benchmark the anchor cases picked by BENCH_FILTER with
# each split count in SPLITS, against the library's heuristic, and print one row per case (cold us).
# Uses whatever library MLA_VARIANTS_GENERATED / the default build points at (build it first).
#
#   SPLITS="1 2 4 8 16 32 64" BENCH_FILTER="--page 64 --batch 1,8" lab/split_sweep.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
SPLITS=${SPLITS:-1 2 4 8 16 32 64}
BENCH_FILTER=${BENCH_FILTER:---page 64 --batch 1,8}
ANCHORS=${ANCHORS:-$(pwd)/shared/anchors-h200.json}
common="--anchors $ANCHORS $BENCH_FILTER --graph-replays 5"
python3 benchmarks/bench.py $common --json "$OUT/sweep_auto.json" 2>&1 | tail -1
for s in $SPLITS; do
  python3 benchmarks/bench.py $common --num-kv-splits "$s" --json "$OUT/sweep_$s.json" 2>&1 | tail -1
done
python3 - "$OUT" $SPLITS <<'PY'
import json, sys
out, splits = sys.argv[1], sys.argv[2:]
def load(tag):
    d = json.load(open(f"{out}/sweep_{tag}.json"))
    return {(c["num_heads"], c["batch"], c["seq_mean"], c["page_size"], c["ragged"]): c for c in d["cases"]}
auto, runs = load("auto"), {s: load(s) for s in splits}
print(f"{'case':>26} {'peer':>7} {'auto':>12} " + " ".join(f"{s:>7}" for s in splits))
for k, c in sorted(auto.items()):
    name = f"{k[0]}h x {k[1]} x {k[2]} p{k[3]}{' R' if k[4] else ''}"
    cells = " ".join(f"{runs[s][k]['cold_us']:>7.1f}" if k in runs[s] else f"{'-':>7}" for s in splits)
    print(f"{name:>26} {c['best_us']:>7.1f} {c['cold_us']:>7.1f}@{c['num_kv_splits']:<4} {cells}")
PY
