#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 3: the wgmma engine's whole-k, stream-k ("sk") and split-2 plans pinned cold,
# 5120x12288 4-bit MCG at m = 128, 256, 512, BM 128 and 256, production placement (spread on).
set -u
: "${OUT:?}"
C=()
for m in 128 256 512; do
  for s in 1 sk; do C+=("5120 12288 4 1 $m 256 $s 1" "5120 12288 4 1 $m 128 $s 1"); done
  C+=("5120 12288 4 1 $m 128 2 1")
done
for r in 1 2; do
  VLLM_EXL3_SPREAD=1 timeout 100 python3 scripts/bench/pin.py .s17/sp.so sk$r "${C[@]}" 2>&1 | grep -v -i warn
done
