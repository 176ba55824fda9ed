# Session 6, call 6 (single H200): final.so = main's csrc with the wgmma engine (kWgmmaInFlight 1).
# Starts ExLlamaV3's JIT build for call 7's anchor, then the full checks of final.so: verify
# (full matrix, both engines), tests/gpu, compute-sanitizer memcheck / racecheck / synccheck.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
STATE=/tmp/exl3_next
exec > >(tee -a "$OUT/call6.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
F=.s6/final.so
mkdir -p $STATE
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STATE/site .whl/*.whl
$PY scripts/bench/exllamav3_anchor.py build --state $STATE --jobs 12
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
log "verify final (full)"
timeout 200 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_final.json 2>&1 | tail -12
log "pytest tests/gpu (final)"
VLLM_EXL3_EXT=$F timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/gpu > $OUT/pytest_gpu.log 2>&1
echo "pytest exit $?"; tail -3 $OUT/pytest_gpu.log
log "memcheck sample (final)"
timeout 60 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample > $OUT/memcheck.log 2>&1; echo "exit $?"; tail -2 $OUT/memcheck.log
log "racecheck sample (final)"
timeout 90 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample > $OUT/racecheck.log 2>&1; echo "exit $?"; tail -2 $OUT/racecheck.log
log "synccheck sample (final)"
timeout 60 compute-sanitizer --tool synccheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample > $OUT/synccheck.log 2>&1; echo "exit $?"; tail -2 $OUT/synccheck.log
$PY scripts/bench/exllamav3_anchor.py wait --state $STATE --timeout 0 | head -2
log "call6 done"
cd "$OUT" && tar czf call6_files.tgz --exclude=call6_files.tgz --exclude=call6.log ./*.json ./*.log 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call6_files.tgz ! -name call6.log -delete; ls
