# Session 6, call 3: wg2 = the wgmma engine with one wgmma per warpgroup kept in flight across
# stage barriers (slot refilled two stages later instead of draining) vs wg1; quick verification
# of wg2; ncu of wg2 at m = 256 and 1024.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call3.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
log "verify wg2 (quick)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext .s6/wg2.so --quick --json $OUT/verify_wg2_quick.json 2>&1 | tail -11
S="5120 12288 4 1"
CFG=("$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "$S 64 64 5 1" "$S 512 256 1 1" "$S 4096 256 1 1")
for e in wg1 wg2 wg1 wg2; do
  log "$e"
  timeout 100 $PY .s6/pin.py .s6/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "ncu wg2 m=256 bm=128 split=2, m=1024 bm=256"
for a in "256 --bm 128 --split 2" "1024 --bm 256 --split 1"; do
VLLM_EXL3_WGMMA=1 timeout 120 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
  --metrics gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_selected_per_warp_active.pct,smsp__warp_issue_stalled_dispatch_stall_per_warp_active.pct,smsp__warp_issue_stalled_misc_per_warp_active.pct,smsp__warp_issue_stalled_not_selected_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_sleeping_per_warp_active.pct,smsp__warp_issue_stalled_tex_throttle_per_warp_active.pct,smsp__warp_issue_stalled_imc_miss_per_warp_active.pct,smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct,smsp__warp_issue_stalled_no_instruction_per_warp_active.pct,smsp__warp_issue_stalled_drain_per_warp_active.pct \
  $PY scripts/bench/ncu_probe.py 4 1 $a --k 5120 --n 12288 --ext .s6/wg2.so 2>&1 | grep -E "^\s+(gpu__|sm__|smsp__)|==ERR|rror" | head -40
done
log "call3 done"
cd "$OUT" && tar czf call3_files.tgz --exclude=call3_files.tgz --exclude=call3.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call3_files.tgz ! -name call3.log -delete; ls
