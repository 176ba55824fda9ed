# Session 4, call B (single H200): ExLlamaV3 build in the background; in-kernel split-k finish
# (fixup.so) vs the two-kernel split-k (base.so): verification, tuned A/B, graph probe, GPU tests,
# sanitizers; writes the anchor's choice of kernels.
set -u
export PYTHONUNBUFFERED=1
PY=python3
STATE=/tmp/exl3_next
T0=$(date +%s)
DEADLINE=${DEADLINE:-470}
exec > >(tee -a "$OUT/callB.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
mkdir -p "$STATE"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/site" .whl/*.whl
$PY scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs 12
log "verify fixup (full)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext .sk/fixup.so --json $OUT/verify_fixup.json 2>&1 | tail -12
for v in base fixup; do
  log "$v tuned, 4/5-bit MUL1"
  timeout 100 $PY scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag tuned_$v --bits 4 5 --codebooks 2 --m 1 4 16 32 64 256 2>/dev/null | grep -E "^ *[0-9]+x"
done
$PY - <<'PYEOF' > "$STATE/choice"
import glob, json, os, statistics, sys
out = os.environ["OUT"]
try:
    summ = json.load(open(f"{out}/verify_fixup.json"))["summary"]
    ok = bool(summ) and sum(v["failed"] for v in summ.values()) == 0
except Exception:
    ok = False
def rows(tag):
    f = glob.glob(f"{out}/{tag}_*.json")
    return {(r["k"], r["n"], r["bits"], r["m"]): r["ours_us"] for r in json.load(open(f[0]))["rows"]} if f else {}
b, w = rows("tuned_base"), rows("tuned_fixup")
common = [c for c in b if c in w]
g = statistics.geometric_mean([w[c] / b[c] for c in common]) if common else 9
print(".sk/fixup.so" if ok and g <= 1.0 else ".sk/base.so")
print(f"verify_fixup all_pass={ok} fixup/base geomean={g:.3f} over {len(common)}", file=sys.stderr)
PYEOF
log "choice $(cat $STATE/choice)"
log "graph probe, fixup"
timeout 90 $PY scripts/bench/graph_kernels.py --ext .sk/fixup.so --json $OUT/graph_kernels_fixup.json \
  --case 5120x12288:5:2:1 --case 5120x17408:5:2:1 --splits 4 8 16 2>&1 | grep -v "cand\|Warn\|_warn" | tail -30
[ "$(left)" -gt 60 ] && { log "pytest tests/gpu (fixup)"
  VLLM_EXL3_EXT=.sk/fixup.so timeout $(( $(left) < 120 ? $(left) : 120 )) $PY -m pytest -q -x -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest exit $?"; tail -3 "$OUT/pytest_gpu.log"; }
[ "$(left)" -gt 60 ] && { log "memcheck sample (fixup)"
  timeout $(( $(left) < 120 ? $(left) : 120 )) compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
    $PY scripts/bench/verify_kernels.py --ext .sk/fixup.so --sample > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; tail -4 "$OUT/memcheck.log"; }
[ "$(left)" -gt 60 ] && { log "racecheck sample (fixup)"
  timeout $(left) compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    $PY scripts/bench/verify_kernels.py --ext .sk/fixup.so --sample > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; tail -4 "$OUT/racecheck.log"; }
$PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout 0 | head -2
log "callB done"
