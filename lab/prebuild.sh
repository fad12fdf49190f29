#!/usr/bin/env bash
# Run here (the machine without a GPU, where CPU time is free) to spare a device call the minutes of
# `codegen build` (the 80-variant default build took 215 s on the H100 machine's 16 cores): builds the
# library of this checkout's sources into /tmp/prebuilt, then packs its generated/ folder and the library
# into .prebuilt/library.tar.xz (about a tenth of the library's size) with .prebuilt/stamp, the hash of the
# sources it was built from. On the device, lab/use_prebuilt.sh checks the stamp against the sources
# there and unpacks; name ".prebuilt" in the call's carry.
#   lab/prebuild.sh [build filter args...]      # no arguments: the default build (about 22 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/prebuilt
python3 -m codegen build -j "$(nproc)" --generated-dir /tmp/prebuilt/generated --build-dir /tmp/prebuilt/build "$@"
mkdir -p .prebuilt
tar -C /tmp/prebuilt -cJf .prebuilt/library.tar.xz generated build/libmla_variants.so
bash lab/use_prebuilt.sh --stamp > .prebuilt/stamp
ls -la .prebuilt
