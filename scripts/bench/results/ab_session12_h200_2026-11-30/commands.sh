#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 12 (2026-11-30), single H200, one warm lease for calls 1-5 and one for calls 6-8. Run
# from the repository root on the device machine. The builds are quick builds (kernels_build
# --arch 9.0), ignored by git; rebuild them from the commits named here.
#   .whl           ExLlamaV3 1.6.5 and its wheels (NEXT_SESSION.md lists them)
#   .s13/main.so   main c3721f9's kernels; .s13/tma.so branch wg-tma 7d0da48;
#   .s13/tma_if2.so  wg-tma 7d0da48 with -DEXL3_WGMMA_IN_FLIGHT=2 (kernels_build.DEFINES)
#   .s14/main.so   = .s13/main.so; .s14/spread.so branch spread 6467f86
#   .s16/main.so   = .s13/main.so; .s16/merged.so main 5e93e89's csrc (wg-tma + two wgmmas in
#                  flight + spread with its shared-memory fix); .s16/st5.so branch wg-stages
#                  1c1ff3d built with -DEXL3_WG256_STAGES=5
# Checked out: call 1 main 9e635e4; calls 2, 4, 5 wg-tma 7d0da48 (detached); call 3 spread
# 6467f86 (detached); calls 6-8 main with the merge uncommitted (csrc = 5e93e89's; for calls 7-8
# also 85994cc's bench_linear.py fix); call 9 main 19df2cb.
set -eu
D=scripts/bench/results/ab_session12_h200_2026-11-30
case "${1:?call number}" in
  1) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/exl3_next/site \
       .whl/*.whl && python3 scripts/bench/exllamav3_anchor.py build --state /tmp/exl3_next \
       --jobs 12 ;;
  2|3|6|9) OUT=$OUT bash $D/call$1.sh ;;  # as run (call 3: the pin's name on branch spread)
  4) bash scripts/bench/checks.sh .s13/tma_if2.so tma_if2
     VLLM_EXL3_EXPERIMENT_SPREAD=1 python3 scripts/bench/verify_kernels.py --ext .s14/spread.so ;;
  5) EXT=.s13/tma_if2.so bash scripts/bench/next_session.sh call2 ;;
  7|8) if [ "$1" = 7 ]; then M="1 4 16"; else M="64 256 1024"; fi
     i=0
     for e in main merged main merged; do
       i=$((i + 1))
       python3 scripts/bench/bench_linear.py --ext .s16/$e.so --no-exl3 --bits 4 \
         --codebooks 1 2 --m $M --out "$OUT" --tag c$1_r${i}_$e
     done ;;
  *) echo "calls 1-9" >&2; exit 2 ;;
esac
