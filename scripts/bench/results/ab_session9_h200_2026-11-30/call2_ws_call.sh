#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch wg-ws's first GPU call (written in session 8, compile-only): the full checks of the
# warp-specialized BM 256 build, then a pinned cold A/B of its BM 256 tier against main's, then
# a tuned A/B. Run from the repository root with .s9 carried: .s9/ws.so (this branch's quick
# build with -DEXL3_WS_BM256=1 added to kernels_build.DEFINES) and .s9/main.so (main's). Logs
# and JSON under $OUT; ~5 minutes.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
bash scripts/bench/checks.sh .s9/ws.so ws
CFG=()
for sh in "5120 12288" "5120 17408" "17408 5120" "4096 4096" "4096 11008"; do
  for m in 256 1024 4096; do CFG+=("$sh 4 1 $m 256 1 1"); done
done
CFG+=("5120 17408 4 1 256 256 sk 1" "5120 12288 6 1 1024 256 1 1" "5120 12288 2 2 1024 256 2 1")
for round in 1 2; do
  for e in main ws; do
    timeout 150 python3 scripts/bench/pin.py .s9/$e.so ${e}_r$round "${CFG[@]}"
  done
done 2>&1 | tee "$OUT/ws_pinned.log"
for e in main ws; do
  timeout 120 python3 scripts/bench/bench_linear.py --ext .s9/$e.so --no-exl3 --out "$OUT" \
    --tag ws_tuned_$e --bits 4 --codebooks 1 2 --m 256 512 1024 2048 4096 --budget-s 100 \
    2>/dev/null | grep -E "^wrote"
done
