#!/usr/bin/env bash
# A/B kernel trees, timed and traced in one device call: lab/ab_bench.sh (A = this tree, B = another
# tree: an experiment's branch; experiments live on branches, never as compile-time switches on main),
# then an MLA_TRACE build of each side and each side's own lab/trace.py on it, cold and hot (--hot: no
# L2 flush), so a change's effect shows per phase. OTHER_TREES may list several trees separated by ';'
# (B1, B2, ...): A is built and benchmarked once, each B against it.
#
#   git archive --prefix=ab/ <branch> | tar -x                 # here: B's tree in ./ab (ignored by git)
#   lab/ab_trace.sh ab --filter 'h16_p1_bf16*'                 # on the device, carry [".whl", "shared", "ab"]
#   lab/ab_trace.sh "ab1;ab2" --filter 'h16_p1_bf16*'          # two experiments against this tree
#
# Environment: BENCH_ARGS (ab_bench.sh's; default the page-1/64 anchors of the built variants,
# checked), TRACE_ARGS (trace.py's case filters), PYTEST_B (ab_bench.sh's: pytest arguments, run
# against every B; give tests as node ids, since the shell splits the variable at spaces and a quoted
# -k expression does not survive), TIMELINE_ARGS (if set: lab/timeline.py's case filters, run on
# every side's trace build, so decode and combine kernel times show apart; needs the traces, not
# SKIP_TRACE), SKIP_TRACE=1, OUT. Output: the log of all steps ($OUT/ab_trace.log) and
# $OUT/ab_trace.tgz with ab_A.json, ab_B<i>.json, ab_pytest_B<i>.log and trace_{A,B<i>}{,_hot}.json
# (one archive: the device returns at most 8 files from $OUT).
set -uo pipefail
trees_b=${1:?usage: lab/ab_trace.sh "OTHER_TREE[;OTHER_TREE...]" [build filter args...]}
shift
source "$(dirname "$0")/device_env.sh"
set -f  # the filters' globs are codegen's patterns, not the shell's
root=$(pwd)
export BENCH_ARGS=${BENCH_ARGS:---anchors $root/shared/anchors-h200.json --check --page 1,64}
TRACE_ARGS=${TRACE_ARGS:---batch 1,8 --seq 1024 --page 1,64 --no-ragged --reps 5}
IFS=';' read -r -a others <<<"$trees_b"
main_out=/tmp/abt_out; rm -rf "$main_out"; mkdir -p "$main_out"
log=$main_out/ab_trace.log
{
  i=0
  for other in "${others[@]}"; do
    i=$((i + 1))
    echo "== A/B bench, B$i: $other"
    sub=$main_out/b$i; mkdir -p "$sub"
    a_json=; [ -f "$main_out/ab_A.json" ] && a_json=$main_out/ab_A.json
    OUT=$sub A_JSON=$a_json "$root/lab/ab_bench.sh" "$other" "$@"
    [ -f "$main_out/ab_A.json" ] || cp "$sub/ab_A.json" "$main_out/ab_A.json"
    cp "$sub/ab_B.json" "$main_out/ab_B$i.json"
    [ -f "$sub/ab_pytest_B.log" ] && cp "$sub/ab_pytest_B.log" "$main_out/ab_pytest_B$i.log"
  done
  if [ -z "${SKIP_TRACE:-}" ]; then
    sides=(A); side_trees=("$root")
    i=0
    for other in "${others[@]}"; do i=$((i + 1)); sides+=("B$i"); side_trees+=("$(cd "$other" && pwd)"); done
    for k in "${!sides[@]}"; do
      side=${sides[$k]}
      echo "== trace build $side (-DMLA_TRACE=1, ${side_trees[$k]})"
      (cd "${side_trees[$k]}" && CUDAFLAGS=-DMLA_TRACE=1 python3 -m codegen build -j 16 "$@" \
          --build-dir "/tmp/abt_build_$side" --generated-dir "/tmp/abt_gen_$side" 2>&1 | tail -1)
    done
    # Each side's tools and package run from its own tree (its Python package and ABI), as in ab_bench.sh.
    if [ -n "${TIMELINE_ARGS:-}" ]; then  # trace builds, but timeline.py never allocates the buffer: no stamps
      for k in "${!sides[@]}"; do
        side=${sides[$k]}; tree=${side_trees[$k]}
        echo "== timeline $side"
        (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MLA_VARIANTS_GENERATED="/tmp/abt_gen_$side" \
            python3 lab/timeline.py --anchors "$root/shared/anchors-h200.json" $TIMELINE_ARGS 2>&1 \
            | grep -v "Warning\|_warn_once")
      done
    fi
    for mode in cold hot; do
      extra=; suffix=; [ "$mode" = hot ] && { extra=--hot; suffix=_hot; }
      for k in "${!sides[@]}"; do
        side=${sides[$k]}; tree=${side_trees[$k]}
        echo "== trace $side, $mode"
        (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MLA_VARIANTS_GENERATED="/tmp/abt_gen_$side" \
            python3 lab/trace.py --anchors "$root/shared/anchors-h200.json" $TRACE_ARGS $extra \
            --json "$main_out/trace_$side$suffix.json" | grep -v "^  first_wave\|^  later_waves")
      done
    done
  fi
} 2>&1 | tee "$log"
for k in "${!others[@]}"; do rm -rf "$main_out/b$((k + 1))"; done  # (set -f: no globs here)
cp "$log" "$OUT/ab_trace.log"
tar -czf "$OUT/ab_trace.tgz" -C "$main_out" .
