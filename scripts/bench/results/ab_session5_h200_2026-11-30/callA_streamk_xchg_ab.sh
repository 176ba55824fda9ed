# Session 5, call A (single H200): ExLlamaV3 build in the background; stream-k at small m
# (sk2 = branch streamk rebased on main) and the per-k16 decode exchange at BM 128 (x2 = branch
# xchg rebased on main) against main's kernels (recon.so): verification, tuned / pinned A/B, ncu.
set -u
export PYTHONUNBUFFERED=1
PY=python3
STATE=/tmp/exl3_next
T0=$(date +%s)
exec > >(tee -a "$OUT/callA.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
clocks() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
mkdir -p "$STATE"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/site" .whl/*.whl
$PY scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs 12
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=.sk/recon.so; S=.sk/sk2/_exl3_C.abi3.so; X=.sk/x2/_exl3_C.abi3.so
log "verify sk2 (full, with stream-k cases)"
timeout 150 $PY .sk/sk2_bench/verify_kernels.py --ext $S --json $OUT/verify_sk2.json 2>&1 | tail -13
log "small m, tuned: base vs sk2; clocks $(clocks)"
for v in base sk2; do
  e=$B; [ $v = sk2 ] && e=$S
  VLLM_EXL3_LOG_PLANS=1 timeout 110 $PY scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT \
    --tag small_$v --bits 4 5 --codebooks 1 2 --m 1 2 4 8 16 32 64 2>$OUT/plans_$v.log | grep -E "^ *[0-9]+x"
  log "$v done; clocks $(clocks)"
done
log "ncu m = 1, 5120x12288 5-bit MUL1: base split 6 / 12, sk2 stream-k"
M="gpu__time_duration.sum,launch__grid_size,launch__waves_per_multiprocessor,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__sass_thread_inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active"
for cfg in "base 6" "base 12" "sk2 0"; do
  set -- $cfg; e=$B; [ $1 = sk2 ] && e=$S
  env $([ $1 = sk2 ] && echo VLLM_EXL3_STREAM_K=1) timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics $M \
    $PY scripts/bench/ncu_probe.py 5 2 1 --k 5120 --n 12288 --split $2 --ext $e 2>&1 | \
    grep -E "launch__|sm__|smsp__|gpu__|ERR|rror" | sed "s/^/[$cfg] /"
done
log "verify x2 (full)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext $X --json $OUT/verify_x2.json 2>&1 | tail -12
for v in base x2; do
  e=$B; [ $v = x2 ] && e=$X
  log "$v pinned BM 128, 4-bit MCG; clocks $(clocks)"
  VLLM_EXL3_BM=128 VLLM_EXL3_RECONSTRUCT_M=0 timeout 100 $PY scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT --tag bm128_$v --bits 4 --codebooks 1 --m 128 256 512 1024 2>/dev/null | grep -E "^ *[0-9]+x"
done
log "pytest tests/gpu (sk2)"
VLLM_EXL3_EXT=$S timeout 120 $PY -m pytest -q -x -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu_sk2.log" 2>&1
echo "pytest exit $?"; tail -3 "$OUT/pytest_gpu_sk2.log"
log "memcheck sample (sk2)"
timeout 100 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY .sk/sk2_bench/verify_kernels.py --ext $S --sample > "$OUT/memcheck_sk2.log" 2>&1
echo "memcheck exit $?"; tail -3 "$OUT/memcheck_sk2.log"
$PY - <<'PYEOF' > "$STATE/choice"
import json, statistics, os, glob, sys
out = os.environ["OUT"]
try:
    summ = json.load(open(f"{out}/verify_sk2.json"))["summary"]
    ok = bool(summ) and sum(v["failed"] for v in summ.values()) == 0
except Exception as e:
    ok = False
def rows(tag):
    f = glob.glob(f"{out}/{tag}_*.json")
    return {(r["k"], r["n"], r["bits"], r["codebook"], r["m"]): r["ours_us"] for r in json.load(open(f[0]))["rows"]} if f else {}
b, s = rows("small_base"), rows("small_sk2")
common = [key for key in b if key in s]
g = statistics.geometric_mean([s[c] / b[c] for c in common]) if common else 9
print(".sk/sk2/_exl3_C.abi3.so" if ok and g <= 0.99 else ".sk/recon.so")
print(f"verify_sk2 all_pass={ok} sk2/base geomean={g:.3f} over {len(common)}", file=sys.stderr)
PYEOF
log "choice $(cat $STATE/choice)"
$PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout 0 | head -2
log "callA done"
