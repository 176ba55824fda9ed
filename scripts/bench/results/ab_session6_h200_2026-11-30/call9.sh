# Session 6, call 9: deeper pipelines for the wgmma engine (st.so: up to 6 slots where
# kMinBlocks blocks still fit, so 3-4 stages ahead instead of 2) vs final.so; quick verify of
# st.so; pinned cold A/B on 5120x12288 4-bit MCG and 8-bit (4 slots at 128 tokens) 4096x11008.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call9.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
log "verify st (quick)"
timeout 100 $PY scripts/bench/verify_kernels.py --ext .s6/st.so --quick --json $OUT/verify_st_quick.json 2>&1 | tail -1
S="5120 12288 4 1"
CFG=("$S 64 64 5 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 6 1 1024 256 1 1")
for e in final st final st; do
  log "$e"
  timeout 100 $PY .s6/pin.py .s6/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call9 done"
cd "$OUT" && tar czf call9_files.tgz --exclude=call9_files.tgz --exclude=call9.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call9_files.tgz ! -name call9.log -delete; ls
