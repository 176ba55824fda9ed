#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch sliced-k's first GPU call (written in session 9, compile-only): the full checks of the
# two-slice 16-row tier, then a pinned cold A/B of that tier against main's at m = 1 and 16 over
# k-splits, then a tuned A/B at m = 1-16 (bf16 in the same run). Run from the repository root
# with .s10 carried: .s10/main.so (main's quick build) and one build per variant in VARIANTS
# (default "sk sk4": this branch's quick builds with -DEXL3_SLICED_K=2 and =4 added to
# kernels_build.DEFINES). Logs and JSON under $OUT; about 8-9 minutes for two variants, one
# device call.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
VARIANTS=${VARIANTS:-sk sk4}
for v in $VARIANTS; do bash scripts/bench/checks.sh .s10/$v.so $v; done
CFG=()
for sh in "4096 4096" "4096 11008" "5120 12288" "5120 17408" "17408 5120"; do
  for m in 1 16; do for s in 4 8 16; do CFG+=("$sh 4 1 $m 16 $s 0"); done; done
done
for round in 1 2; do
  for e in main $VARIANTS; do
    timeout 100 python3 scripts/bench/pin.py .s10/$e.so ${e}_r$round "${CFG[@]}"
  done
done 2>&1 | tee "$OUT/sliced_pinned.log" | grep -v "^$"
for e in main $VARIANTS; do
  timeout 70 python3 scripts/bench/bench_linear.py --ext .s10/$e.so --no-exl3 --out "$OUT" \
    --tag sliced_tuned_$e --bits 4 --codebooks 1 2 --m 1 2 4 8 16 --budget-s 50 \
    2>/dev/null | grep -E "^ *[0-9]+x|^wrote"
done
