#!/usr/bin/env bash
# Session 11, call 16 (main checked out, .s12 carried): which part of the 16-row GEMM grows
# from m = 1 to m = 16 inside the benchmark's graphs (README §3). Probe builds of branch
# probes-splitk (measurement only, never merge): nored.so = -DEXL3_PROBE_NO_WS_RED=1 (no
# partial sums reach the workspace), onerow.so = -DEXL3_PROBE_A_ONE_ROW=1 (only row 0 of A is
# read; the others are zero-filled, as at m = 1). Each build, then main again.
set -u
export PYTHONUNBUFFERED=1
i=0
for e in main nored onerow main; do
  i=$((i + 1))
  echo "=== $e"
  VLLM_EXL3_BM=16 timeout 100 python3 scripts/bench/graph_kernels.py --ext .s12/$e.so \
    --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 --case 5120x12288:4:1:1 \
    --case 5120x12288:4:1:16 --splits 8 16 --json "$OUT/gk_${i}_$e.json" 2>&1 \
    | grep -E "^ +(ours|bf16)|^[0-9]" | cut -c1-120
done
