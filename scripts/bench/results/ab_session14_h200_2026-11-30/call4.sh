#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 4: ncu on the GEMM kernel alone (cache flushed, clocks free): L2 and DRAM
# throughput, tensor-pipe activity and three stall reasons, whole-k against stream-k.
set -u
M=gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__cycles_active.avg,sm__cycles_elapsed.avg.per_second
run() {
  echo "== $*"
  timeout 100 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics "$M" \
    python3 scripts/bench/ncu_probe.py 4 1 "$@" --ext .s17/sp.so 2>&1 \
    | grep -E "^\s+(gpu__|sm__|smsp__|lts__|dram__|l1tex__)|==ERR|rror"
}
export VLLM_EXL3_WGMMA=1 VLLM_EXL3_SPREAD=1
run 256 --bm 256 --split 1 --k 5120 --n 12288
VLLM_EXL3_STREAM_K=1 run 256 --bm 256 --split 0 --k 5120 --n 12288
run 1024 --bm 256 --split 1 --k 5120 --n 12288
VLLM_EXL3_STREAM_K=1 run 128 --bm 128 --split 0 --k 5120 --n 12288
