# Session 6, call 2: is the per-stage proxy fence (MEMBAR.ALL.CTA) the wgmma engine's brake?
# wg1.so vs nf.so (same sources without fence.proxy.async: a measurement only), pinned cold
# configs on 5120x12288 4-bit MCG; then ncu of wg1 at m = 256 (BM 128, split 2).
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call2.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S="5120 12288 4 1"
CFG=("$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "$S 128 128 4 0" "$S 256 128 2 0")
for e in wg1 nf wg1 nf; do
  log "$e"
  timeout 100 $PY .s6/pin.py .s6/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "ncu wg1 m=256 bm=128 split=2"
VLLM_EXL3_WGMMA=1 timeout 120 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
  --metrics gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_membar,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warp_latency_issue_stalled_math_pipe_throttle,smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__average_warp_latency_issue_stalled_selected,smsp__average_warp_latency_issue_stalled_dispatch_stall,smsp__average_warp_latency_issue_stalled_misc,smsp__average_warp_latency_issue_stalled_sleeping,smsp__average_warp_latency_issue_stalled_not_selected \
  $PY scripts/bench/ncu_probe.py 4 1 256 --k 5120 --n 12288 --bm 128 --split 2 --ext .s6/wg1.so 2>&1 | grep -E "^\s+(gpu__|sm__|smsp__)|==ERR|rror" | head -30
log "call2 done"
cd "$OUT" && tar czf call2_files.tgz --exclude=call2_files.tgz --exclude=call2.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call2_files.tgz ! -name call2.log -delete; ls
