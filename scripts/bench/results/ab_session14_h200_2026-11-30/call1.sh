#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14, call 1 (main 80ce9a0 checked out, .s17 and .whl carried): ExLlamaV3's JIT build
# started in the background (this lease was lost before it finished), then branch epi-onebody's
# first call (its scripts/bench/onebody_call.sh, copied into the tree) and
# scripts/bench/fixed_cost_call.sh on main's kernels.
set -u
: "${OUT:?}"
mkdir -p /tmp/exl3_next
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/exl3_next/site .whl/*.whl &&
  python3 scripts/bench/exllamav3_anchor.py build --state /tmp/exl3_next --jobs 12
git show epi-onebody:scripts/bench/onebody_call.sh > /tmp/onebody_call.sh 2>/dev/null || true
bash /tmp/onebody_call.sh > "$OUT/onebody.log" 2>&1; tail -60 "$OUT/onebody.log"
bash scripts/bench/fixed_cost_call.sh .s17/sp.so > "$OUT/fixed.log" 2>&1; cat "$OUT/fixed.log"
