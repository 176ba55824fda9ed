#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 2 (call 1 again on the fixed build 6ab/next commit): branch sk-fixup (re-written this session; session 14's branch was lost with
# its checkout). Stream-k split tiles are finished in the GEMM by their last arrival, whole tiles
# go straight to the epilogue, and the finish kernel is gone for stream-k plans. Run from the
# repository root with .s19 carried: sp.so = main's quick build, skfix.so = this branch's.
# 1) checks.sh on skfix (verify, tests/gpu, memcheck, racecheck);
# 2) stream-k pinned cold, main and branch alternated, with whole-k as the bar;
# 3) graph_timeline of the branch's stream-k (no finish kernel should remain);
# 4) a tuned A/B at m = 64-1024 (4-bit MCG, five shapes), one run each.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
bash scripts/bench/checks.sh .s19/skfix.so skfix 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "5120 17408 4 1 256 256 sk 1" "4096 4096 4 1 256 128 sk 1" "17408 5120 4 1 512 256 sk 1"
   "5120 12288 4 1 128 128 1 1" "5120 12288 4 1 256 256 1 1" "5120 12288 4 1 512 256 1 1"
   "5120 17408 4 1 256 256 1 1")
for e in sp skfix sp skfix; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py .s19/$e.so $e "${C[@]}" 2>&1 | grep -v -i warn
done
VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
  timeout 60 python3 scripts/bench/graph_timeline.py --ext .s19/skfix.so --case 5120x12288:4:1:256 \
  --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
for e in sp skfix; do
  timeout 100 python3 scripts/bench/bench_linear.py --ext .s19/$e.so --no-exl3 --bits 4 --codebooks 1 \
    --m 64 128 256 512 1024 --out "$OUT" --tag tuned_$e 2>&1 | grep -E "^ *[0-9]+x"
done
