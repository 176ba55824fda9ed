# Session 9, call 3 (fresh machine: call 2's lease ended between calls, and ExLlamaV3's build of
# call 1 with it): start ExLlamaV3's JIT build again, Nsight Compute on the BM 256 wgmma kernel
# of main.so and of ws.so (5120x12288 4-bit MCG m = 1024, split 1, pinned) to see why the
# warp-specialized tier ran 25-35 % slower in call 2, then wait for the build (call 4 is the anchor).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >(tee -a "$OUT/call3.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S=/tmp/exl3_next
mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site .whl/*.whl
python3 scripts/bench/exllamav3_anchor.py build --state $S --jobs 12
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for e in main ws; do
  log "ncu $e BM 256, 5120x12288 4-bit MCG m=1024 split 1"
  timeout 120 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
    --section SourceCounters \
    python3 scripts/bench/ncu_probe.py 4 1 1024 --k 5120 --n 12288 --bm 256 --split 1 \
    --ext .s9/$e.so > "$OUT/ncu_bm256_$e.txt" 2>&1
  echo "ncu exit $?"; grep -E "Duration|Registers Per|Block Size|Grid Size|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Throughput|Executed Ipc A|Stall" "$OUT/ncu_bm256_$e.txt" | head -20
done
log "waiting for ExLlamaV3's build"
python3 scripts/bench/exllamav3_anchor.py wait --state $S --timeout $(( 540 - ($(date +%s) - T0) ))
log "call3 done"
cd "$OUT" && tar czf call3_files.tgz --exclude=call3_files.tgz --exclude=call3.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call3_files.tgz ! -name call3.log -delete; ls
