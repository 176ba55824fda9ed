# Session 9, call 8: ws3.so = branch wg-ws2 at its second commit (the producer's four k16 decodes
# as independent chains), -DEXL3_WS_BM256=1. verify, one pinned round against main.so, then
# Nsight Compute with per-instruction stall sampling of its BM 256 kernel (5120x12288 4-bit MCG
# m = 1024, split 1), exported as a report and as the SASS source page (CSV).
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/call8.log") 2>&1
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s9/ws3.so --json "$OUT/verify_ws3.json" 2>&1 | tail -3
rc=${PIPESTATUS[0]}; echo "verify exit $rc"
if [ "$rc" = 0 ]; then
  CFG=()
  for sh in "5120 12288" "17408 5120" "4096 11008"; do
    for m in 256 1024; do CFG+=("$sh 4 1 $m 256 1 1"); done
  done
  for e in main ws3; do timeout 60 python3 scripts/bench/pin.py .s9/$e.so ${e}_c8 "${CFG[@]}"; done 2>&1 | grep -v "^$"
  timeout 90 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --section WarpStateStats \
    --section SourceCounters --section SchedulerStats --export "$OUT/ws3_bm256" \
    python3 scripts/bench/ncu_probe.py 4 1 1024 --k 5120 --n 12288 --bm 256 --split 1 \
    --ext .s9/ws3.so > /dev/null 2>&1; echo "ncu exit $?"
  timeout 60 ncu -i "$OUT/ws3_bm256.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ws3_source.csv" 2>&1; echo "source page exit $?"; wc -l "$OUT/ws3_source.csv"
fi
cd "$OUT" && tar czf call8_files.tgz --exclude=call8_files.tgz --exclude=call8.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call8_files.tgz ! -name call8.log -delete; ls -la
