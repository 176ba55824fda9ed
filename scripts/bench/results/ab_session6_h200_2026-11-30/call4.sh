# Session 6, call 4: wgmmas kept in flight per warpgroup: wg2 (1), wg3 (2), wg3b (3); quick
# verification of wg3 and wg3b; pinned cold A/B on 5120x12288 4-bit MCG.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call4.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
for e in wg3 wg3b; do
  log "verify $e (quick)"
  timeout 100 $PY scripts/bench/verify_kernels.py --ext .s6/$e.so --quick --json $OUT/verify_${e}_quick.json 2>&1 | tail -1
done
S="5120 12288 4 1"
CFG=("$S 64 64 5 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 512 256 1 1" "$S 1024 256 1 1" "$S 4096 256 1 1")
for e in wg2 wg3 wg3b wg2 wg3 wg3b; do
  log "$e"
  timeout 100 $PY .s6/pin.py .s6/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call4 done"
cd "$OUT" && tar czf call4_files.tgz --exclude=call4_files.tgz --exclude=call4.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call4_files.tgz ! -name call4.log -delete; ls
