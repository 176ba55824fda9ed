#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 13, call 14 (.s17 carried: sp.so = main 6f07126; if3.so = branch wg-if3 built with
# -DEXL3_WGMMA_IN_FLIGHT=3, three wgmmas in flight in every wgmma tier; if3s.so = the same
# branch with -DEXL3_WGMMA_IN_FLIGHT_BELOW_256=3, three below BM 256 and two at BM 256; not carried:
# the three builds passed the 64 MiB a call carries).
# Call 8 put BM 128's stage at 0.89 us against BM 256's 0.68 with half the MMA work, and call 7's
# ncu has "wait" as the largest stall: the decode chain per k16 step against 2-4x shorter
# wgmmas. 1) verify if3 (full); 2) pinned cold sp / if3 alternated twice, spread on (per tier,
# if3s equals if3 below 256 and sp at 256); 3) tuned cold A/B sp / if3 at m = 64-256,
# alternated twice; 4) memcheck and racecheck on if3's sample.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
timeout 40 python3 scripts/bench/verify_kernels.py --ext .s17/if3.so --json "$OUT/verify_if3.json" 2>&1 | tail -10
CFG=("5120 12288 4 1 128 128 1 1" "4096 4096 4 1 256 128 2 1" "4096 4096 4 1 128 128 4 1"
     "4096 11008 4 1 64 64 1 1" "5120 12288 4 1 64 64 1 1" "17408 5120 4 1 128 128 2 1"
     "5120 12288 4 1 256 256 1 1" "4096 4096 4 1 512 256 2 1" "5120 12288 4 1 1024 256 1 1")
for e in sp if3 sp if3; do
  VLLM_EXL3_SPREAD=1 timeout 40 python3 scripts/bench/pin.py .s17/$e.so $e "${CFG[@]}" 2>&1 | grep -v -i warn
done
i=0
for e in sp if3 sp if3; do
  i=$((i + 1))
  timeout 45 python3 scripts/bench/bench_linear.py --ext .s17/$e.so --no-exl3 --bits 4 \
    --codebooks 1 2 --m 64 128 256 --out "$OUT" --tag t${i}_$e > "$OUT/bench_t${i}_$e.log" 2>&1
  echo "== t$i $e rc=$?"
done
for tool in memcheck racecheck; do
  timeout 50 compute-sanitizer --tool $tool --error-exitcode 9 python3 \
    scripts/bench/verify_kernels.py --ext .s17/if3.so --sample 2>&1 | tail -1
  echo "$tool exit ${PIPESTATUS[0]}"
done
cd "$OUT" && rm -f *.csv t*_2026-11-30.json && tar czf bench_t.tgz bench_t*.log && rm bench_t*.log && ls
