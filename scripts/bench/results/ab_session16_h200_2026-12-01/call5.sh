#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 5 (same lease as call 4, ExLlamaV3 still built): the points of calls 3-4
# where ours was not faster than ExLlamaV3, re-run alone twice.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 EXL3_COMMIT=5e7a445
S=/tmp/exl3_next
for r in 1 2; do
  timeout 100 python3 scripts/bench/bench_linear.py --ext .s19/base.so --exl3-state $S --bits 5 3 \
    --codebooks 2 --m 1 --shapes 5120x12288 5120x17408 --out "$OUT" --tag rerun_m1_r$r 2>&1 | grep -E "^ *[0-9]+x"
  timeout 100 python3 scripts/bench/bench_linear.py --ext .s19/base.so --exl3-state $S --bits 2 \
    --codebooks 0 1 2 --m 4096 --shapes 5120x17408 17408x5120 --out "$OUT" --tag rerun_m4096_r$r 2>&1 | grep -E "^ *[0-9]+x"
  timeout 60 python3 scripts/bench/bench_linear.py --ext .s19/base.so --exl3-state $S --bits 4 \
    --codebooks 2 --m 2048 --shapes 17408x5120 --out "$OUT" --tag rerun_m2048_r$r 2>&1 | grep -E "^ *[0-9]+x"
done
