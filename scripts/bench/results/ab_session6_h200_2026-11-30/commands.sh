#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 6 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with `carry: [".s6"]` (".s6", ".whl" for calls 6-8). .s6 holds this directory's
# call scripts and pin.py and the kernels below, all quick builds
# (cd scripts && python -m vllm_exl3.kernels_build --out ../build/<v> --arch 9.0: sm_90a from
# d390e6a on, sm_90 before):
#   base.so   main's kernels at the start of the session (d46a0e8's csrc, sm_90)
#   wg1.so    d390e6a: the wgmma engine, first form (the tensor pipe drained at every stage end)
#   nf.so     d390e6a with fence_proxy_async_shared() emptied (measurement only: unsafe)
#   wg2.so    75ce261's csrc: one wgmma per warpgroup in flight across the stage barrier
#   wg3.so    75ce261 with kWgmmaInFlight = 2;  wg3b.so: = 3
#   final.so  75ce261 (the commit's kernels; the anchor of call 8 ran on it)
#   st.so     75ce261 with up to 6 pipeline slots for the wgmma engine (README §9)
#   lpr.so    branch wgmma-lds-ahead (68a9a65): trellis words read one k16 step ahead (§11)
#   lp.so     lpr plus the stage's first read issued before the refill copies (§11)
set -eu
D=scripts/bench/results/ab_session6_h200_2026-11-30
case "${1:?call 1..12}" in
1|2|3|4|5|6|7|9|10|11|12) OUT=$OUT bash $D/call$1.sh ;;   # 12 did not run (no device time)   # see the header of each script
8)  # the same-run anchor, all 975 points (right after call 7, ExLlamaV3 built by call 6)
    EXT=.s6/final.so CALL_LIMIT_S=585 EXL3_STATE=/tmp/exl3_next OUT=$OUT \
      bash scripts/bench/next_session.sh call2 ;;
esac
