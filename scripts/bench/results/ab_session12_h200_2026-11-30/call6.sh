#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 12, call 6 (main with wg-tma and spread merged, uncommitted at the time). Run from the
# repository root with .s16 carried: merged.so = this tree's quick build, main.so = c3721f9's.
# 1) verify with every fused plan spread (VLLM_EXL3_SPREAD=1): call 4 found spread's launches
#    refused ("invalid argument") because the GEMM kernels' 1 KB of static shared memory was not
#    counted; 2) the full checks of the merged build; 3) memcheck with every plan spread;
# 4) a tuned cold A/B against c3721f9 at m = 1-16, alternated twice.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
VLLM_EXL3_SPREAD=1 timeout 60 python3 scripts/bench/verify_kernels.py --ext .s16/merged.so \
  --json "$OUT/verify_spread_forced.json" 2>&1 | tail -11
bash scripts/bench/checks.sh .s16/merged.so merged 2>&1 | grep -v "^check \|^nan_guard\|^input_val"
VLLM_EXL3_SPREAD=1 timeout 40 compute-sanitizer --tool memcheck --kernel-name kns=exl3 \
  --error-exitcode 9 python3 scripts/bench/verify_kernels.py --ext .s16/merged.so --sample 2>&1 \
  | tail -1
echo "memcheck (spread forced) exit ${PIPESTATUS[0]}"
i=0
for e in main merged main merged; do
  i=$((i + 1))
  timeout 100 python3 scripts/bench/bench_linear.py --ext .s16/$e.so --no-exl3 --bits 4 \
    --codebooks 1 2 --m 1 4 16 --out "$OUT" --tag r${i}_$e > "$OUT/bench_r${i}_$e.log" 2>&1
  echo "== r$i $e rc=$?"
done
cd "$OUT" && tar czf call6.tgz *.json *.csv *.log && ls
