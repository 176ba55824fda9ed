#!/usr/bin/env bash
# Session 11, call 1 (run from the repository root with branch recon-persist checked out and
# .s12 carried: .s12/main.so is main's quick build, .s12/rp.so recon-persist's).
# 1) l2_chunk_probe.py: the large-m path over column chunks (W through L2), main.so.
# 2) NEXT_SESSION item 5: 4096x4096 4-bit MCG BM 16 split 8, every kernel of the op at m = 1 and
#    16 under ncu, then the GEMM alone with three sections.
# 3) recon_persist_call.sh (the branch's own first call).
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
R=$OUT/s11; mkdir -p "$R"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== 1 chunk probe"
timeout 240 python3 scripts/bench/l2_chunk_probe.py --ext .s12/main.so --json "$R/chunk.json" 2>&1 | tee "$R/chunk.log" | grep -v Warning
echo "== 2 ncu m=1 vs 16"
for M in 1 16; do
  timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum \
    python3 scripts/bench/ncu_probe.py 4 1 $M --split 8 --ext .s12/main.so > "$R/ncu_all_m$M.txt" 2>&1
  echo "m=$M"; grep -E "exl3_|void|gpu__time_duration" "$R/ncu_all_m$M.txt" | grep -v "==PROF==" | awk '{$1=$1};1' | cut -c1-90 | tail -12
  timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    python3 scripts/bench/ncu_probe.py 4 1 $M --split 8 --ext .s12/main.so > "$R/ncu_gemm_m$M.txt" 2>&1
done
tar czf "$OUT/s11_call1.tgz" -C "$R" .
echo "== 3 recon-persist"
bash scripts/bench/recon_persist_call.sh
