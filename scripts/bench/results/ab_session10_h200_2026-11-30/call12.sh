#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 10 call 12: Nsight Compute on main's large-m and mid-m kernels, to say where their time
# goes (README §5). Run from the repository root with .s11/main.so carried. ncu flushes the
# caches before each profiled kernel (cold, as the benchmarks) and runs at the card's own
# clocks (--clock-control none). Output: $OUT/ncu_*.txt; about 2 minutes.
set -u
: "${OUT:?OUT must be set}"
E=.s11/main.so
P="python3 scripts/bench/ncu_probe.py"
SECT="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
NCU="timeout 100 ncu --clock-control none"
# Every kernel of the large-m op at 5120x12288 m = 1024, both bases, and the bf16 GEMM it is
# measured against: durations only.
for basis in original rotated; do
  $NCU --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    $P 4 1 1024 --k 5120 --n 12288 --reconstruct $basis --ext $E > "$OUT/ncu_times_$basis.txt" 2>&1
done
$NCU --metrics gpu__time_duration.sum python3 -c "
import torch
x = torch.randn(1024, 5120, device='cuda').bfloat16()
w = torch.randn(5120, 12288, device='cuda').bfloat16()
for _ in range(3): torch.matmul(x, w)
torch.cuda.synchronize()" > "$OUT/ncu_times_bf16.txt" 2>&1
# The reconstruct kernel (original basis) in full.
$NCU $SECT -k regex:exl3_reconstruct -c 1 \
  $P 4 1 1024 --k 5120 --n 12288 --reconstruct original --ext $E > "$OUT/ncu_recon_original.txt" 2>&1
# The 256-token wgmma GEMM at m = 256 (classic grid, no split), 5120x12288.
$NCU $SECT -k regex:exl3_gemm_kernel -c 1 \
  $P 4 1 256 --k 5120 --n 12288 --bm 256 --split 1 --ext $E > "$OUT/ncu_gemm_bm256_m256.txt" 2>&1
for f in "$OUT"/ncu_times_*.txt; do
  echo "== $f"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes" "$f" | head -40
done
for f in "$OUT"/ncu_recon_original.txt "$OUT"/ncu_gemm_bm256_m256.txt; do
  echo "== $f"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Issued Warp Per Scheduler|Active Warps Per Scheduler|Eligible Warps|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|L2 Hit Rate|Block Limit" "$f" | head -30
done
