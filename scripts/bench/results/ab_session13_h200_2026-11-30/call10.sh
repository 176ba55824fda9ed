#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 10 (.s17 carried: main.so = 79b3a63, epi.so = branch epi-rows 1b80cc3): the
# full checks of epi.so, then a tuned cold A/B against main (bench_linear --no-exl3, 4-bit MCG
# and MUL1, the five shapes), alternated twice, at m = 1 4 16 and at m = 64 256 1024.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
bash scripts/bench/checks.sh .s17/epi.so epi 2>&1 | grep -v "^check \|^nan_guard\|^input_val"
i=0
for M in "1 4 16" "64 256 1024"; do
  for e in main epi main epi; do
    i=$((i + 1))
    timeout 110 python3 scripts/bench/bench_linear.py --ext .s17/$e.so --no-exl3 --bits 4 \
      --codebooks 1 2 --m $M --out "$OUT" --tag r${i}_$e > "$OUT/bench_r${i}_$e.log" 2>&1
    echo "== r$i $e m=$M rc=$?"
  done
done
cd "$OUT" && tar czf call10.tgz *.json *.csv *.log && ls
