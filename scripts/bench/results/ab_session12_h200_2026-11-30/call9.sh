#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 12, call 9 (main 19df2cb checked out, .s16 carried: main.so = c3721f9, merged.so =
# 5e93e89's csrc, st5.so = branch wg-stages built with -DEXL3_WG256_STAGES=5).
# 1) verify st5.so; 2) pinned cold BM 256 plans, merged / st5 alternated twice (five wgmma
# stages at BM 256, now that A by TMA left the shared memory for it); 3) 17408x5120 at m <= 16,
# where call 7 had merged 1.1-1.5 % slower than main: main, merged, merged with spread off.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s16/st5.so --json "$OUT/verify_st5.json" \
  2>&1 | tail -11
CFG=("5120 12288 4 1 256 256 1 1" "5120 12288 4 1 1024 256 1 1" "17408 5120 4 1 1024 256 1 1"
     "4096 4096 4 1 512 256 1 1" "5120 17408 4 1 256 256 sk 1" "4096 11008 6 1 1024 256 1 1")
for e in merged st5 merged st5; do
  timeout 40 python3 scripts/bench/pin.py .s16/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
for round in 1 2; do
  for e in main merged merged_nospread; do
    so=${e%_nospread}; sp=; [ "$e" = merged_nospread ] && sp=0
    env ${sp:+VLLM_EXL3_SPREAD=$sp} timeout 60 python3 scripts/bench/bench_linear.py --ext .s16/$so.so \
      --no-exl3 --bits 4 --codebooks 1 2 --m 1 4 16 --shapes 17408x5120 --out "$OUT" \
      --tag s${round}_$e 2>&1 | grep -E "^17408"
    echo "== $round $e"
  done
done
cd "$OUT" && tar czf call9.tgz *.json *.csv && ls
