# Session 7, call 7: what is left in the BM 256 engine after call 5's refill move (rb.so, branch
# wg-refill-spread). Measurement-only builds of it (probe macros as on branch `probes`):
# rb_nobar.so without the stage barrier (racy), rb_nodec.so without the decode (raw words fed
# to the wgmma), rb_nodec_nobar.so without both. Pinned cold, two rounds.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call7.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S="5120 12288 4 1"
CFG=("$S 64 64 4 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 2 1 1024 256 1 1" "4096 11008 8 1 1024 256 1 1" "17408 5120 4 1 256 256 3 1")
for e in rb rb_nobar rb_nodec rb_nodec_nobar rb rb_nobar rb_nodec rb_nodec_nobar; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call7 done"
cd "$OUT" && tar czf call7_files.tgz --exclude=call7_files.tgz --exclude=call7.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call7_files.tgz ! -name call7.log -delete; ls
