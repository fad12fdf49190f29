#!/usr/bin/env bash
# One call on the H200 (lab/README.md): install, build, run the GPU tests, benchmark.
#   lab/device_check.sh [build-filter-args...]
# Environment: BENCH_ARGS (default: a small subset), PYTEST_ARGS (default: -x -q tests).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -m codegen build -j 16 "$@" 2>&1 | tee "$OUT/build.log" | tail -5 || exit 1
cp build/resource_usage.json "$OUT/" 2>/dev/null
python3 -m pytest ${PYTEST_ARGS:--x -q tests} 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 examples/decode_presets.py 2>&1 | tee "$OUT/example.log" | tail -15
if [ -n "${BENCH_ARGS+x}" ] && [ -n "$BENCH_ARGS" ]; then
  python3 benchmarks/bench.py $BENCH_ARGS --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
