# Session 7, call 5: the wgmma engine's stage refill moved off the barrier (branch
# wg-refill-spread): r1.so issues a stage's refill copies right behind its first wgmma, rs.so
# spreads them over the stage's four k16 steps (BM 128/256; BM 64 as r1). Refills past the
# split's end become zero-byte copies instead of a branch. Quick verify and memcheck of both;
# pinned cold A/B against lds.so (main's kernels), two rounds.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call5.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
for e in r1 rs; do
  log "verify $e (quick)"
  timeout 60 $PY scripts/bench/verify_kernels.py --ext .s7/$e.so --quick --json $OUT/verify_${e}_quick.json 2>&1 | tail -1
  log "memcheck sample $e"
  timeout 25 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
    $PY scripts/bench/verify_kernels.py --ext .s7/$e.so --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
done
S="5120 12288 4 1"
CFG=("$S 64 64 4 1" "$S 128 128 4 1" "$S 256 128 2 1" "$S 256 256 1 1" "$S 1024 256 1 1" "4096 11008 6 1 256 128 2 1" "4096 11008 2 1 1024 256 1 1" "4096 11008 8 1 1024 256 1 1" "17408 5120 4 1 256 256 3 1")
for e in lds r1 rs lds r1 rs; do
  log "$e"
  timeout 60 $PY .s7/pin.py .s7/$e.so ${e}_$SECONDS "${CFG[@]}"
done
log "call5 done"
cd "$OUT" && tar czf call5_files.tgz --exclude=call5_files.tgz --exclude=call5.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call5_files.tgz ! -name call5.log -delete; ls
