# Session 7, call 9: kWgmmaInFlight = 2 (if2.so = ea60c72 with exl3_wgmma.cuh's constant at 2)
# against rb.so (ea60c72), now that the BM 256 refill no longer queues ahead of the first wgmma
# (session 6 measured 2 and 3 the same as 1 before that move). Quick verify, pinned cold A/B.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call9.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
log "verify if2 (quick)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext .s7/if2.so --quick --json $OUT/verify_if2_quick.json 2>&1 | tail -1
S="5120 12288 4 1"
CFG=("$S 64 64 4 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 2 1 1024 256 1 1" "4096 11008 8 1 1024 256 1 1" "17408 5120 4 1 256 256 3 1")
for e in rb if2 rb if2; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call9 done"
cd "$OUT" && tar czf call9_files.tgz --exclude=call9_files.tgz --exclude=call9.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call9_files.tgz ! -name call9.log -delete; ls
