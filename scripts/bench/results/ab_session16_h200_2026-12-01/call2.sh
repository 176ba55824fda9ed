#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 2: sk-store against main. .s19/base.so = main's kernels (d341c91; main's
# later commits leave the SASS identical), .s20/sk.so = branch sk-store. ExLlamaV3's build from
# call 1 keeps running in the background.
# 1) pinned cold A/B, alternated, two rounds: stream-k plans (m = 128-1024) and classic split-k
#    plans (m = 1-64), the two forms the workspace protocol changes; a whole-k plan as control;
# 2) graph_timeline of stream-k 5120x12288 m = 256 and 512 on both (the finish kernel's tail);
# 3) finish_l2_call.sh on base (DRAM bytes of the finish kernel that still re-zeroes);
# 4) tuned A/B, 4-bit MCG, five shapes, m = 1, 16, 64, 128, 256, 512, 1024, one run each.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "5120 12288 4 1 1024 256 sk 1" "4096 4096 4 1 256 128 sk 1" "17408 5120 4 1 256 256 sk 1"
   "4096 4096 4 1 1 16 8 0" "4096 4096 4 1 16 16 8 0" "5120 12288 4 1 16 16 4 0"
   "4096 11008 4 1 64 64 2 1" "5120 12288 4 1 256 256 1 1")
for e in base sk base sk; do
  so=.s19/base.so; [ $e = sk ] && so=.s20/sk.so
  VLLM_EXL3_SPREAD=1 timeout 70 python3 scripts/bench/pin.py $so $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in base sk; do
  so=.s19/base.so; [ $e = sk ] && so=.s20/sk.so
  echo "== timeline $e"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
    timeout 60 python3 scripts/bench/graph_timeline.py --ext $so --case 5120x12288:4:1:256 \
    --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
done
bash scripts/bench/finish_l2_call.sh .s19/base.so 2>&1 | tee "$OUT/finish_l2_base.log"
for e in base sk; do
  so=.s19/base.so; [ $e = sk ] && so=.s20/sk.so
  echo "== tuned $e"
  timeout 110 python3 scripts/bench/bench_linear.py --ext $so --no-exl3 --bits 4 --codebooks 1 \
    --m 1 16 64 128 256 512 1024 --out "$OUT" --tag tuned_$e --budget-s 95 2>&1 | grep -E "^ *[0-9]+x|budget"
done
