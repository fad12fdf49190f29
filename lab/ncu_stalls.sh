#!/usr/bin/env bash
# Where a decode kernel's warps wait, instruction by instruction: Nsight Compute's warp-state sampling
# (the SourceCounters section) of one decode launch, exported per SASS instruction and summed by
# lab/ncu_stalls.py into a ledger (the instructions that hold most samples, each with its main
# stall reasons, and the totals per reason). A diagnostic for kernel work, like ncu_cases.sh; the
# clocks are left alone (--clock-control none).
#
#   CASE=64:32:16384:64:fp8 lab/ncu_stalls.sh            # on the device, carry [".whl", "shared"]
#   CASE=128:32:16384:64 TOP=40 lab/ncu_stalls.sh --filter 'h128_p64_bf16*'
#
# CASE is HEADS:BATCH:SEQ:PAGE[:SPLITS][:fp8|:fast] (lab/profile_case.py's arguments). Build filter
# arguments, if given, build those variants first (default: use the existing build). Output:
# $OUT/stalls.ncu-rep (open it in Nsight Compute), $OUT/stalls_source.csv (the source page) and
# $OUT/stalls.txt (the ledger printed here).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
CASE=${CASE:?set CASE=HEADS:BATCH:SEQ:PAGE[:SPLITS][:fp8|:fast]}
TOP=${TOP:-30}
if [ $# -gt 0 ]; then python3 -m codegen build -j 16 "$@" 2>&1 | tail -1; fi
IFS=: read -r -a f <<< "$CASE"
rm -f "$OUT/stalls.ncu-rep"
# -s 2 -c 1: skip two decode launches (warm-up), profile the third.
ncu --clock-control none -k "regex:mla_decode_(fp8_fast_)?kernel" -s 2 -c 1 --section SourceCounters --section WarpStateStats \
    --import-source no -f -o "$OUT/stalls" python3 lab/profile_case.py "${f[@]}" > /tmp/ncu_stalls.log 2>&1 \
  || { echo "ncu failed"; tail -5 /tmp/ncu_stalls.log; exit 1; }
ncu --import "$OUT/stalls.ncu-rep" --page source --csv --print-source sass > "$OUT/stalls_source.csv" 2> /tmp/ncu_stalls.err \
  || { echo "source page export failed"; tail -5 /tmp/ncu_stalls.err; exit 1; }
python3 "$(dirname "$0")/ncu_stalls.py" "$OUT/stalls_source.csv" --top "$TOP" | tee "$OUT/stalls.txt"
