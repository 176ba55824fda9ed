#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 9: the finish-mma kernel under Nsight Compute after the stream-k GEMM
# (5120x12288 m = 256, BM 256), the same sections as call 7's main kernel plus memory workload
# analysis. .s20/fm.so = branch finish-mma.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 VLLM_EXL3_SPREAD=1
timeout 100 ncu --clock-control none --cache-control none -k regex:exl3_splitk_finish \
  --launch-skip 20 -c 1 --section SpeedOfLight --section SchedulerStats \
  --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 scripts/bench/pin.py .s20/fm.so ncu "5120 12288 4 1 256 256 sk 1" > "$OUT/ncu_fm_256.txt" 2>&1
grep -E "^    [A-Za-z]" "$OUT/ncu_fm_256.txt" | grep -v -E "^    (---|Section|Metric Name)" \
  | sed -E 's/ {2,}/  /g' | head -60
rm -f "$OUT"/pin_ncu.json
