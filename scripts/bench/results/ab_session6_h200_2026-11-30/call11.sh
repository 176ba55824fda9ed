# Session 6, call 11: the trellis words read one k16 step ahead of their decode in the wgmma
# engine (call 10: the first LDS of each step and the decode waiting on it are ~30 % of the
# not-issued stall samples). lp.so: also the stage's first LDS issued before the refill copies;
# lpr.so: refill first, as before. Quick verify of both; pinned cold A/B against final.so.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call11.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
for e in lp lpr; do
  log "verify $e (quick)"
  timeout 60 $PY scripts/bench/verify_kernels.py --ext .s6/$e.so --quick --json $OUT/verify_${e}_quick.json 2>&1 | tail -1
done
S="5120 12288 4 1"
CFG=("$S 64 64 5 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1")
for e in final lp lpr final lp lpr; do
  log "$e"
  timeout 60 $PY .s6/pin.py .s6/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call11 done"
cd "$OUT" && tar czf call11_files.tgz --exclude=call11_files.tgz --exclude=call11.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call11_files.tgz ! -name call11.log -delete; ls
