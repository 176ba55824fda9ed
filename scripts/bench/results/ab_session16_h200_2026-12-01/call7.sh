#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 7: what bounds main's split-k finish kernel after the stream-k GEMM
# (5120x12288 m = 256 and 512, BM 256): Nsight Compute's speed-of-light, scheduler, warp-state
# and occupancy sections on one steady-state launch inside pin.py's cold graphs (caches as the
# GEMM leaves them). .s19/base.so = main's kernels.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 VLLM_EXL3_SPREAD=1
for spec in "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"; do
  echo "== $spec"
  timeout 150 ncu --clock-control none --cache-control none -k regex:exl3_splitk_finish \
    --launch-skip 20 -c 1 --section SpeedOfLight --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 scripts/bench/pin.py .s19/base.so ncu "$spec" > "$OUT/ncu_${spec// /_}.txt" 2>&1
  grep -E "^    [A-Za-z]" "$OUT/ncu_${spec// /_}.txt" | grep -v -E "^    (---|Section|Metric Name)" \
    | sed -E 's/ {2,}/  /g' | head -70
done
rm -f "$OUT"/pin_ncu.json
