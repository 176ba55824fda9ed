#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16 (2026-12-01), single H200. Run from the repository root on the device machine with
# OUT set. The builds are quick builds (kernels_build --arch 9.0), ignored by git; rebuild them
# from these commits and carry them:
#   .s19/base.so  main's kernels: d341c91's csrc (main 5e7a445 has the same SASS)
#   .s20/sk.so    branch sk-store b7b7fd5 (branches/sk-store_b7b7fd5.diff against 5e7a445)
#   .s20/fr.so    branch finish-rows cd80a40 (call 6)
#   .s20/fm.so    branch finish-mma 48388d4 (calls 8-9)
#   .s20/fm2.so   branch finish-mma2 011f10e (call 10: written, not run)
# Calls 1 and 4 also carry .whl: ExLlamaV3 1.6.5 and pydantic 2.14.4, pydantic-core 2.50.5,
# annotated-types 0.8.0, typing-inspection 0.4.5, typing-extensions, marisa-trie 1.4.1 (cp312).
# Calls 1-3 ran in one lease (call 1 starts ExLlamaV3's build), calls 4-5 in a second one;
# calls 6-7 and 8-9 in two more.
set -eu
D=scripts/bench/results/ab_session16_h200_2026-12-01
case "${1:?call number}" in
  1|2|4|5|6|7|8|9|10) OUT=$OUT bash $D/call$1.sh ;;
  3) EXT=.s19/base.so EXL3_COMMIT=5e7a445 CALL_LIMIT_S=570 OUT=$OUT \
       bash scripts/bench/next_session.sh call2 ;;
  *) echo "calls 1-10" >&2; exit 2 ;;
esac
