#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch spread's first GPU call (written in session 11, compile-only). Run from the repository
# root with .s14 carried: main.so = main c3721f9's quick build, spread.so = this branch's.
# Plan::spread caps the GEMM's resident blocks per SM at the grid's even share, so that its
# blocks, released early beside the input transform's, cannot stack three on an SM
# (ab_session11 §5: 4096x4096 m = 16 ends 4.6 us later than m = 1 for that reason).
# 1) verify with every fused plan spread (VLLM_EXL3_EXPERIMENT_SPREAD=1); 2) the op's timeline
# inside graphs at BM 16 split 8, early release: main, then spread forced; 3) a tuned cold A/B
# against main at m = 1-16 (the tuner also times early+spread below 17 rows). About 4 minutes.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
VLLM_EXL3_EXPERIMENT_SPREAD=1 timeout 45 python3 scripts/bench/verify_kernels.py \
  --ext .s14/spread.so --json "$OUT/verify_spread.json" 2>&1 | tail -11
CASES=(--case 4096x4096:4:1:1 --case 4096x4096:4:1:4 --case 4096x4096:4:1:16
       --case 4096x11008:4:1:16 --case 5120x12288:4:1:16)
for round in 1 2; do
  echo "== main r$round"
  VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=8 timeout 60 python3 scripts/bench/graph_timeline.py \
    --ext .s14/main.so "${CASES[@]}" 2>&1 | grep -E "^[0-9]"
  echo "== spread r$round"
  VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=8 VLLM_EXL3_EXPERIMENT_SPREAD=1 timeout 60 python3 \
    scripts/bench/graph_timeline.py --ext .s14/spread.so "${CASES[@]}" 2>&1 | grep -E "^[0-9]"
done
i=0
for e in main spread main spread; do
  i=$((i + 1))
  timeout 150 python3 scripts/bench/bench_linear.py --ext .s14/$e.so --no-exl3 --bits 4 \
    --codebooks 1 2 --m 1 2 4 8 16 --out "$OUT" --tag r${i}_$e > "$OUT/bench_r${i}_$e.log" 2>&1
  echo "== r$i $e rc=$?"
done
ls "$OUT"
