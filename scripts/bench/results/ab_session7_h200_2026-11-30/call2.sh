# Session 7, call 2: wave.so = lds.so's kernels (main ef4f9e0) + the tuner also timing the
# k-splits that fill 1-3 waves of resident blocks (exl3_plan.cpp). Quick verify and tests/gpu on
# wave.so, then a tuned cold A/B, lds.so vs wave.so, bench_linear (bf16 in the same run), 4-bit
# MCG, five shapes, m 32..1024.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call2.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
F=.s7/wave.so
log "verify wave (quick)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext $F --quick --json $OUT/verify_wave_quick.json 2>&1 | tail -1
log "pytest tests/gpu (wave)"
VLLM_EXL3_EXT=$F timeout 60 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
for v in lds wave; do
  log "bench $v"
  VLLM_EXL3_LOG_PLANS=1 timeout 200 $PY scripts/bench/bench_linear.py --ext .s7/$v.so --no-exl3 --out $OUT \
    --tag ab7_$v --bits 4 --codebooks 1 --m 32 64 128 256 512 1024 2>$OUT/plans_$v.log | grep -E "^ *[0-9]+x"
done
log "call2 done"
cd "$OUT" && tar czf call2_files.tgz --exclude=call2_files.tgz --exclude=call2.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call2_files.tgz ! -name call2.log -delete; ls
