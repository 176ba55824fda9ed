#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 7 (main 79b3a63, .s17/main.so carried): where the wgmma engine's time goes now
# that A arrives by TMA - ncu stall reasons and tensor-pipe activity at the tiers that miss the
# 1.0x bf16 target (m = 128-1024), for the decision between de-synchronising the two warpgroups
# (a producer warp on mbarriers, no __syncthreads per stage) and other levers.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
M=gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
for r in barrier long_scoreboard wait math_pipe_throttle short_scoreboard selected dispatch_stall \
         misc not_selected membar mio_throttle lg_throttle sleeping branch_resolving no_instruction; do
  M="$M,smsp__warp_issue_stalled_${r}_per_warp_active.pct"
done
for a in "1024 --bm 256 --split 1 --k 5120 --n 12288" "256 --bm 256 --split 1 --k 5120 --n 12288" \
         "128 --bm 128 --split 1 --k 5120 --n 12288" "256 --bm 128 --split 2 --k 4096 --n 4096" \
         "64 --bm 64 --split 1 --k 4096 --n 11008"; do
  echo "== m=$a"
  VLLM_EXL3_WGMMA=1 VLLM_EXL3_SPREAD=0 timeout 100 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
    --metrics "$M" python3 scripts/bench/ncu_probe.py 4 1 $a --ext .s17/main.so 2>&1 \
    | grep -E "^\s+(gpu__|sm__|smsp__|launch__)|==ERR|rror" | sed -E 's/smsp__warp_issue_stalled_//; s/_per_warp_active.pct//'
done
