#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 9 (.s17 carried: main.so = 79b3a63, epi.so = the epilogue in row groups):
# verify epi.so (full), then pinned cold A/B main / epi alternated twice at the points whose
# tile epilogue is long (BM 256: 32 rows per warp) or short (BM 16), full-k and split-k.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s17/epi.so --json "$OUT/verify_epi.json" 2>&1 | tail -10
CFG=("1024 12288 4 1 256 256 1 1" "5120 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1"
     "4096 4096 4 1 512 256 1 1" "4096 4096 4 1 256 128 2 1" "5120 12288 4 1 128 128 sk 1"
     "4096 11008 4 1 64 64 1 1" "4096 4096 4 1 16 16 1 0" "5120 17408 4 1 256 256 sk 1"
     "17408 5120 4 1 512 256 1 1")
for e in main epi main epi; do
  timeout 60 python3 scripts/bench/pin.py .s17/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
