#!/usr/bin/env bash
# Session 11, call 19 (main checked out, .s12 carried): the op's kernels placed in time inside
# the benchmark's graphs (graph_timeline.py), main against both.so = branch probes-splitk built
# with -DEXL3_PROBE_NO_WS_RED=1 and -DEXL3_PROBE_A_ONE_ROW=1 together (each alone changed
# nothing in call 16). BM 16, split 8.
set -u
export PYTHONUNBUFFERED=1
for e in main both main both; do
  echo "=== $e"
  VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=8 timeout 60 python3 scripts/bench/graph_timeline.py \
    --ext .s12/$e.so --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 \
    --case 5120x12288:4:1:1 --case 5120x12288:4:1:16 2>&1 | grep -v -i warn
done
