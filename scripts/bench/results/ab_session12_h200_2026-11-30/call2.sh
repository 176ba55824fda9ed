#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch wg-tma's first GPU call (written in session 11, compile-only; session 11 had no device
# time left to run it). Run from the repository root with .s13 carried: main.so = main
# c3721f9's quick build, tma.so = this branch's, tma_if2.so = this branch's built with
# -DEXL3_WGMMA_IN_FLIGHT=2 (kernels_build.DEFINES). The wgmma engine takes its A stages from the
# tensor memory accelerator (one bulk tensor copy per stage, an mbarrier per slot) instead of
# per-thread cp.async. The full verification of tma.so, then pinned cold wgmma plans, main /
# tma / tma_if2 alternated twice. About 3 minutes. Before a merge: scripts/bench/checks.sh .s13/tma.so.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
for e in tma tma_if2; do
  timeout 45 python3 scripts/bench/verify_kernels.py --ext .s13/$e.so --json "$OUT/verify_$e.json" \
    2>&1 | tail -11
done
CFG=("5120 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1" "17408 5120 4 1 1024 256 1 1"
     "4096 4096 4 1 512 256 1 1" "5120 17408 4 1 256 256 sk 1" "5120 12288 4 1 128 128 1 1"
     "4096 4096 4 1 256 128 1 1" "4096 11008 4 1 64 64 1 1")
for e in main tma tma_if2 main tma tma_if2; do
  OUT=$OUT timeout 30 python3 scripts/bench/pin.py .s13/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
