#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 5 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with `carry: [".sk", ".whl"]` (.sk: the kernels below, .whl: ExLlamaV3 1.6.5 and
# its wheels, scripts/bench/NEXT_SESSION.md). Kernels (sm_90 quick builds, see README.md):
#   .sk/recon.so              main's csrc at 80bd5ea
#   .sk/sk2/_exl3_C.abi3.so   branch streamk2   (+ .sk/sk2_bench/verify_kernels.py from it)
#   .sk/x2/_exl3_C.abi3.so    branch xchg2
#   .sk/ft.so                 branch fused-transform
#   .sk/final.so              main at d46a0e8
# built with: cd scripts && python -m vllm_exl3.kernels_build --out ../build/<v> --arch 9.0
set -eu
D=scripts/bench/results/ab_session5_h200_2026-11-30
case "${1:?call 1..4}" in
1)  # A: stream-k at small m and the per-k16 exchange vs main; starts ExLlamaV3's build
    OUT=$OUT bash $D/callA_streamk_xchg_ab.sh ;;
2)  # B: the settled same-run anchor, all 975 points (machine still warm from call 1)
    EXT=.sk/recon.so CALL_LIMIT_S=585 OUT=$OUT bash scripts/bench/next_session.sh call2 ;;
3)  # C: fused input transform vs main: verify, sanitizers, alternating A/B, anchor subset
    OUT=$OUT bash $D/callC_fused_transform_ab.sh ;;
4)  # D: main's final kernels: verify, sanitizers, tests/gpu, alternating A/B
    OUT=$OUT bash $D/callD_final_verify_ab.sh ;;
esac
