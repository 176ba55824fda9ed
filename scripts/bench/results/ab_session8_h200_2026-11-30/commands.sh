#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 8 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine. Calls 1-4 and 6 ran with branch wg-streamk checked out, call 5 with main at
# 8aaf6ea, calls 7-8 with main at 4f788b0, call 9 with branch small-m-splits (3ce21a4).
# Carried: `.s8` (these call scripts and the builds below)
# and, for calls 1-5, `.whl` (exllamav3-1.6.5 and its wheels: pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, marisa-trie). Quick builds (cd scripts
# && python -m vllm_exl3.kernels_build --out ../build/<v> --arch 9.0, sm_90a):
#   main.so   8aaf6ea (main before this session; kernels = ea60c72's csrc)
#   sk.so     a138990 (branch wg-streamk rebased on 8aaf6ea: the stream-k grid, up to 4 waves)
#   sk2.so    16f11e8 (sk + the fill cut; SASS byte-identical to sk.so)
#   final.so  4f788b0 (main after the merge; SASS byte-identical to sk2.so), with sass.json from
#             `python scripts/bench/sass_loop.py .s8/final.so --json .s8/sass.json` (no GPU)
#   even.so   3ce21a4 (final + the tuner's even k-splits below m = 17; SASS byte-identical)
# Calls 1-5 ran in one lease: call 1 starts ExLlamaV3's JIT build, calls 2-4 keep the machine
# warm until it is done, call 5 is the anchor.
set -eu
D=scripts/bench/results/ab_session8_h200_2026-11-30
OUT=$OUT bash $D/call${1:?call number}.sh
