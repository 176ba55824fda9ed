#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 7 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with `carry: [".s7"]`. .s7 holds this directory's call scripts and pin.py and
# the kernels below, quick builds (cd scripts && python -m vllm_exl3.kernels_build --out
# ../build/<v> --arch 9.0, sm_90a):
#   lds.so   ef4f9e0 (main after merging branch wgmma-lds-ahead)
#   wave.so  ef4f9e0 + the tuner's wave-filling k-split candidates (the commit after it)
set -eu
D=scripts/bench/results/ab_session7_h200_2026-11-30
OUT=$OUT bash $D/call${1:?call number}.sh
