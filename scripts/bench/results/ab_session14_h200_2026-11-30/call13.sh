#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 13: the six points where call 11 had ours >= ExLlamaV3, re-run alone twice
# in the same lease (ExLlamaV3 still built).
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
S=/tmp/exl3_next
for r in 1 2; do
  timeout 150 python3 scripts/bench/bench_linear.py --ext .s17/sp.so --exl3-state $S --bits 5 3 \
    --codebooks 2 --m 1 --shapes 5120x12288 5120x17408 --out "$OUT" --tag rerun_m1_r$r 2>&1 | grep -E "^ *[0-9]+x"
  timeout 150 python3 scripts/bench/bench_linear.py --ext .s17/sp.so --exl3-state $S --bits 2 \
    --codebooks 1 0 --m 4096 --shapes 5120x17408 17408x5120 --out "$OUT" --tag rerun_m4096_r$r 2>&1 | grep -E "^ *[0-9]+x"
done
