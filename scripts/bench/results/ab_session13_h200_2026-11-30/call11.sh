#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 11 (.s17/epi.so carried = branch epi-rows 1b80cc3): tests/gpu on epi.so (call
# 10's log of it did not come back), then whether Plan::spread pays above 16 rows. Call 8's k-scan
# found the classic BM 128 grid at m = 128 (96 blocks, room for two per SM) 0.89 us per stage
# against BM 256's 0.68 with twice the MMA work: blocks stacked two on an SM would explain it.
# Pinned cold, VLLM_EXL3_SPREAD = 0 / 1 alternated twice, grids below two blocks per SM.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
VLLM_EXL3_EXT=.s17/epi.so timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -2
CFG=("5120 12288 4 1 128 128 1 1" "1024 12288 4 1 128 128 1 1" "4096 4096 4 1 256 128 2 1"
     "4096 4096 4 1 128 128 4 1" "4096 11008 4 1 64 64 1 1" "5120 12288 4 1 64 64 1 1"
     "17408 5120 4 1 256 128 1 1" "5120 12288 4 1 256 256 1 1" "4096 11008 4 1 32 32 1 0"
     "5120 17408 4 1 128 128 1 1")
for sp in 0 1 0 1; do
  VLLM_EXL3_SPREAD=$sp timeout 60 python3 scripts/bench/pin.py .s17/epi.so sp$sp "${CFG[@]}" 2>&1 | grep -v -i warn
done
