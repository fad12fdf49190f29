#!/usr/bin/env bash
# A/B two kernel trees in one call on the H200: the working tree (A) against another tree (B, an
# experiment's branch: experiments live on branches, never as compile-time switches on main), each
# built into its own build/generated folders from the same variant filter, benchmarked on the same
# anchor cases, then compared case by case (B's time / A's time; geomean).
#
#   git archive --prefix=ab/ <branch> | tar -x      # here: B's tree in ./ab (ignored by git)
#   lab/ab_bench.sh ab --filter "h*_p64_bf16*"  # on the device, with carry [".whl", "shared", "ab"]
#
# Environment: BENCH_ARGS (default: the page-64 anchors, checked), PYTEST_B (if set, pytest arguments
# to run B's own tests against B's build, e.g. "-q -x tests/test_gpu_fp8.py"), OUT (where logs and
# JSON go), A_JSON (if set to an existing file: A's results from an earlier run with the same filter
# and BENCH_ARGS; A is then neither built nor benchmarked again, so several B trees share one A).
# Both sides are built without extra nvcc flags: main has no compile-time switches to A/B.
set -uo pipefail
other=${1:?usage: lab/ab_bench.sh OTHER_TREE [build filter args...]}
shift
source "$(dirname "$0")/device_env.sh"
root=$(pwd)
# Both sides run from their own tree: give anchors paths as absolute ($PWD/shared/...).
BENCH_ARGS=${BENCH_ARGS:---anchors $root/shared/anchors-h200.json --check --page 64}
sides="A B"
if [ -n "${A_JSON:-}" ] && [ -f "$A_JSON" ]; then
  sides=B; [ "$A_JSON" -ef "$OUT/ab_A.json" ] || cp "$A_JSON" "$OUT/ab_A.json"
fi
for side in $sides; do
  tree=$root; [ "$side" = B ] && tree=$(cd "$other" && pwd)
  # One build tree per source tree: CMake refuses a build folder configured for another source.
  tag=$side; [ "$side" = B ] && tag=B_$(basename "$tree")
  (cd "$tree" && CUDAFLAGS= python3 -m codegen build -j 16 "$@" \
      --build-dir "/tmp/ab_build_$tag" --generated-dir "/tmp/ab_gen_$tag" 2>&1 | tail -3) || exit 1
  [ "$side" = B ] && gen_B=/tmp/ab_gen_$tag
  # The benchmark and the library come from the side's own tree (its Python package and ABI).
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MLA_VARIANTS_GENERATED="/tmp/ab_gen_$tag" \
      python3 benchmarks/bench.py $BENCH_ARGS --json "$OUT/ab_$side.json" 2>&1 | tail -3)
done
if [ -n "${PYTEST_B:-}" ]; then
  (cd "$(cd "$other" && pwd)" && PYTHONPATH="$(pwd):${PYTHONPATH:-}" MLA_VARIANTS_GENERATED=$gen_B \
      python3 -m pytest -p no:cacheprovider $PYTEST_B 2>&1 | tee "$OUT/ab_pytest_B.log" | tail -8)
fi
python3 "$root/lab/ab_compare.py" "$OUT/ab_A.json" "$OUT/ab_B.json"
