# Session 9, call 1 (main at 591068b; kernels = 3ce21a4's csrc + 6fcbe7e's host check): start
# ExLlamaV3's JIT build for the anchor (call 3), the full checks of main's build (6fcbe7e's
# refusal of a stream-k plan on a tier without the stream-k grid has not run on a GPU yet), then
# Nsight Compute on the 4096x4096 m = 1 GEMM at split 8 (about twice its issue bound in session 8
# call 8): launch, occupancy, warp stalls, scheduler and memory sections, cold (ncu flushes caches).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >(tee -a "$OUT/call1.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S=/tmp/exl3_next
mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site .whl/*.whl
python3 scripts/bench/exllamav3_anchor.py build --state $S --jobs 12
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
bash scripts/bench/checks.sh .s9/main.so main
for cfg in "4 1 1" "4 2 1"; do
  log "ncu 4096x4096 bits/cb/m $cfg split 8"
  timeout 90 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 scripts/bench/ncu_probe.py $cfg --split 8 --ext .s9/main.so > "$OUT/ncu_${cfg// /_}.txt" 2>&1
  echo "ncu exit $?"; grep -E "Duration|Registers Per|Block Size|Grid Size|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|DRAM Throughput|Memory Throughput|Shared Memory Config" "$OUT/ncu_${cfg// /_}.txt"
done
log "call1 done"; python3 scripts/bench/exllamav3_anchor.py wait --state $S --timeout 1
cd "$OUT" && tar czf call1_files.tgz --exclude=call1_files.tgz --exclude=call1.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call1_files.tgz ! -name call1.log -delete; ls
