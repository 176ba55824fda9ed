#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 6: branch epi-quad (the wgmma tiers' tile epilogue on 4 lanes per row,
# 8 shuffles per row instead of 20; call 5 measured the Hadamard at 2.7 us of a BM 256 tile).
# .s19/sp.so = main's quick build, .s19/quad.so = the branch's.
# 1) checks.sh on quad (verify, tests/gpu, memcheck, racecheck);
# 2) pinned cold whole-k A/B, main and branch alternated, two rounds;
# 3) tuned A/B, 4-bit MCG, five shapes, m = 64-4096, one run each.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
bash scripts/bench/checks.sh .s19/quad.so quad 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
C=("5120 12288 4 1 256 256 1 1" "1024 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1"
   "5120 12288 4 1 128 128 1 1" "1024 12288 4 1 128 128 1 1" "4096 11008 4 1 64 64 1 1"
   "17408 5120 4 1 512 256 1 1" "4096 4096 4 1 2048 256 1 1")
for e in sp quad sp quad; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py .s19/$e.so $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in sp quad; do
  timeout 150 python3 scripts/bench/bench_linear.py --ext .s19/$e.so --no-exl3 --bits 4 --codebooks 1 \
    --m 64 128 256 512 1024 2048 4096 --out "$OUT" --tag tuned_$e 2>&1 | grep -E "^ *[0-9]+x"
done
