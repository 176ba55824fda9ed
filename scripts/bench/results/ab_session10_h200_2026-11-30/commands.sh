#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 10 (2026-11-30), single H200 calls 1-2, each run from the repository root on the device
# machine. Call 1 ran with branch wg-ws2 at 689bad1 checked out (detached) and `.s10ws` carried:
# main.so = quick build of main (3ce21a4's csrc), ws4.so = wg-ws2 at 6e264d6 built with
# -DEXL3_WS_BM256=1 in kernels_build.DEFINES. Call 2 ran with branch sliced-k at 232c661 checked
# out and `.s10` carried: main.so, sk.so and sk4.so = sliced-k built with -DEXL3_SLICED_K=2 and
# =4. callN.sh is that branch's script as it ran (ws2_call.sh, sliced_call.sh). Calls 3-9 were
# the end-to-end record (../../../e2e/results/README.md, "commit 1973331").
set -eu
D=scripts/bench/results/ab_session10_h200_2026-11-30
OUT=$OUT bash $D/call${1:?call number}.sh
# Call 10 ran with branch cluster-k at d968612 checked out and `.s11` carried: main.so (as in
# call 2) and ck.so (cluster-k's quick build); call10.sh is its scripts/bench/cluster_call.sh.
# Call 11 ran with branch recon-unroll at 03fd804 checked out and `.s11` carried: main.so and
# ru.so (recon-unroll's quick build); call11.sh is its scripts/bench/recon_call.sh.
# Calls 12-14 ran with main checked out (these record scripts) and `.s11` carried: main.so,
# and for calls 13-14 ru2.so / ru3.so, quick builds of branch recon-unroll at its head with
# kReconOriginalMinBlocks 4 (ru2) and 3 (ru3). call12_files/ncu_times_*.txt keep only the
# EXL3 and cuBLAS kernels of ncu's output (the layer set-up's torch kernels are left out).
