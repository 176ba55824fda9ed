#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 5 (branch probes-epi2, measurement only): what the tile epilogue costs. One
# build (.s19/probe.so) skips parts of it at run time, EXL3_PROBE_EPI = bits: 1 the output
# Hadamard, 2 the output stores, 4 the accumulator staging (7 = the whole epilogue but its
# shared-memory reads). Pinned cold (pin.py), whole-k plans, two rounds; k = 1024 rows next to
# k = 5120 separate the per-tile fixed cost from the k loop.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 VLLM_EXL3_SPREAD=1
C=("5120 12288 4 1 256 256 1 1" "1024 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1"
   "5120 12288 4 1 128 128 1 1" "1024 12288 4 1 128 128 1 1" "4096 11008 4 1 64 64 1 1"
   "1024 11008 4 1 64 64 1 1" "4096 4096 4 1 16 16 1 0" "1024 4096 4 1 16 16 1 0")
for round in 1 2; do
  for pe in 0 1 2 3 7; do
    EXL3_PROBE_EPI=$pe timeout 90 python3 scripts/bench/pin.py .s19/probe.so p${pe}_r$round "${C[@]}" 2>&1 | grep -v -i warn
  done
done
