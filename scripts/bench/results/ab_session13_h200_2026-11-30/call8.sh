#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 8 (main 79b3a63, .s17/main.so): the wgmma engine's fixed cost per output tile.
# Pinned cold op times over k at a fixed grid (n = 12288: 96 column blocks, one row block, one
# wave), so time = fixed + per-stage x k / 64; the fixed part (prologue fill, epilogue, transform
# and launch) against the per-stage part says whether the tile's epilogue is a lever. Also the
# stream-k grid at the same points.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
CFG=()
for k in 1024 2048 5120 10240; do
  CFG+=("$k 12288 4 1 256 256 1 1" "$k 12288 4 1 128 128 1 1")
done
CFG+=("5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 128 128 sk 1")
for r in 1 2; do
  timeout 100 python3 scripts/bench/pin.py .s17/main.so main$r "${CFG[@]}" 2>&1 | grep -v -i warn
done
