#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 14: 5120x17408 MUL1 m = 1 (3 and 5 bits), the BM 16 plan at every k-split
# pinned cold, unspread and spread, then the tuned op.
set -u
: "${OUT:?}"
C=()
for b in 3 5; do for s in 1 2 3 4 5 6 8 10 12 16; do C+=("5120 17408 $b 2 1 16 $s 0"); done; done
for sp in 0 1; do
  VLLM_EXL3_SPREAD=$sp timeout 100 python3 scripts/bench/pin.py .s17/sp.so spread$sp "${C[@]}" 2>&1 | grep -v -i warn
done
timeout 60 python3 scripts/bench/bench_linear.py --ext .s17/sp.so --no-exl3 --bits 3 5 --codebooks 2 \
  --m 1 --shapes 5120x17408 --out "$OUT" --tag tuned 2>&1 | grep -E "^ *[0-9]+x"
