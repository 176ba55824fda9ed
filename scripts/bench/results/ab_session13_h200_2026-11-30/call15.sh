#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 15 (.s17 carried: sp.so = main 6f07126; noinl.so = branch epi-noinline: the
# tile epilogue as one non-inlined function per (staging stride, row group), both output dtypes
# in one body - library 14.6 -> 12.3 MB, k loops unchanged or shorter). verify noinl (full), then
# pinned cold sp / noinl alternated twice at epilogue-heavy points, full-k and split-k.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 40 python3 scripts/bench/verify_kernels.py --ext .s17/noinl.so --json "$OUT/verify_noinl.json" 2>&1 | tail -10
CFG=("1024 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1" "4096 4096 4 1 512 256 2 1"
     "4096 4096 4 1 16 16 8 0" "4096 4096 4 1 16 16 1 0" "5120 12288 4 1 128 128 1 1")
for e in sp noinl sp noinl; do
  VLLM_EXL3_SPREAD=1 timeout 40 python3 scripts/bench/pin.py .s17/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
