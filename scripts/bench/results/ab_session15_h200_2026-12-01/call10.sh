#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 10: branch l2-persist (experiment): the split-k workspace in a persisting L2
# carve-out (access-policy window on the GEMM and finish launches, EXL3_L2_PERSIST=1) against
# the same build without it (.s19/l2p.so both times), stream-k and split-k points pinned,
# alternated, two rounds; the graph timeline of stream-k m = 256 / 512; then checks.sh with it on.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
C=("5120 12288 4 1 128 128 sk 1" "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"
   "4096 4096 4 1 256 128 sk 1" "4096 4096 4 1 16 16 8 0" "5120 12288 4 1 16 16 4 0"
   "5120 12288 4 1 256 256 1 1")
for r in 1 2; do
  for on in 0 1; do
    EXL3_L2_PERSIST=$on VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/pin.py .s19/l2p.so \
      persist${on}_r$r "${C[@]}" 2>&1 | grep -v -i warn
  done
done
for on in 0 1; do
  echo "== timeline persist=$on"
  EXL3_L2_PERSIST=$on VLLM_EXL3_WGMMA=1 VLLM_EXL3_RECONSTRUCT_M=0 VLLM_EXL3_SPREAD=1 VLLM_EXL3_BM=256 \
    VLLM_EXL3_STREAM_K=1 timeout 60 python3 scripts/bench/graph_timeline.py --ext .s19/l2p.so \
    --case 5120x12288:4:1:256 --case 5120x12288:4:1:512 2>&1 | grep -E "^[0-9]"
done
EXL3_L2_PERSIST=1 bash scripts/bench/checks.sh .s19/l2p.so l2p 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
