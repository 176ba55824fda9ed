# Session 5, call C (single H200): fused input transform + split-k finish prefetch (ft.so = the
# working tree's csrc) against main's kernels (recon.so): verification, sanitizers, tuned A/B at
# small m, per-kernel graph times; ExLlamaV3 builds meanwhile for a same-run anchor subset.
set -u
export PYTHONUNBUFFERED=1
PY=python3
STATE=/tmp/exl3_next
T0=$(date +%s)
exec > >(tee -a "$OUT/callC.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
clocks() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
mkdir -p "$STATE"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/site" .whl/*.whl
$PY scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs 12
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=.sk/recon.so; F=.sk/ft.so
log "verify ft (full)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_ft.json 2>&1 | tail -14
log "pytest tests/gpu (ft)"
VLLM_EXL3_EXT=$F timeout 90 $PY -m pytest -q -x -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu_ft.log" 2>&1
echo "pytest exit $?"; tail -2 "$OUT/pytest_gpu_ft.log"
log "memcheck sample (ft)"
timeout 80 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample > "$OUT/memcheck_ft.log" 2>&1
echo "memcheck exit $?"; tail -2 "$OUT/memcheck_ft.log"
log "racecheck sample (ft)"
timeout 100 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample > "$OUT/racecheck_ft.log" 2>&1
echo "racecheck exit $?"; tail -2 "$OUT/racecheck_ft.log"
for v in base ft base ft; do
  e=$B; [ $v = ft ] && e=$F
  log "$v tuned, m 1-16, 4/5-bit MCG/MUL1; clocks $(clocks)"
  VLLM_EXL3_LOG_PLANS=1 timeout 80 $PY scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT \
    --tag small_${v}_$SECONDS --bits 4 5 --codebooks 1 2 --m 1 2 4 8 16 2>>$OUT/plans_$v.log | grep -E "^ *[0-9]+x" | grep -E " (1|4) +[0-9.]+ +nan" 
done
log "graph kernels (ft), 5120x12288 5-bit MUL1 m = 1, 4-bit MCG m = 1 and 4096x4096 4-bit MCG m = 1"
timeout 90 $PY scripts/bench/graph_kernels.py --ext $F --json $OUT/graph_kernels_ft.json \
  --case 5120x12288:5:2:1 --case 5120x12288:4:1:1 --case 4096x4096:4:1:1 2>&1 | tail -30
$PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout $(( $(left) - 150 ))
b=$(( $(left) - 30 ))
log "same-run anchor subset (ft), budget $b s"
timeout $(( b + 25 )) $PY scripts/bench/bench_linear.py --ext $F --out $OUT --tag anchor_ft \
  --exl3-state "$STATE" --exl3-wait-s 10 --exl3-import-timeout-s 60 --bits 5 4 6 2 3 --codebooks 2 1 0 \
  --m 1 2 4 8 16 --budget-s $b 2>/dev/null | grep -E "^ *[0-9]+x" | awk '$5<=1'
log "callC done"
# At most 8 files come back: everything but this log in one archive.
cd "$OUT" && tar czf callC_files.tgz --exclude=callC_files.tgz --exclude=callC.log . && \
  find . -maxdepth 1 -type f ! -name callC_files.tgz ! -name callC.log -delete
