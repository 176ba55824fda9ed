#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Where the wgmma engine's fixed cost per output tile goes (written in session 13, not yet run).
# ab_session13 call 8 fitted it at 10.9 µs per op at BM 256 m = 256 (time = fixed + 0.676 µs
# per 64-k stage over k = 1024-10240, one wave of 96 blocks); the epilogue in row groups took
# about 2 µs of it off. This call says what the rest is, in about 2 minutes:
# 1) graph_timeline.py with BM 256 / split 1 / wgmma pinned: the input transform's start and
#    end, the GEMM's start and end and the next op's transform start, relative to the op's
#    transform start, at k = 1024, 2048 and 5120 (the GEMM's span grows with k, its fixed part
#    does not);
# 2) the same k-scan as call 8 on EXT, BM 256 m = 256 and BM 128 m = 128 spread, to refit.
#   bash scripts/bench/fixed_cost_call.sh EXT    (repository root, on the device machine)
set -u
EXT=${1:?usage: fixed_cost_call.sh EXT}
export PYTHONUNBUFFERED=1
: "${OUT:?}"
VLLM_EXL3_BM=256 VLLM_EXL3_SPLIT_K=1 VLLM_EXL3_WGMMA=1 VLLM_EXL3_STREAM_K=0 \
  VLLM_EXL3_RECONSTRUCT_M=0 timeout 120 python3 scripts/bench/graph_timeline.py --ext "$EXT" \
  --case 1024x12288:4:1:256 --case 2048x12288:4:1:256 --case 5120x12288:4:1:256 \
  --json "$OUT/timeline_bm256.json" 2>&1 | grep -E "^[0-9]"
CFG=()
for k in 1024 2048 5120 10240; do
  CFG+=("$k 12288 4 1 256 256 1 1" "$k 12288 4 1 128 128 1 1")
done
for r in 1 2; do
  VLLM_EXL3_SPREAD=1 timeout 100 python3 scripts/bench/pin.py "$EXT" kscan$r "${CFG[@]}" 2>&1 \
    | grep -v -i warn
done
