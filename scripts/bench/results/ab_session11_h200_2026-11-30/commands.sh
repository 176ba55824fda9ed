#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 11 (2026-11-30), single H200. Run from the repository root on the device machine.
# Call 1 ran with branch recon-persist at 965858c checked out (detached; this session's
# l2_chunk_probe.py and this folder were untracked files beside it) and `.s12` carried:
# .s12/main.so = quick build of main (3ce21a4's csrc plus 6fcbe7e's host check), .s12/rp.so =
# recon-persist's quick build. Call 2 ran with main checked out and `.s12` carried.
# Calls 16-22 ran with main checked out (0afe1f5 plus this session's scripts; for calls 21-22 also
# the early-release change, uncommitted then) and `.s12` carried: main.so, and the probe builds
# of branch probes-splitk (measurement only) named in each callN.sh, or er.so (the change's
# quick build) for calls 21-22.
# Calls 3-8 and 10-15 were the end-to-end runs of ../../../e2e/results/README.md ("TTFT at
# concurrency 4, repeated"); call 9 found a fresh machine (nothing staged) and did nothing.
set -eu
D=scripts/bench/results/ab_session11_h200_2026-11-30
case "${1:?call number}" in
  1) OUT=$OUT bash $D/call1.sh ;;
  2) VLLM_EXL3_BM=16 python3 scripts/bench/graph_kernels.py --ext .s12/main.so \
       --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 --case 4096x4096:4:1:4 --splits 8 16 \
       --json "$OUT/gk.json" ;;
  16|17|19|20|21|22) OUT=$OUT bash $D/call$1.sh ;;
  18) for s in 8 16; do
        VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=$s python3 scripts/bench/graph_timeline.py \
          --ext .s12/main.so --case 4096x4096:4:1:1 --case 4096x4096:4:1:4 \
          --case 4096x4096:4:1:16 --case 5120x12288:4:1:1 --case 5120x12288:4:1:16 \
          --json "$OUT/tl_split$s.json"
      done ;;
  *) echo "calls 3-15: see ../../../e2e/results/README.md" >&2; exit 2 ;;
esac
