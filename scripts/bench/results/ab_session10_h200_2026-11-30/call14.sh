#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 10 call 14 (one command line, kept as run): stall reasons and pipe use of the
# original-basis reconstruct, main's build and recon-unroll's ru2.so, on the first layer of
# recon_probe.py (5120x12288 4-bit MCG, two launches each). .s11 carried as in call 13.
D=scripts/bench/results/ab_session10_h200_2026-11-30; for e in main ru2; do timeout 80 ncu --clock-control none -k regex:exl3_reconstruct_original -c 2 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active" python3 $D/recon_probe.py .s11/$e.so > $OUT/ncu_stalls_$e.txt 2>&1; echo "== $e"; grep -E "ratio|pct|per_second|wavefronts" $OUT/ncu_stalls_$e.txt | awk '$NF+0 > 0.05 {print $1, $NF}' | head -60; done
