#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 7: epi-quad's head (quad rows from BM 128 only), the build to merge
# (.s19/quad2.so), against main (.s19/sp.so).
# 1) checks.sh (verify, tests/gpu, memcheck, racecheck);
# 2) pinned cold whole-k A/B at BM 64 / 128 / 256, alternated, two rounds;
# 3) the targets table's points without ExLlamaV3: 4-bit, three codebooks, five shapes, every m.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
bash scripts/bench/checks.sh .s19/quad2.so quad2 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
C=("5120 12288 4 1 256 256 1 1" "1024 12288 4 1 256 256 1 1" "5120 12288 4 1 128 128 1 1"
   "1024 12288 4 1 128 128 1 1" "4096 11008 4 1 64 64 1 1" "1024 11008 4 1 64 64 1 1")
for e in sp quad2 sp quad2; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py .s19/$e.so $e "${C[@]}" 2>&1 | grep -v -i warn
done
timeout 330 python3 scripts/bench/bench_linear.py --ext .s19/quad2.so --no-exl3 --bits 4 \
  --codebooks 1 0 2 --out "$OUT" --tag targets_quad2 --budget-s 300 2>&1 | grep -E "^ *[0-9]+x|budget"
