#!/usr/bin/env bash
# Session 11, call 20 (main checked out, .s12 carried): the op's kernels placed in time inside
# the benchmark's graphs (graph_timeline.py), main against tnt.so = branch probes-splitk built
# with -DEXL3_PROBE_T_NO_TRIGGER=1: the input transform no longer triggers its dependents at
# its start, so the GEMM's blocks are dispatched as the transform's blocks exit. (Call 19: with
# both GEMM probes together the 16-row GEMM still ends 4.5 µs later than at m = 1; the suspect
# left is the GEMM blocks' placement beside the resident transform blocks.) BM 16, split 8.
set -u
export PYTHONUNBUFFERED=1
for e in main tnt main tnt; do
  echo "=== $e"
  VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=8 timeout 60 python3 scripts/bench/graph_timeline.py \
    --ext .s12/$e.so --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 \
    --case 5120x12288:4:1:1 --case 5120x12288:4:1:16 2>&1 | grep -v -i warn
done
