#!/usr/bin/env bash
# wg-bulk-t e4cc1b4 first call, verbatim from the branch's scripts/bench/bulkt_call.sh body.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s17/bt.so --json "$OUT/verify_bt.json" \
  2>&1 | tail -11
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 \
    scripts/bench/verify_kernels.py --ext .s17/bt.so --sample 2>&1 | tail -1
  echo "$tool exit ${PIPESTATUS[0]}"
done
CFG=("5120 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1" "17408 5120 4 1 1024 256 1 1"
     "4096 4096 4 1 512 256 1 1" "5120 17408 4 1 256 256 sk 1" "5120 12288 4 1 128 128 1 1"
     "4096 4096 4 1 256 128 1 1" "4096 11008 4 1 64 64 1 1" "4096 11008 6 1 1024 256 1 1"
     "5120 12288 2 1 128 128 1 1")
for e in main bt main bt; do
  OUT=$OUT timeout 40 python3 scripts/bench/pin.py .s17/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
