#!/usr/bin/env bash
# One device call that answers "where does a call's fixed time go" (lab log v3.13 in docs/archive, plan
# item 3): a default build and an MLA_TRACE build of the same variants, then
#   1. lab/trace.py on the trace build: per-CTA phases, cold and with the code warm;
#   2. lab/trace.py --balanced on ragged cases: the scheduled CTAs' per-tile / per-segment fit;
#   3. benchmarks/bench.py --code-warm on the default build: cold minus code-warm = instruction fetch;
#   4. lab/ncu_cases.sh on the default build (CASES, default 128 x 128 x 16384 at pages 1/16/64).
#
#   lab/diagnose.sh            # on the device, with carry [".whl", "shared"] (lab/prepare_carry.sh)
#
# Environment: FILTERS (build filters), TRACE_ARGS, BALANCED_ARGS, WARM_ARGS (case filters of the three
# runs), CASES (ncu), SKIP_NCU=1. Output in $OUT (7 files): trace.json, trace_warm.json,
# trace_balanced.json, codewarm.json, the log of all steps (diagnose.log), ncu.csv and ncu_table.txt.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
set -f  # the filters' globs are codegen's patterns, not the shell's
root=$(pwd)
anchors="--anchors $root/shared/anchors-h200.json"
FILTERS=${FILTERS:---filter h16_p*_bf16* --filter h128_p*_bf16* --filter h64_p64_bf16*}
TRACE_ARGS=${TRACE_ARGS:---heads 16,128 --batch 1,8,128 --seq 1024 --page 1,64 --no-ragged --reps 5}
BALANCED_ARGS=${BALANCED_ARGS:---heads 128 --ragged --reps 5}
WARM_ARGS=${WARM_ARGS:---heads 16,128 --batch 1 --page 1,64 --check}
log=$OUT/diagnose.log
{
  echo "== builds: default (/tmp/diag_gd) and MLA_TRACE=1 (/tmp/diag_gt): $FILTERS"
  python3 -m codegen build -j 16 $FILTERS --build-dir /tmp/diag_bd --generated-dir /tmp/diag_gd 2>&1 | tail -2
  CUDAFLAGS=-DMLA_TRACE=1 python3 -m codegen build -j 16 $FILTERS --build-dir /tmp/diag_bt \
      --generated-dir /tmp/diag_gt 2>&1 | tail -2
  echo "== 1. phase trace, cold, then with the kernels' code warm"
  MLA_VARIANTS_GENERATED=/tmp/diag_gt python3 lab/trace.py $anchors $TRACE_ARGS --json "$OUT/trace.json"
  MLA_VARIANTS_GENERATED=/tmp/diag_gt python3 lab/trace.py $anchors $TRACE_ARGS --code-warm \
      --json "$OUT/trace_warm.json"
  echo "== 2. balanced schedule: per-tile and per-segment cost of the scheduled CTAs"
  MLA_VARIANTS_GENERATED=/tmp/diag_gt python3 lab/trace.py $anchors $BALANCED_ARGS --balanced \
      --json "$OUT/trace_balanced.json"
  echo "== 3. cold vs code-warm (default build)"
  MLA_VARIANTS_GENERATED=/tmp/diag_gd python3 benchmarks/bench.py $anchors $WARM_ARGS --code-warm \
      --json "$OUT/codewarm.json" 2>&1 | tail -40
} 2>&1 | tee "$log"
if [ -z "${SKIP_NCU:-}" ]; then
  echo "== 4. ncu (default build)" | tee -a "$log"
  MLA_VARIANTS_GENERATED=/tmp/diag_gd lab/ncu_cases.sh 2>&1 | tail -80 | tee -a "$log"
fi
