#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 15, call 3: why sk-fixup's stream-k GEMM is slower than main's (call 2: its GEMM ends
# 9 µs later at 5120x12288 m = 256): ncu stall reasons of the stream-k GEMM kernel alone, main
# (.s19/sp.so) against the branch (.s19/skfix.so), and the branch's per-instruction warp-state
# samples at m = 256 (SASS page as CSV) to place its stalls in the code.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 VLLM_EXL3_WGMMA=1 VLLM_EXL3_SPREAD=1 VLLM_EXL3_STREAM_K=1
M=gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg.pct_of_peak_sustained_elapsed
for r in barrier long_scoreboard wait sleeping membar lg_throttle math_pipe_throttle dispatch_stall \
         short_scoreboard mio_throttle selected not_selected no_instruction branch_resolving; do
  M="$M,smsp__warp_issue_stalled_${r}_per_warp_active.pct"
done
for a in "256 --bm 256 --k 5120 --n 12288" "128 --bm 128 --k 5120 --n 12288" \
         "256 --bm 128 --k 4096 --n 4096"; do
  for e in sp skfix; do
    echo "== $e m=$a"
    timeout 100 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics "$M" \
      python3 scripts/bench/ncu_probe.py 4 1 $a --split 0 --ext .s19/$e.so 2>&1 \
      | grep -E "^\s+(gpu__|sm__|smsp__)|==ERR|rror" \
      | sed -E 's/smsp__warp_issue_stalled_//; s/_per_warp_active.pct//'
  done
done
timeout 150 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --section WarpStateStats \
  --section SourceCounters -o "$OUT/skfix256" -f \
  python3 scripts/bench/ncu_probe.py 4 1 256 --bm 256 --k 5120 --n 12288 --split 0 \
  --ext .s19/skfix.so > /dev/null 2>&1
timeout 100 ncu -i "$OUT/skfix256.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/skfix256_sass.csv" 2> "$OUT/skfix256_sass.err"
wc -c "$OUT"/skfix256*; head -c 600 "$OUT/skfix256_sass.csv"; echo; head -5 "$OUT/skfix256_sass.err"
