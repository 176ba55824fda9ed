#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 13 (.s17/sp.so carried = main's csrc after merging epi-rows and the spread
# tuner change): the 4-bit targets table against bf16 on the merged kernels, tuned and cold,
# every m and codebook on the five shapes (bench_linear --no-exl3; ExLlamaV3 was not built in
# this session, its anchor stays session 12's).
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 500 python3 scripts/bench/bench_linear.py --ext .s17/sp.so --no-exl3 --bits 4 \
  --codebooks 1 0 2 --budget-s 440 --out "$OUT" --tag targets_merged > "$OUT/bench_targets.log" 2>&1
echo "rc=$?"; ls "$OUT"
