#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 11: the same-run anchor, all 975 points, main's kernels (.s17/sp.so), in the
# lease where calls 5-10 had JIT-built ExLlamaV3 1.6.5 into /tmp/exl3_next.
set -u
EXT=.s17/sp.so CALL_LIMIT_S=560 bash scripts/bench/next_session.sh call2 > /dev/null 2>&1
tail -40 "$OUT/call2.log"
