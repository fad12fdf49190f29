#!/usr/bin/env bash
# A/B kernel switches on the same tree, timed and traced in one device call: scripts/ab_bench.sh
# (A = this tree, B = this tree built with CUDAFLAGS_B), then an MLA_TRACE build of each side and
# benchmarks/trace.py on all of them, cold and hot (--hot: no L2 flush), so a change's effect shows
# per phase. CUDAFLAGS_B may list several configurations separated by ';' (B1, B2, ...): A is built
# and benchmarked once, each B against it.
#
#   CUDAFLAGS_B="-DMLA_PARTIAL_16=0;-DMLA_Q_FIRST=0" scripts/ab_trace.sh --filter 'h16_p1_bf16*'
#                                                 # on the device, carry [".whl", "shared"]
#
# Environment: CUDAFLAGS_B (required), BENCH_ARGS (ab_bench.sh's; default the page-1/64 anchors of the
# built variants, checked), TRACE_ARGS (trace.py's case filters), PYTEST_B (ab_bench.sh's: pytest
# arguments, run against every B; give tests as node ids, since the shell splits the variable at
# spaces and a quoted -k expression does not survive), TIMELINE_ARGS (if set: benchmarks/timeline.py's
# case filters, run on every side's trace build, so decode and combine kernel times show apart; needs
# the traces, not SKIP_TRACE), SKIP_TRACE=1, OUT. Output: the log of all steps
# ($OUT/ab_trace.log) and $OUT/ab_trace.tgz with ab_A.json, ab_B<i>.json, ab_pytest_B<i>.log and
# trace_{A,B<i>}{,_hot}.json (one archive: the device returns at most 8 files from $OUT).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
set -f  # the filters' globs are codegen's patterns, not the shell's
root=$(pwd)
: "${CUDAFLAGS_B:?set CUDAFLAGS_B, the switch(es) B is built with}"
export BENCH_ARGS=${BENCH_ARGS:---anchors $root/shared/anchors-h200.json --check --page 1,64}
TRACE_ARGS=${TRACE_ARGS:---batch 1,8 --seq 1024 --page 1,64 --no-ragged --reps 5}
IFS=';' read -r -a configs <<<"$CUDAFLAGS_B"
main_out=/tmp/abt_out; rm -rf "$main_out"; mkdir -p "$main_out"
log=$main_out/ab_trace.log
{
  i=0
  for flags in "${configs[@]}"; do
    i=$((i + 1))
    echo "== A/B bench, B$i: $flags"
    sub=$main_out/b$i; mkdir -p "$sub"
    a_json=; [ -f "$main_out/ab_A.json" ] && a_json=$main_out/ab_A.json
    OUT=$sub A_JSON=$a_json CUDAFLAGS_B="$flags" "$root/scripts/ab_bench.sh" . "$@"
    [ -f "$main_out/ab_A.json" ] || cp "$sub/ab_A.json" "$main_out/ab_A.json"
    cp "$sub/ab_B.json" "$main_out/ab_B$i.json"
    [ -f "$sub/ab_pytest_B.log" ] && cp "$sub/ab_pytest_B.log" "$main_out/ab_pytest_B$i.log"
  done
  if [ -z "${SKIP_TRACE:-}" ]; then
    sides=(A); side_flags=("")
    i=0
    for flags in "${configs[@]}"; do i=$((i + 1)); sides+=("B$i"); side_flags+=("$flags"); done
    for k in "${!sides[@]}"; do
      side=${sides[$k]}
      echo "== trace build $side (-DMLA_TRACE=1 ${side_flags[$k]})"
      CUDAFLAGS="-DMLA_TRACE=1 ${side_flags[$k]}" python3 -m codegen build -j 16 "$@" \
          --build-dir "/tmp/abt_build_$side" --generated-dir "/tmp/abt_gen_$side" 2>&1 | tail -1
    done
    if [ -n "${TIMELINE_ARGS:-}" ]; then  # trace builds, but timeline.py never allocates the buffer: no stamps
      for side in "${sides[@]}"; do
        echo "== timeline $side"
        MLA_VARIANTS_GENERATED="/tmp/abt_gen_$side" python3 benchmarks/timeline.py \
            --anchors "$root/shared/anchors-h200.json" $TIMELINE_ARGS 2>&1 | grep -v "Warning\|_warn_once"
      done
    fi
    for mode in cold hot; do
      extra=; suffix=; [ "$mode" = hot ] && { extra=--hot; suffix=_hot; }
      for side in "${sides[@]}"; do
        echo "== trace $side, $mode"
        MLA_VARIANTS_GENERATED="/tmp/abt_gen_$side" python3 benchmarks/trace.py \
            --anchors "$root/shared/anchors-h200.json" $TRACE_ARGS $extra --json "$main_out/trace_$side$suffix.json" \
            | grep -v "^  first_wave\|^  later_waves"
      done
    done
  fi
} 2>&1 | tee "$log"
for k in "${!configs[@]}"; do rm -rf "$main_out/b$((k + 1))"; done  # (set -f: no globs here)
cp "$log" "$OUT/ab_trace.log"
tar -czf "$OUT/ab_trace.tgz" -C "$main_out" .
