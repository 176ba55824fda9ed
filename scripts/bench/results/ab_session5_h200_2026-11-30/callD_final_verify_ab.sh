# Session 5, call D (single H200): the kernels main ends the session with (final.so: main's csrc
# plus the split-k finish's early column-factor loads) — verification, sanitizers, tests/gpu,
# and a short alternating tuned A/B against recon.so (main's kernels before the change).
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/callD.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
B=.sk/recon.so; F=.sk/final.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
log "verify final (full)"
timeout 100 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_final.json 2>&1 | tail -13
log "pytest tests/gpu (final)"
VLLM_EXL3_EXT=$F timeout 60 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -2
log "memcheck sample (final)"
timeout 40 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -2; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample (final)"
timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -2; echo "exit ${PIPESTATUS[0]}"
for v in base final base final; do
  e=$B; [ $v = final ] && e=$F
  log "$v tuned, 4/5-bit MUL1, m 1 8 16 64"
  timeout 45 $PY scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT --tag ab_${v}_$SECONDS \
    --bits 4 5 --codebooks 2 --m 1 8 16 64 2>/dev/null | grep -E "^ *[0-9]+x" | grep -E " 1 +[0-9.]+ +nan"
done
log "callD done"
cd "$OUT" && tar czf callD_files.tgz --exclude=callD_files.tgz --exclude=callD.log ./*.json ./*.csv 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name callD_files.tgz ! -name callD.log -delete; ls
