#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 14 (2026-11-30), single H200. Run from the repository root on the device machine, main
# 80ce9a0 checked out (csrc = 6f07126's). The builds are quick builds (kernels_build --arch 9.0),
# ignored by git; rebuild them and carry them in .s17/:
#   sp.so       main 6f07126's csrc (= main's kernels)
#   onebody.so  branch epi-onebody 4034e00
#   skfix.so    branch sk-fixup's first form (call 16), never committed as such: f94030c with
#               kStreamKLoadBatch = 1 and the workspace cap applied to partial sums + counters
# and .whl (ExLlamaV3 1.6.5 and its wheels, NEXT_SESSION.md lists them) for calls 1 and 5.
# Calls 1-4 were one lease (lost after call 4 while idle, with ExLlamaV3's build unfinished);
# calls 5-15 a second: 5-10 are the single-H200 calls 1-6 of .e2e/calls.md for the bundle of
# wheel 2291901 (call 5 also started ExLlamaV3's build: the two lines of call 1 below before the
# staging), 12 is .e2e/calls.md's call 7 with --budget-s 440. Their records are in
# scripts/e2e/results/README.md.
set -eu
D=scripts/bench/results/ab_session14_h200_2026-11-30
case "${1:?call number}" in
  1|2|3|4|11|13|14|15|16) OUT=$OUT bash $D/call$1.sh ;;  # 16: with sk-fixup checked out
  *) echo "calls 1-4, 11, 13-16 (5-10 and 12: .e2e/calls.md)" >&2; exit 2 ;;
esac
