#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 7 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with `carry: [".s7"]`. .s7 holds this directory's call scripts and pin.py and
# the kernels below, quick builds (cd scripts && python -m vllm_exl3.kernels_build --out
# ../build/<v> --arch 9.0, sm_90a):
#   lds.so   ef4f9e0 (main after merging branch wgmma-lds-ahead)
#   wave.so  ddebd76: ef4f9e0 + the tuner's wave-filling k-split candidates
#   nodec.so, nomma.so, nodec_nobar.so, nodec_norefill.so: branch `probes` (2ce58b1) built with
#            -DEXL3_PROBE_NO_DECODE=1 / -DEXL3_PROBE_NO_MMA=1 / both NO_DECODE and NO_BARRIER /
#            NO_DECODE and NO_REFILL (added to kernels_build.DEFINES for the build only)
#   r1.so, rs.so: branch wg-refill-spread's first form, -DEXL3_REFILL_SPREAD=0 / 1
#   rb.so    ea60c72 (main's kernels since)
#   rb_nobar.so, rb_nodec.so, rb_nodec_nobar.so: ea60c72 + the probe macros of `probes`
#   if2.so   ea60c72 with kWgmmaInFlight = 2 (exl3_wgmma.cuh)
#   peel.so  branch wg-peel (ea60c72 + the BM 256 k loop split into all-refilling iterations and a guarded tail)
# The end-to-end record's calls (made between calls 7 and 8) are in scripts/e2e/results/README.md.
set -eu
D=scripts/bench/results/ab_session7_h200_2026-11-30
OUT=$OUT bash $D/call${1:?call number}.sh
