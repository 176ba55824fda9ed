#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch wg-streamk's first GPU call (written in session 7, which had no device time left to run
# it): the full checks of the stream-k build, then a pinned cold A/B of the stream-k grid against
# the classic grid's best splits on the shapes whose tiles leave SMs idle. Run from the
# repository root with .s8 carried: .s8/sk.so (this branch's quick build) and .s8/main.so
# (main's). Prints a table; logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
bash scripts/bench/checks.sh .s8/sk.so sk
A="5120 17408 4 1"; B="5120 12288 4 1"; C="17408 5120 4 1"
CFG=("$A 256 256 1 1" "$A 256 256 2 1" "$A 256 256 sk 1" "$A 128 128 2 1" "$A 128 128 sk 1"
     "$B 256 256 1 1" "$B 256 256 sk 1" "$B 512 256 2 1" "$B 512 256 sk 1"
     "$C 256 256 3 1" "$C 256 256 sk 1" "$B 1024 256 1 1" "$B 1024 256 sk 1")
for round in 1 2; do
  for e in main sk; do
    if [ "$e" = main ]; then cfg=("${CFG[@]//sk 1/1 1}"); else cfg=("${CFG[@]}"); fi
    timeout 120 python3 scripts/bench/pin.py .s8/$e.so ${e}_r$round "${cfg[@]}"
  done
done 2>&1 | tee "$OUT/streamk_ab.log"
