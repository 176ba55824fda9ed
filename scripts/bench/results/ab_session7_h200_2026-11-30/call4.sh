# Session 7, call 4: the wgmma pipeline without the decode (nodec.so, call 3), and two further
# measurement-only builds of branch `probes` on top of it: nodec_nobar.so drops the stage
# barrier (__syncthreads; racy), nodec_norefill.so issues no refill copies after the prologue
# (stale data). Pinned cold, same configurations as call 3.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call4.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S="5120 12288 4 1"
CFG=("$S 64 64 4 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 2 1 1024 256 1 1")
for e in nodec nodec_nobar nodec_norefill nodec nodec_nobar nodec_norefill; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call4 done"
cd "$OUT" && tar czf call4_files.tgz --exclude=call4_files.tgz --exclude=call4.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call4_files.tgz ! -name call4.log -delete; ls
