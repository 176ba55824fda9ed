#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 2: ours (tuner's choice, then the reconstruct + cuBLAS path forced) against
# bf16 in alternation at m = 1024 and 4096, the five shapes, 4-bit MCG, main's kernels.
set -u
: "${OUT:?}"
for R in 0 1; do
  echo "== VLLM_EXL3_RECONSTRUCT_M forced: $R"
  if [ $R = 1 ]; then export VLLM_EXL3_RECONSTRUCT_M=1; fi
  timeout 200 python3 scripts/bench/interleaved.py --ext .s17/sp.so --m 1024 4096 \
    --json "$OUT/il_$R.json" 2>&1 | grep -v -i warn | tail -14
done
