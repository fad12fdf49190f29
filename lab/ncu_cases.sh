#!/usr/bin/env bash
# Nsight Compute on the H200 for several decode cases, side by side: one decode kernel launch per case
# (lab/profile_case.py, the third call's launch), the clocks left alone (--clock-control none, as
# the device notes ask), and a table of the headline metrics (rows) per case (columns). Uses whatever
# library the default build or MLA_VARIANTS_GENERATED points at (build the cases' variants first).
#
#   CASES="128:128:16384:1 128:128:16384:16 128:128:16384:64" lab/ncu_cases.sh
#   CASES="16:32:16384:64:fp8" NCU_SECTIONS="SpeedOfLight WarpStateStats" lab/ncu_cases.sh
#   CASES="64:128:4096:64" NCU_METRICS="breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed" lab/ncu_cases.sh
#
# A case is HEADS:BATCH:SEQ:PAGE[:SPLITS][:fp8|:fast] (profile_case.py's arguments). Output: $OUT/ncu.csv
# (every metric of every case, with a `case` column) and $OUT/ncu_table.txt (the table printed here).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
CASES=${CASES:-128:128:16384:1 128:128:16384:16 128:128:16384:64}
NCU_SECTIONS=${NCU_SECTIONS:-SpeedOfLight WarpStateStats SchedulerStats MemoryWorkloadAnalysis ComputeWorkloadAnalysis LaunchStats}
sections=(); for s in $NCU_SECTIONS; do sections+=(--section "$s"); done
# NCU_METRICS (optional): raw metrics beside the sections, comma-separated, as ncu's --metrics takes them
# (e.g. "breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum": which L2
# sub-unit is the busy one, and the DRAM bytes to set the L2 sectors against).
[ -n "${NCU_METRICS:-}" ] && sections+=(--metrics "$NCU_METRICS")
rm -f "$OUT/ncu.csv"
for c in $CASES; do
  IFS=: read -r -a f <<< "$c"
  # -s 2 -c 1: skip two decode launches (warm-up), profile the third.
  if ncu --clock-control none -k "regex:mla_decode_(fp8_fast_)?kernel" -s 2 -c 1 "${sections[@]}" --csv --page details \
      python3 lab/profile_case.py "${f[@]}" > "/tmp/ncu_$$.csv" 2> "/tmp/ncu_$$.err"; then
    python3 - "$c" "/tmp/ncu_$$.csv" "$OUT/ncu.csv" <<'PY'
import csv, io, os, sys
case, src, dst = sys.argv[1:]
text = open(src).read()
start = text.find('"ID"')  # ncu prints the program's own output and its ==PROF== lines before the CSV
rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
new = not os.path.exists(dst)
with open(dst, "a", newline="") as f:
    w = csv.writer(f)
    if new:
        w.writerow(["case", "section", "metric", "unit", "value"])
    for r in rows:
        w.writerow([case, r.get("Section Name"), r.get("Metric Name"), r.get("Metric Unit"), r.get("Metric Value")])
print(f"{case}: {len(rows)} metrics")
PY
  else
    echo "$c: ncu failed"; tail -5 "/tmp/ncu_$$.err"
  fi
done
[ -f "$OUT/ncu.csv" ] || exit 1
python3 - "$OUT/ncu.csv" <<'PY' | tee "$OUT/ncu_table.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
cases = list(dict.fromkeys(r["case"] for r in rows))
table = {}
for r in rows:
    table.setdefault((r["section"], r["metric"], r["unit"]), {})[r["case"]] = r["value"]
width = max(12, *(len(c) for c in cases))
print(f"{'section / metric (unit)':<70} " + " ".join(f"{c:>{width}}" for c in cases))
for (section, metric, unit), vals in table.items():
    name = f"{section} / {metric}" + (f" ({unit})" if unit else "")
    print(f"{name[:70]:<70} " + " ".join(f"{vals.get(c, '-'):>{width}}" for c in cases))
PY
