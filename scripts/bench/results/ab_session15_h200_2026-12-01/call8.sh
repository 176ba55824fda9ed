#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 8: tuned A/B of epi-quad's head (.s19/quad2.so) against main (.s19/sp.so),
# 4-bit MCG, five shapes, m = 128-1024, alternated, two rounds each.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
for r in 1 2; do
  for e in sp quad2; do
    echo "== $e round $r"
    timeout 120 python3 scripts/bench/bench_linear.py --ext .s19/$e.so --no-exl3 --bits 4 --codebooks 1 \
      --m 128 256 512 1024 --out "$OUT" --tag tuned_${e}_r$r 2>&1 | grep -E "^ *[0-9]+x"
    tail -n +2 "$OUT"/tuned_${e}_r${r}_*.csv | cut -d, -f1,2,5,6,8 | tr '\n' ' '; echo
  done
done
