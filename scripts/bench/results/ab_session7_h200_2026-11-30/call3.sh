# Session 7, call 3: where the wgmma engine's time goes. Measurement-only builds of ef4f9e0
# (branch `probes`, never merged): nodec.so feeds the raw trellis words to the wgmma instead of
# decoding them (wrong results; same loads, barriers and wgmmas), nomma.so decodes but issues no
# wgmma (the decoded registers are folded into a sink). Pinned cold A/B against lds.so.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call3.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S="5120 12288 4 1"
CFG=("$S 64 64 4 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 2 1 1024 256 1 1")
for e in lds nodec nomma lds nodec nomma; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call3 done"
cd "$OUT" && tar czf call3_files.tgz --exclude=call3_files.tgz --exclude=call3.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call3_files.tgz ! -name call3.log -delete; ls
