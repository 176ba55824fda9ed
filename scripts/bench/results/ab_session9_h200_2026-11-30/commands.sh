#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 9 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with main at 591068b checked out. Carried: `.s9` (main.so = quick build of
# 591068b; ws.so = branch wg-ws at e3ddbc7 built with -DEXL3_WS_BM256=1 in kernels_build.DEFINES;
# ws_call.sh = that branch's scripts/bench/ws_call.sh) and, for calls 1-4, `.whl`
# (exllamav3-1.6.5 and its wheels). Calls 3-6 ran in one lease: call 3 JIT-builds ExLlamaV3,
# call 4 is the anchor, calls 5-6 re-check its four remaining points. Calls 7-8 carried, instead
# of ws.so: ws2.so = branch wg-ws2 at 39d9f3f, ws3.so = wg-ws2 at f7fa608, each built with
# -DEXL3_WS_BM256=1.
set -eu
D=scripts/bench/results/ab_session9_h200_2026-11-30
OUT=$OUT bash $D/call${1:?call number}.sh
