#!/usr/bin/env bash
# Session 11, call 17 (main checked out, .s12 carried): call 16 found neither the workspace
# reductions nor A's rows behind the 16-row GEMM's growth from m = 1 to 16 inside graphs. Here:
# late.so = branch probes-splitk built with -DEXL3_PROBE_LATE_TRIGGER=1, the GEMM's
# griddepcontrol.launch_dependents moved from its start to after its k loop, so the split-k
# finish kernel's blocks are not resident (waiting) during the k loop. Alternating with main.
set -u
export PYTHONUNBUFFERED=1
i=0
for e in main late main late; do
  i=$((i + 1))
  echo "=== $e"
  VLLM_EXL3_BM=16 timeout 100 python3 scripts/bench/graph_kernels.py --ext .s12/$e.so \
    --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 --case 4096x11008:4:1:16 \
    --case 5120x12288:4:1:16 --splits 8 16 --json "$OUT/gk_${i}_$e.json" 2>&1 \
    | grep -E "^ +(ours|bf16)|^[0-9]" | cut -c1-100
done
