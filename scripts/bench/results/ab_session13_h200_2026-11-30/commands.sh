#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13 (2026-11-30), single H200. Run from the repository root on the device machine. The
# builds are quick builds (kernels_build --arch 9.0), ignored by git; rebuild them from the
# commits named here and carry them in .s17/:
#   main.so   main 79b3a63;  bt.so  branch wg-bulk-t e4cc1b4
#   epi.so    branch epi-rows 1b80cc3;  sp.so  main 6f07126 (epi-rows + spread from 17 rows)
#   if3.so    branch wg-if3 4f2e028 with -DEXL3_WGMMA_IN_FLIGHT=3 (kernels_build.DEFINES)
#   noinl.so  branch epi-noinline (its head)
# Checked out: main 79b3a63 for calls 1, 7, 8; epi-rows for 9-13; wg-if3 for 14; epi-noinline
# for 15 (each call's script reads only files those commits share).
# Between calls 1 and 7 the fixture e2e record ran as six device calls: the single-H200 calls
# 1-6 of .e2e/calls.md for the bundle of bcdaf2e's wheel (scripts/e2e/results/README.md).
# Numbers 2-6 are not used here.
set -eu
D=scripts/bench/results/ab_session13_h200_2026-11-30
case "${1:?call number}" in
  1|7|8|9|10|11|12|13|14|15) OUT=$OUT bash $D/call$1.sh ;;
  *) echo "calls 1 and 7-15" >&2; exit 2 ;;
esac
