# Sourced by the device scripts (device_check.sh, ab_bench.sh): $OUT, unbuffered Python, the carried
# nvidia-cutlass wheel on PYTHONPATH, and this checkout installed in editable mode.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# A script run by another that sourced this already (ab_trace.sh -> ab_bench.sh) installs nothing again.
[ -n "${MLA_DEVICE_ENV_DONE:-}" ] && return 0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
export MLA_DEVICE_ENV_DONE=1
