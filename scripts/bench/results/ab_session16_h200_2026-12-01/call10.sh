#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 10 - written, NOT RUN (the session's device time was spent): branch
# finish-mma2 (branches/finish-mma2_011f10e.diff), finish-mma with the column factors staged
# once per block in shared memory before the grid wait. .s19/base.so = main's kernels,
# .s20/fm2.so = the branch. The same steps as call 8, plus a timeline at m = 1024 (the anomaly
# of NEXT_SESSION.md's device plan, item 2).
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 EXL3_COMMIT=finish-mma2
exec > >(tee -a "$OUT/call10.log") 2>&1
so() { [ "$1" = fm2 ] && echo .s20/fm2.so || echo .s19/base.so; }
bash scripts/bench/checks.sh .s20/fm2.so fm2 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror|^[a-z_]+ +[0-9]+ +[0-9]+" | head -40
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "5120 12288 4 1 1024 256 sk 1" "4096 4096 4 1 256 128 sk 1" "17408 5120 4 1 256 256 sk 1"
   "4096 11008 4 1 64 64 2 1")
for e in base fm2 base fm2; do
  VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py $(so $e) $e "${C[@]}" 2>&1 | grep -v -i warn
done
for e in base fm2; do
  echo "== timeline $e"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 \
    timeout 80 python3 scripts/bench/graph_timeline.py --ext $(so $e) --case 5120x12288:4:1:256 \
    --case 5120x12288:4:1:512 --case 5120x12288:4:1:1024 2>&1 | grep -E "^[0-9]"
done
for e in base fm2; do
  echo "== tuned $e"
  timeout 75 python3 scripts/bench/bench_linear.py --ext $(so $e) --no-exl3 --bits 4 --codebooks 1 \
    --m 64 128 256 512 --out "$OUT" --tag tuned_$e --budget-s 60 2>&1 | grep -E "^ *[0-9]+x|budget"
done
rm -f "$OUT"/pin_*.json  # printed above; the device returns at most 8 files
