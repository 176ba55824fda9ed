#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 10 call 13: the original-basis reconstruct restructured (branch recon-unroll), README §5.
# .s11 carried: main.so, ru2.so (recon-unroll at its head: unrolled copies and stores, each
# tile's products handed on after its mma, svh staged in shared memory, 4 blocks per SM at 64
# registers) and ru3.so (the same source at 3 blocks per SM, 80 registers). 1) the full checks
# of ru2.so; 2) ncu durations of every reconstruct launch on six layers, each build in turn;
# 3) a pinned cold A/B of the whole op (reconstruct + cuBLAS, original basis) at m = 1024 and
# 4096, main / ru2 alternating, two rounds. Everything lands in $OUT/call13.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
D=scripts/bench/results/ab_session10_h200_2026-11-30
R=$OUT/r
mkdir -p "$R"
OUT=$R bash scripts/bench/checks.sh .s11/ru2.so ru2 2>&1 | grep -v "^$" | tail -24
M=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
for e in main ru2 ru3 main ru2; do
  timeout 90 ncu --clock-control none -k regex:exl3_reconstruct_original --metrics $M \
    python3 $D/recon_probe.py .s11/$e.so > "$R/ncu_recon_$e.txt" 2>&1
  echo "== $e"
  grep -E "gpu__time_duration|sm__warps_active|sm__inst_executed|dram__throughput" "$R/ncu_recon_$e.txt" \
    | awk '{print $1, $NF}' | paste - - - - | awk '{printf "%s %8s  %s %6s  %s %6s  %s %6s\n", $1,$2,$3,$4,$5,$6,$7,$8}'
done
CFG=()
for sh in "5120 12288" "5120 17408" "17408 5120"; do
  for m in 1024 4096; do CFG+=("$sh 4 1 $m 0 1 0"); done
done
for round in 1 2; do
  for e in main ru2; do
    OUT=$R VLLM_EXL3_RECONSTRUCT_BASIS=original timeout 100 python3 scripts/bench/pin.py \
      .s11/$e.so ${e}_r$round "${CFG[@]}"
  done
done > "$R/pinned.log" 2>&1
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def best(e):
    t = {}
    for r in (1, 2):
        for row in json.loads((d / f"pin_{e}_r{r}.json").read_text()):
            key = (row["k"], row["n"], row["m"])
            t[key] = min(t.get(key, 1e9), row["us"])
    return t
a, b = best("main"), best("ru2")
for key in sorted(a):
    print(f"{key[0]}x{key[1]} m={key[2]}: main {a[key]:7.1f}  ru2 {b[key]:7.1f} us  {b[key] / a[key]:.3f}")
PY
tar czf "$OUT/call13.tgz" -C "$R" .
