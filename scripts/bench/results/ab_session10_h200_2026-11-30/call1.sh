#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch wg-ws2's first GPU call at its head (kWsAhead = 2; session 9 ran the earlier forms, see
# results/ab_session9_h200_2026-11-30 §6): verify, then a pinned cold round against main at
# BM 256 on §6's points; if it is faster anywhere, the full checks. Run from the repository
# root with .s10ws carried: .s10ws/ws4.so (this branch's quick build with -DEXL3_WS_BM256=1
# added to kernels_build.DEFINES) and .s10ws/main.so. Logs and JSON under $OUT; ~2-4 minutes.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s10ws/ws4.so \
  --json "$OUT/verify_ws4.json" 2>&1 | tail -12
[ "${PIPESTATUS[0]}" = 0 ] || exit 1  # a failing or hanging build is not timed
CFG=()
for sh in "5120 12288" "5120 17408" "17408 5120" "4096 4096" "4096 11008"; do
  for m in 256 1024; do CFG+=("$sh 4 1 $m 256 1 1"); done
done
CFG+=("5120 12288 4 1 4096 256 1 1" "5120 17408 4 1 256 256 sk 1")
for round in 1 2; do
  for e in main ws4; do
    timeout 70 python3 scripts/bench/pin.py .s10ws/$e.so ${e}_r$round "${CFG[@]}"
  done
done 2>&1 | tee "$OUT/ws4_pinned.log" | grep -v "^$"
python3 - "$OUT" <<'PY' && bash scripts/bench/checks.sh .s10ws/ws4.so ws4
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def best(e):
    t = {}
    for r in (1, 2):
        for row in json.loads((out / f"pin_{e}_r{r}.json").read_text()):
            key = " ".join(str(row[f]) for f in ("k", "n", "bits", "cb", "m", "bm", "split"))
            t[key] = min(t.get(key, 1e9), row["us"])
    return t
m, w = best("main"), best("ws4")
ratios = {k: w[k] / m[k] for k in m if k in w}
for k, r in sorted(ratios.items(), key=lambda kv: kv[1]):
    print(f"{k}: ws4 / main {r:.3f}")
sys.exit(0 if min(ratios.values()) < 1.0 else 1)
PY
