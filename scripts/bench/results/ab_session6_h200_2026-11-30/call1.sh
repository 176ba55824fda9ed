# Session 6, call 1 (single H200): first run of the wgmma engine (wg1.so) - quick verification,
# then a tuned A/B against main's kernels (base.so = d46a0e8's), 4-bit MCG/MUL1, m 32..4096.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call1.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
B=.s6/base.so; W=.s6/wg1.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
log "verify wg1 (quick)"
timeout 150 $PY scripts/bench/verify_kernels.py --ext $W --quick --json $OUT/verify_wg1_quick.json 2>&1 | tail -14
$PY - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/verify_wg1_quick.json"))
for f in d["failures"][:12]: print("FAIL", f)
PY
for v in base wg base wg; do
  e=$B; [ $v = wg ] && e=$W
  log "$v tuned, 4-bit MCG+MUL1, m 32..4096, 2 shapes"
  VLLM_EXL3_LOG_PLANS=1 timeout 120 $PY scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT \
    --tag ab_${v}_$SECONDS --bits 4 --codebooks 1 2 --m 32 64 128 256 512 1024 4096 \
    --shapes 5120x12288 4096x11008 2>$OUT/plans_${v}_$SECONDS.log | grep -E "^ *[0-9]+x|^ *k "
done
log "call1 done"
cd "$OUT" && tar czf call1_files.tgz --exclude=call1_files.tgz --exclude=call1.log ./*.json ./*.csv ./*.log 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call1_files.tgz ! -name call1.log -delete; ls
