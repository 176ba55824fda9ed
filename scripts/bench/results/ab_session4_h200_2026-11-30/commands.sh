#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 4 (2026-11-30), single H200 calls in order, each run from the repository root on the
# device machine with `carry: [".sk", ".whl"]` (.sk: the carried kernels, .whl: ExLlamaV3 1.6.5
# and its wheels, NEXT_SESSION.md). Kernels:
#   .sk/base.so  = quick build of c18a58e's csrc (sm_90; SASS identical to a build of c18a58e)
#   .sk/wide.so  = branch `wide` (BM 128 with two trellis tiles per warp)
#   .sk/fixup.so = branch `splitk-fixup` (split-k finished in-kernel by the tile's last split)
#   .sk/recon.so = the commit that merged the reconstruct change (calls 8-9)
# built with: cd scripts && python -m vllm_exl3.kernels_build --out ../build/<v> --arch 9.0
set -eu
case "${1:?call 1..9}" in
1)  # wide vs base: verify, pinned BM 128 and tuned A/B, ncu at m = 256; starts ExLlamaV3's build
    OUT=$OUT bash scripts/bench/results/ab_session4_h200_2026-11-30/call1_wide_ab.sh ;;
2)  # the settled same-run anchor, first part (machine still warm from call 1)
    EXT=.sk/base.so CALL_LIMIT_S=585 OUT=$OUT bash scripts/bench/next_session.sh call2 ;;
3)  # per-kernel time inside the benchmark's graphs (fresh machine)
    python3 scripts/bench/graph_kernels.py --ext .sk/base.so --json $OUT/graph_kernels.json \
      --case 5120x17408:4:1:4096 --case 5120x17408:2:1:4096 --case 4096x4096:4:1:4096 \
      --case 5120x12288:5:2:1 --case 5120x12288:4:2:1 --case 5120x17408:5:2:1 \
      --splits 1 2 4 8 16 32 ;;
4)  # splitk-fixup vs base: verify, tuned A/B, graph probe, tests/gpu, memcheck, racecheck
    DEADLINE=470 OUT=$OUT bash scripts/bench/results/ab_session4_h200_2026-11-30/callB_splitk_fixup_ab.sh ;;
5)  # the settled same-run anchor, second part (machine warm from call 4, ExLlamaV3 built there)
    S=/tmp/exl3_next
    python3 scripts/bench/exllamav3_anchor.py wait --state $S --timeout 300
    python3 scripts/bench/sass_loop.py .sk/base.so --json $S/sass.json
    EXL3_COMMIT=c18a58e python3 scripts/bench/bench_linear.py --ext .sk/base.so --out $OUT \
      --tag bench_anchor_rest --exl3-state $S --exl3-wait-s 30 --exl3-import-timeout-s 90 \
      --bits 4 6 2 3 5 --codebooks 0 1 2 --shapes 4096x4096 4096x11008 --budget-s 330 \
      --sass-json $S/sass.json ;;
6)  # the large-m GEMM on the layers' own W vs randn, with SM clock and power
    python3 scripts/bench/graph_kernels.py --ext .sk/base.so --json $OUT/graph_kernels_w.json \
      --case 5120x17408:4:1:4096 --case 5120x17408:2:1:4096 ;;
7)  # large m, ours and bf16 timed in alternation
    python3 scripts/bench/interleaved.py --ext .sk/base.so --json $OUT/interleaved_4bit.json
    python3 scripts/bench/interleaved.py --ext .sk/base.so --bits 2 \
      --shapes 5120x17408 17408x5120 --m 4096 --json $OUT/interleaved_2bit.json ;;
8)  # the reconstruct change (recon.so = this commit's csrc) vs base: verify, error per output
    # dtype, large-m A/B, memcheck, racecheck, interleaved
    DEADLINE=180 OUT=$OUT bash scripts/bench/results/ab_session4_h200_2026-11-30/call8_recon_ab.sh ;;
9)  # same lease: the GPU tests and synccheck on recon.so
    VLLM_EXL3_EXT=.sk/recon.so python3 -m pytest -q -p no:cacheprovider tests/gpu
    compute-sanitizer --tool synccheck --kernel-name kns=exl3 --error-exitcode 9 \
      python3 scripts/bench/verify_kernels.py --ext .sk/recon.so --sample ;;
esac
