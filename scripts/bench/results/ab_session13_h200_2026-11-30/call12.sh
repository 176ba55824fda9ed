#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 12 (.s17 carried: epi.so = branch epi-rows 1b80cc3; sp.so = the same plus the
# tuner timing Plan::spread from 17 rows wherever the grid leaves room to stack). verify and
# tests/gpu on sp.so, then a tuned cold A/B epi / sp alternated twice at m = 32-512 (4-bit MCG
# and MUL1, the five shapes).
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s17/sp.so --json "$OUT/verify_sp.json" 2>&1 | tail -10
VLLM_EXL3_EXT=.s17/sp.so timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -2
i=0
for e in epi sp epi sp; do
  i=$((i + 1))
  timeout 120 python3 scripts/bench/bench_linear.py --ext .s17/$e.so --no-exl3 --bits 4 \
    --codebooks 1 2 --m 32 64 128 256 512 --out "$OUT" --tag r${i}_$e > "$OUT/bench_r${i}_$e.log" 2>&1
  echo "== r$i $e rc=$?"
done
cd "$OUT" && rm -f *.csv r*_2026-11-30.json && ls
