#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 15: where the stream-k plan's time goes inside the benchmark's graphs - the
# input transform (T), the GEMM (G) and the split-k finish kernel (F), start and end relative to
# the op's transform start. (The stream_k=0 half of the call as run printed nothing: a pinned
# whole-k plan needs VLLM_EXL3_STREAM_K unset; call 1's fixed_cost_call.sh has those.)
set -u
export PYTHONUNBUFFERED=1 VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1
echo "== stream_k=1 BM256"
VLLM_EXL3_BM=256 VLLM_EXL3_STREAM_K=1 timeout 60 python3 scripts/bench/graph_timeline.py --ext .s17/sp.so \
  --case 5120x12288:4:1:256 --case 5120x12288:4:1:512 --case 5120x17408:4:1:256 2>&1 | grep -E "^[0-9]"
echo "== stream_k=1 BM128"
VLLM_EXL3_BM=128 VLLM_EXL3_STREAM_K=1 timeout 60 python3 scripts/bench/graph_timeline.py --ext .s17/sp.so \
  --case 5120x12288:4:1:128 --case 4096x4096:4:1:256 2>&1 | grep -E "^[0-9]"
