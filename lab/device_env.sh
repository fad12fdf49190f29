# Sourced by the device scripts (device_check.sh, ab_bench.sh): $OUT, unbuffered Python, the carried
# nvidia-cutlass wheel on PYTHONPATH, and this checkout installed in editable mode.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# A script run by another that sourced this already (ab_trace.sh -> ab_bench.sh) installs nothing again.
[ -n "${MLA_DEVICE_ENV_DONE:-}" ] && return 0
if ls .whl/*.whl >/dev/null 2>&1; then
  # Installed once per machine and wheel content: a reinstall rewrites the CUTLASS headers, and their
  # new mtimes made the next `codegen build` on a warm machine recompile every variant (v3.16).
  want=$(cat .whl/*.whl | sha256sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.mla_wheels_sha256 2>/dev/null)" != "$want" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    echo "$want" > /tmp/site/.mla_wheels_sha256
  fi
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
export MLA_DEVICE_ENV_DONE=1
