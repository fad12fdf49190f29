#!/usr/bin/env bash
# The issues' target measurement in one or two device calls: benchmarks/bench.py over every mode the
# targets name, on whatever library MLA_VARIANTS_GENERATED / the default build points at (build it, or
# unpack .prebuilt with lab/use_prebuilt.sh, first). Result files land in $OUT/r (and $OUT/r.tar).
# Sections run in the order given; each is skipped, with a line saying so, when fewer seconds than its
# estimate are left before the deadline (the second argument, seconds from the start):
#   b    the 200 bf16 q_len-1 cases, --check, and lab/report.py's target checks   ~240 s
#   q2   the 28 q_len-2 cases, --check                                              ~60 s
#   q34  q_len 3 and 4 on the q_len-2 shapes, each against its q_len-1 time          ~120 s
#   f8   the 28 fp8 cases, exact and fast mode, --check                             ~120 s
#   vl   varlen q_lens 1,2,3,4 on the q_len-2 shapes, --check                         ~60 s
#   bal  the ragged 128- and 16-head cases on the balanced plan, --check               ~60 s
#
#   lab/targets.sh "b q2" 540        then, on the warm machine:   lab/targets.sh "q34 f8 vl bal" 540
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
R=$OUT/r; mkdir -p "$R"
A=${ANCHORS:-$(pwd)/shared/anchors-h200.json}; M=${MODES_ANCHORS:-$(pwd)/shared/anchors-h200-modes.json}
DL=${2:-540}
room() { [ $SECONDS -lt $((DL - $1)) ] || { echo "skipped: $2 (elapsed $SECONDS s)"; return 1; }; }
B="python3 benchmarks/bench.py"
for s in ${1:-b q2}; do
  case $s in
    b)   room 240 b && $B --anchors "$A" --check --json "$R/bf16.json" 2>&1 | tail -4
         if [ -f "$R/bf16.json" ]; then python3 lab/report.py "$R/bf16.json" > "$R/report_bf16.txt" 2>&1; tail -20 "$R/report_bf16.txt"; fi ;;
    q2)  room 60 q2 && $B --anchors "$M" --mode bf16_q2 --check --json "$R/q2.json" 2>&1 | tail -4 ;;
    q34) for q in 3 4; do
           room 60 "q_len $q" && $B --anchors "$M" --mode bf16_q2 --q-len $q --vs-q1 --json "$R/q$q.json" 2>&1 | tail -4
         done ;;
    f8)  for m in exact fast; do
           room 60 "fp8 $m" && $B --anchors "$M" --dtype fp8_e4m3 --fp8-mode $m --check --json "$R/fp8_$m.json" 2>&1 | tail -4
         done ;;
    vl)  room 60 varlen && $B --anchors "$M" --mode bf16_q2 --varlen 1,2,3,4 --check --json "$R/varlen.json" 2>&1 | tail -4 ;;
    bal) for h in 128 16; do
           room 30 "balanced $h heads" && $B --anchors "$A" --heads $h --ragged --balanced --check --json "$R/balanced_h$h.json" 2>&1 | tail -4
         done ;;
    *)   echo "unknown section: $s (b q2 q34 f8 vl bal)"; exit 2 ;;
  esac
  echo "== $s: elapsed $SECONDS s"
done
(cd "$R" && tar -cf "$OUT/r.tar" . 2>/dev/null)
