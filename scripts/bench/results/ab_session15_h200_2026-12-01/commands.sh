#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15 (2026-12-01), single H200, one lease. Run from the repository root on the device
# machine. The builds are quick builds (kernels_build --arch 9.0), ignored by git; rebuild them
# from these commits and carry them in .s19/:
#   sp.so      main 88bf079 (= main's kernels before this session)
#   skfix.so   branch sk-fixup: e525432 for calls 2-3 (v1; call 1 ran eb2b6e1's form, whose static shared
#              memory moved the stage base and trapped),
#              444913f for call 4 (v2)
#   probe.so   branch probes-epi2 (measurement only) for call 5
#   quad.so    branch epi-quad 7f6aba4, quad rows from BM 64 (call 6)
#   quad2.so   epi-quad d341c91 (merged) for calls 7-8; the same build as base.so in call 9
#   fin.so     branch finish-quad 2a34df3 (call 9)
#   l2p.so     branch l2-persist b63a37b (call 10)
set -eu
D=scripts/bench/results/ab_session15_h200_2026-12-01
case "${1:?call number}" in
  1|2|3|4|5|6|7|8|9|10) OUT=$OUT bash $D/call$1.sh ;;
  *) echo "calls 1-10" >&2; exit 2 ;;
esac
