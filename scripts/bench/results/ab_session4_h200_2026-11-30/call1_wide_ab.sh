# Session 4, call 1 (single H200): ExLlamaV3 build in the background; wide-warp BM 128 (wide.so)
# vs the current one-tile-per-warp BM 128 (base.so): verification, pinned and tuned A/B, ncu.
set -u
export PYTHONUNBUFFERED=1
PY=python3
STATE=/tmp/exl3_next
T0=$(date +%s)
exec > >(tee -a "$OUT/call1.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
clocks() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
mkdir -p "$STATE"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/site" .whl/*.whl
$PY scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs 12
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
log "verify wide (full)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext .sk/wide.so --json $OUT/verify_wide.json 2>&1 | tail -12
echo "verify exit ${PIPESTATUS[0]}"
for v in base wide; do
  log "$v pinned BM 128, 4-bit MCG; clocks $(clocks)"
  VLLM_EXL3_BM=128 VLLM_EXL3_RECONSTRUCT_M=0 timeout 100 $PY scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag bm128_$v --bits 4 --codebooks 1 --m 64 128 256 512 1024 2>/dev/null | grep -E "^ *[0-9]+x"
done
for v in base wide; do
  log "$v ncu BM 128 m = 256 4096x11008"
  timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics \
    "gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,regex:^smsp__warp_issue_stalled_.*_per_warp_active.pct$" \
    $PY scripts/bench/ncu_probe.py 4 1 256 --n 11008 --bm 128 --split 1 --ext .sk/$v.so 2>&1 | \
    grep -E "launch__|sm__|smsp__|l1tex__|gpu__|ERR" | grep -v -E " 0(\.0+)?$" | sed "s/^/[$v] /"
done
for v in base wide; do
  log "$v tuner, 4-bit MCG; clocks $(clocks)"
  timeout 110 $PY scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag auto_$v --bits 4 --codebooks 1 --m 32 64 128 256 512 1024 2048 2>/dev/null | grep -E "^ *[0-9]+x"
done
log "clocks $(clocks)"
# Pick the kernels for the anchor: wide if it verified and its tuned times are not slower.
$PY - <<'PYEOF' > "$STATE/choice"
import json, statistics, os
out = os.environ["OUT"]
try:
    summ = json.load(open(f"{out}/verify_wide.json"))["summary"]
    ok = bool(summ) and sum(v["failed"] for v in summ.values()) == 0
except Exception:
    ok = False
def rows(tag):
    import glob
    f = glob.glob(f"{out}/{tag}_*.json")
    return {(r["k"], r["n"], r["m"]): r["ours_us"] for r in json.load(open(f[0]))["rows"]} if f else {}
b, w = rows("auto_base"), rows("auto_wide")
common = [key for key in b if key in w]
g = statistics.geometric_mean([w[c] / b[c] for c in common]) if common else 9
print(".sk/wide.so" if ok and g <= 1.0 else ".sk/base.so")
import sys; print(f"verify_wide all_pass={ok} wide/base geomean={g:.3f} over {len(common)}", file=sys.stderr)
PYEOF
log "choice $(cat $STATE/choice)"
$PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout 0 | head -2
log "call1 done"
