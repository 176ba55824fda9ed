#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 8: branch finish-mma (from m = 64 the split-k finish kernel takes 8 rows x 128
# columns per warp: H8 across column groups in registers, H16 as a tf32 m16n8k8 product; no
# shuffles). .s19/base.so = main's kernels, .s20/fm.so = the branch.
# 1) checks.sh on fm (verify, tests/gpu, memcheck, racecheck);
# 2) pinned cold A/B, alternated, two rounds: stream-k (m = 128-1024), split-k at m = 64;
# 3) graph_timeline of stream-k 5120x12288 m = 256 and 512 on both (the finish kernel's tail);
# 4) tuned A/B, 4-bit MCG, five shapes, m = 64, 128, 256, 512 (where the new kernel runs).
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 EXL3_COMMIT=finish-mma
exec > >(tee -a "$OUT/call8.log") 2>&1
so() { [ "$1" = fm ] && echo .s20/fm.so || echo .s19/base.so; }
bash scripts/bench/checks.sh .s20/fm.so fm 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror|^[a-z_]+ +[0-9]+ +[0-9]+" | head -40
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "5120 12288 4 1 1024 256 sk 1" "4096 4096 4 1 256 128 sk 1" "17408 5120 4 1 256 256 sk 1"
   "4096 11008 4 1 64 64 2 1")
for e in base fm base fm; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py $(so $e) $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in base fm; do
  echo "== timeline $e"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
    timeout 60 python3 scripts/bench/graph_timeline.py --ext $(so $e) --case 5120x12288:4:1:256 \
    --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
done
for e in base fm; do
  echo "== tuned $e"
  timeout 75 python3 scripts/bench/bench_linear.py --ext $(so $e) --no-exl3 --bits 4 --codebooks 1 \
    --m 64 128 256 512 --out "$OUT" --tag tuned_$e --budget-s 60 2>&1 | grep -E "^ *[0-9]+x|budget"
done
rm -f "$OUT"/pin_*.json  # printed above; the device returns at most 8 files
