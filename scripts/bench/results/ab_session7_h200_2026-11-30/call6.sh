# Session 7, call 6: rb.so = branch wg-refill-spread's head (ddebd76 + the BM 256 wgmma refill
# behind the stage's first wgmma; only the 27 BM 256 wgmma kernels differ from wave.so = ddebd76,
# SASS compared). Full checks of rb.so, then a tuned cold A/B wave vs rb (bench_linear, bf16 in
# the same run), 4-bit MCG and MUL1, five shapes, m 128..4096.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call6.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
F=.s7/rb.so
log "verify rb (full)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_rb.json 2>&1 | tail -10
log "pytest tests/gpu (rb)"
VLLM_EXL3_EXT=$F timeout 60 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
log "memcheck sample"
timeout 25 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample"
timeout 50 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
for v in wave rb; do
  log "bench $v"
  VLLM_EXL3_LOG_PLANS=1 timeout 150 $PY scripts/bench/bench_linear.py --ext .s7/$v.so --no-exl3 --out $OUT \
    --tag ab7_$v --bits 4 --codebooks 1 2 --m 128 256 512 1024 2048 4096 2>$OUT/plans6_$v.log | grep -E "^wrote"
done
log "call6 done"
cd "$OUT" && tar czf call6_files.tgz --exclude=call6_files.tgz --exclude=call6.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call6_files.tgz ! -name call6.log -delete; ls
