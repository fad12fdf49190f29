#!/usr/bin/env bash
# Run here (the machine without a GPU) before the first device call of a session: puts what the device
# machine cannot download into git-ignored folders of this checkout, to be named in the call's carry:
#   .whl/    the nvidia-cutlass wheel (CUTLASS/CuTe headers; the device has no network), which
#            lab/device_env.sh installs there
#   shared/  a copy of the team's anchors (../shared/anchors-h200*.json), which the benchmark reads
# Then: run(command="... lab/device_check.sh ...", carry=[".whl", "shared"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl shared
if ! ls .whl/nvidia_cutlass-4.2.0.0-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl nvidia-cutlass==4.2.0.0
fi
for f in anchors-h200.json anchors-h200-modes.json; do
  [ -f "../shared/$f" ] && cp -f "../shared/$f" shared/ && chmod u+w "shared/$f" || echo "note: ../shared/$f not found (the benchmark then runs without peer times)"
done
ls -la .whl shared
