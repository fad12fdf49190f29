#!/usr/bin/env bash
# A/B one kernel switch on the same tree, timed and traced in one device call: scripts/ab_bench.sh
# (A = this tree, B = this tree built with CUDAFLAGS_B), then an MLA_TRACE build of each side and
# benchmarks/trace.py on both, cold and hot (--hot: no L2 flush), so a change's effect shows per phase.
#
#   CUDAFLAGS_B=-DMLA_ST_STORE_ROLLED=1 scripts/ab_trace.sh --filter 'h16_p1_bf16*'   # on the device,
#                                                                 # carry [".whl", "shared"]
#
# Environment: CUDAFLAGS_B (required), BENCH_ARGS (ab_bench.sh's; default the page-1/64 anchors of the
# filtered heads, checked), TRACE_ARGS (trace.py's case filters), PYTEST_B (ab_bench.sh), OUT. Output in
# $OUT: ab_A.json, ab_B.json, trace_{A,B}{,_hot}.json, ab_trace.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
set -f  # the filters' globs are codegen's patterns, not the shell's
root=$(pwd)
: "${CUDAFLAGS_B:?set CUDAFLAGS_B, the switch B is built with}"
export CUDAFLAGS_B
export BENCH_ARGS=${BENCH_ARGS:---anchors $root/shared/anchors-h200.json --check --page 1,64}
TRACE_ARGS=${TRACE_ARGS:---batch 1,8 --seq 1024 --page 1,64 --no-ragged --reps 5}
log=$OUT/ab_trace.log
{
  echo "== A/B bench (B: $CUDAFLAGS_B)"
  "$root/scripts/ab_bench.sh" . "$@"
  for side in A B; do
    flags=-DMLA_TRACE=1; [ "$side" = B ] && flags="$flags $CUDAFLAGS_B"
    echo "== trace build $side ($flags)"
    CUDAFLAGS="$flags" python3 -m codegen build -j 16 "$@" --build-dir "/tmp/abt_build_$side" \
        --generated-dir "/tmp/abt_gen_$side" 2>&1 | tail -1
  done
  for mode in cold hot; do
    extra=; suffix=; [ "$mode" = hot ] && { extra=--hot; suffix=_hot; }
    for side in A B; do
      echo "== trace $side, $mode"
      MLA_VARIANTS_GENERATED="/tmp/abt_gen_$side" python3 benchmarks/trace.py \
          --anchors "$root/shared/anchors-h200.json" $TRACE_ARGS $extra --json "$OUT/trace_$side$suffix.json" \
          | grep -v "^  first_wave\|^  later_waves"
    done
  done
} 2>&1 | tee "$log"
