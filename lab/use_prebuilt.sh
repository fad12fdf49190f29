#!/usr/bin/env bash
# On the device: unpack the library lab/prebuild.sh built on the CPU machine into generated/ and
# build/ (where `codegen build` would have put them), after checking that .prebuilt/stamp matches the
# sources here; then the GPU tests and bench.py run without a build. Exits 1, unpacking nothing, when
# the sources differ (rebuild with lab/prebuild.sh, or run `codegen build` on the device).
#   lab/use_prebuilt.sh            check and unpack
#   lab/use_prebuilt.sh --stamp    print this tree's stamp (what lab/prebuild.sh records)
set -euo pipefail
cd "$(dirname "$0")/.."
# The stamp: the kernel sources and the generator (the hashes codegen puts in every generated file's
# header) and variants.yaml. The compiler is left out on purpose: the library is sm_90a code from the
# nvcc here, which the device's driver runs.
stamp=$(python3 -c 'import hashlib; from codegen.render import generator_digest, kernel_digest
print(kernel_digest(), generator_digest(), hashlib.sha256(open("variants.yaml", "rb").read()).hexdigest()[:16])')
if [ "${1:-}" = "--stamp" ]; then echo "$stamp"; exit 0; fi
if [ "$(cat .prebuilt/stamp 2>/dev/null)" != "$stamp" ]; then
  echo "use_prebuilt: .prebuilt/stamp ($(cat .prebuilt/stamp 2>/dev/null || echo none)) is not this tree's ($stamp): not unpacked" >&2
  exit 1
fi
rm -rf generated build
python3 -m tarfile -e .prebuilt/library.tar.xz .  # Python's tarfile: no xz binary needed there
echo "use_prebuilt: unpacked generated/ and build/libmla_variants.so ($(python3 -c 'import json; print(len(json.load(open("generated/manifest.json"))["variants"]))') variants)"
