#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 9: branch finish-quad (the split-k finish kernel and the input transform on
# 4 lanes per (row, 128-block), hadamard128_quad). .s19/base.so = main d341c91, .s19/fin.so =
# the branch.
# 1) checks.sh on fin (verify, tests/gpu, memcheck, racecheck);
# 2) pinned cold A/B, alternated, two rounds: stream-k and split-k plans (finish kernel and
#    transform) and whole-k plans (transform only);
# 3) graph_timeline of stream-k 5120x12288 m = 256 and 512 on both (the finish kernel's tail);
# 4) tuned A/B, 4-bit MCG, five shapes, m = 1, 16, 128, 256, 512, one run each.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
bash scripts/bench/checks.sh .s19/fin.so fin 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "4096 4096 4 1 256 128 sk 1" "4096 4096 4 1 1 16 8 0" "4096 4096 4 1 16 16 8 0"
   "5120 12288 4 1 16 16 4 0" "5120 12288 4 1 256 256 1 1" "4096 4096 4 1 1 16 1 0")
for e in base fin base fin; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py .s19/$e.so $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in base fin; do
  echo "== timeline $e"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
    timeout 60 python3 scripts/bench/graph_timeline.py --ext .s19/$e.so --case 5120x12288:4:1:256 \
    --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
done
for e in base fin; do
  echo "== tuned $e"
  timeout 120 python3 scripts/bench/bench_linear.py --ext .s19/$e.so --no-exl3 --bits 4 --codebooks 1 \
    --m 1 16 128 256 512 --out "$OUT" --tag tuned_$e 2>&1 | grep -E "^ *[0-9]+x"
  tail -n +2 "$OUT"/tuned_${e}_*.csv | cut -d, -f1,2,5,6,8 | tr '\n' ' '; echo
done
