#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 1 (main 79b3a63 checked out, .s17 carried: main.so = 79b3a63's quick build,
# bt.so = branch wg-bulk-t e4cc1b4's). Part 1: the full checks of main, whose verify now runs
# every split-k plan spread and whose sanitizer sample has spread plans (9d4a7c0), on the
# launcher-side spread sizing (79b3a63) - none of which had run on a GPU. Part 2: wg-bulk-t's
# first call (its scripts/bench/bulkt_call.sh; the branch differs from main only in csrc, so
# main's verify and pin.py drive its build).
set -u
: "${OUT:?}"
bash scripts/bench/checks.sh .s17/main.so main
bash "$(dirname "$0")/bulkt_part.sh" 2>&1 | tee "$OUT/bulkt.log"
