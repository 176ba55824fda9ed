# Session 6, call 12: full checks of lpr.so (= c51a785 + the wgmma engine's one-step-ahead trellis
# reads; the commit that merges it builds to the same SASS): verify (full), tests/gpu,
# compute-sanitizer memcheck and racecheck samples.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call12.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
F=.s6/lpr.so
log "verify lpr (full)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_lpr.json 2>&1 | tail -10
log "pytest tests/gpu (lpr)"
VLLM_EXL3_EXT=$F timeout 45 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
log "memcheck sample"
timeout 25 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample"
timeout 50 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "call12 done"
