#!/usr/bin/env bash
# Session 11, call 22 (as call 21): 5120x17408, where call 21 had er 1-3 % slower than main at
# 8 of 10 points, timed again in alternation (main, er, main, er), with er's tuner choices logged.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?}"
R=$OUT/c22; mkdir -p "$R"
i=0
for e in main er main er; do
  i=$((i + 1))
  VLLM_EXL3_LOG_PLANS=1 timeout 60 python3 scripts/bench/bench_linear.py --ext .s12/$e.so --no-exl3 \
    --bits 4 --codebooks 1 2 --m 1 2 4 8 16 --shapes 5120x17408 4096x4096 --out "$R" \
    --tag r${i}_$e > "$R/bench_r${i}_$e.log" 2>&1
  echo "== r$i $e rc=$?"
done
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def rows(tag):
    data = json.loads(sorted(d.glob(f"{tag}_*.json"))[-1].read_text())
    return {(r["k"], r["n"], r["codebook"], r["m"]): r["ours_us"] for r in data["rows"]}
t = {tag: rows(tag) for tag in ("r1_main", "r2_er", "r3_main", "r4_er")}
rs = []
for key in sorted(t["r1_main"]):
    a = min(t["r1_main"][key], t["r3_main"][key]); b = min(t["r2_er"][key], t["r4_er"][key])
    rs.append(b / a)
    print(f"{key[0]}x{key[1]} cb{key[2]} m={key[3]:2d}: main {t['r1_main'][key]:5.1f} {t['r3_main'][key]:5.1f}"
          f"  er {t['r2_er'][key]:5.1f} {t['r4_er'][key]:5.1f}  best er/main {b / a:.3f}")
print(f"geomean {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)}")
PY
grep -h "early=" "$R"/bench_r4_er.log | awk '{print $3,$4,$5}' | sort | uniq -c | head -5
tar czf "$OUT/call22.tgz" -C "$R" .
