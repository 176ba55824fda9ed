# Session 4, call 8 (single H200): reconstruct with fp16 butterflies before the H16 mma and the
# 1/128 on the H16 constants (recon.so) vs c18a58e (base.so).
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
DEADLINE=${DEADLINE:-185}
exec > >(tee -a "$OUT/call8.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
log "verify recon (full)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext .sk/recon.so --json $OUT/verify_recon.json 2>&1 | tail -11
for v in base recon; do log "recon_error $v"; timeout 30 $PY scripts/bench/recon_error.py --ext .sk/$v.so --json $OUT/recon_error_$v.json 2>&1 | tail -4; done
for v in base recon; do
  log "$v tuned, 4-bit MCG, large m"
  timeout 45 $PY scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag large_m_$v --bits 4 --codebooks 1 --m 512 1024 4096 2>/dev/null | grep -E "^ *[0-9]+x"
done
[ "$(left)" -gt 20 ] && { log "memcheck sample (recon)"; timeout $(( $(left) < 40 ? $(left) : 40 )) compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 $PY scripts/bench/verify_kernels.py --ext .sk/recon.so --sample > "$OUT/memcheck_recon.log" 2>&1; echo "memcheck exit $?"; tail -2 "$OUT/memcheck_recon.log"; }
[ "$(left)" -gt 45 ] && { log "racecheck sample (recon)"; timeout $(left) compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 $PY scripts/bench/verify_kernels.py --ext .sk/recon.so --sample > "$OUT/racecheck_recon.log" 2>&1; echo "racecheck exit $?"; tail -2 "$OUT/racecheck_recon.log"; }
[ "$(left)" -gt 25 ] && { log "interleaved (recon)"; timeout $(left) $PY scripts/bench/interleaved.py --ext .sk/recon.so --json $OUT/interleaved_recon.json 2>&1 | grep -v Warn; }
log "call8 done"
