#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 6: branch finish-rows (the split-k finish kernel takes four rows of a
# 128-column block per warp from m = 4: their loads in flight together, the column factors
# loaded once). .s19/base.so = main's kernels, .s20/fr.so = the branch.
# 1) checks.sh on fr (verify, tests/gpu, memcheck, racecheck);
# 2) pinned cold A/B, alternated, two rounds: stream-k (m = 128-1024), classic split-k
#    (m = 1-64), the reconstruct path at m = 1024 and 4096, a whole-k control;
# 3) graph_timeline of stream-k 5120x12288 m = 256 and 512 on both (the finish kernel's tail);
# 4) tuned A/B, 4-bit MCG, five shapes, m = 1, 16, 128, 256, 512.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 EXL3_COMMIT=finish-rows
exec > >(tee -a "$OUT/call6.log") 2>&1
so() { [ "$1" = fr ] && echo .s20/fr.so || echo .s19/base.so; }
bash scripts/bench/checks.sh .s20/fr.so fr 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "5120 12288 4 1 1024 256 sk 1" "4096 4096 4 1 256 128 sk 1" "17408 5120 4 1 256 256 sk 1"
   "4096 4096 4 1 1 16 8 0" "4096 4096 4 1 16 16 8 0" "5120 12288 4 1 16 16 4 0"
   "4096 11008 4 1 64 64 2 1" "5120 12288 4 1 1024 0 1 0" "5120 12288 4 1 4096 0 1 0"
   "5120 12288 4 1 256 256 1 1")
for e in base fr base fr; do
  VLLM_EXL3_SPREAD=1 timeout 80 python3 scripts/bench/pin.py $(so $e) $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in base fr; do
  echo "== timeline $e"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
    timeout 60 python3 scripts/bench/graph_timeline.py --ext $(so $e) --case 5120x12288:4:1:256 \
    --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
done
for e in base fr; do
  echo "== tuned $e"
  timeout 90 python3 scripts/bench/bench_linear.py --ext $(so $e) --no-exl3 --bits 4 --codebooks 1 \
    --m 1 16 128 256 512 --out "$OUT" --tag tuned_$e --budget-s 75 2>&1 | grep -E "^ *[0-9]+x|budget"
done
rm -f "$OUT"/pin_*.json  # printed above; the device returns at most 8 files
