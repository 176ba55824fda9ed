#!/usr/bin/env bash
# Session 11, call 21 (main + the early-release change, uncommitted at the time; .s12 carried):
# er.so = that tree's quick build, main.so = main 0afe1f5's kernels. 1) the full checks of er.so
# (with tests/gpu's new assertions on the release candidates); 2) a tuned cold A/B against bf16
# at m = 1-16, 4-bit MCG and MUL1, five shapes, main then er; 3) er's timeline inside graphs
# with the tuner free (the plan it keeps is logged).
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
R=$OUT/c21; mkdir -p "$R"
OUT=$R bash scripts/bench/checks.sh .s12/er.so er 2>&1 | grep -v "^$" | tail -22
for e in main er; do
  timeout 150 python3 scripts/bench/bench_linear.py --ext .s12/$e.so --no-exl3 --bits 4 \
    --codebooks 1 2 --m 1 2 4 8 16 --out "$R" --tag tuned_$e > "$R/bench_$e.log" 2>&1
  echo "== $e rc=$?"; tail -3 "$R/bench_$e.log"
done
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def rows(e):
    f = sorted(d.glob(f"tuned_{e}*.json"))[-1]
    data = json.loads(f.read_text())
    return {(r["k"], r["n"], r["codebook"], r["m"]): r for r in data["rows"]}
a, b = rows("main"), rows("er")
rs = []
for key in sorted(a):
    if key not in b: continue
    ra, rb = a[key], b[key]
    r = rb["ours_us"] / ra["ours_us"]; rs.append(r)
    print(f"{key[0]}x{key[1]} cb{key[2]} m={key[3]:2d}: main {ra['ours_us']:6.1f} ({ra['ours_us']/ra['bf16_us']:.2f})"
          f"  er {rb['ours_us']:6.1f} ({rb['ours_us']/rb['bf16_us']:.2f})  er/main {r:.3f}")
print(f"er / main geomean {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)} points")
PY
VLLM_EXL3_LOG_PLANS=1 timeout 60 python3 scripts/bench/graph_timeline.py --ext .s12/er.so \
  --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 > "$R/timeline_er.log" 2>&1
grep -E "^4096" "$R/timeline_er.log"
tar czf "$OUT/call21.tgz" -C "$R" .
