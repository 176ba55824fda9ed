# Session 7, call 10: peel.so = branch wg-peel (ea60c72 + the BM 256 wgmma k loop split into
# iterations whose stages all refill, without the zero-byte guard's select and compare per copy,
# and a guarded tail: 237 instead of 253 SASS instructions per stage and thread, 4-bit MCG; only
# the 27 BM 256 wgmma kernels differ from rb.so). Full checks, then pinned cold A/B vs rb.so.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call10.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
F=.s7/peel.so
log "verify peel (full)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_peel.json 2>&1 | tail -10
log "pytest tests/gpu (peel)"
VLLM_EXL3_EXT=$F timeout 60 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
log "memcheck sample"
timeout 25 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample"
timeout 50 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
S="5120 12288 4 1"
CFG=("$S 256 256 1 1" "$S 512 256 2 1" "$S 1024 256 1 1" "4096 11008 2 1 1024 256 1 1" "4096 11008 8 1 1024 256 1 1" "17408 5120 4 1 256 256 3 1" "4096 4096 4 2 256 256 4 1" "5120 17408 6 0 2048 256 1 1")
for e in rb peel rb peel rb peel; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call10 done"
cd "$OUT" && tar czf call10_files.tgz --exclude=call10_files.tgz --exclude=call10.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call10_files.tgz ! -name call10.log -delete; ls
