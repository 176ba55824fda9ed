#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch recon-unroll's first GPU call: the original-basis reconstruct's trellis copies and
# output stores unrolled over compile-time counts (the strided loops compiled to generic loops
# with remainder loops and signed divisions). Run from the repository root with .s11 carried:
# .s11/main.so (main's quick build) and .s11/ru.so (this branch's). 1) the full checks of ru.so;
# 2) a pinned cold A/B of the reconstruct + cuBLAS path (bm 0), main / ru alternating, two
# rounds, m = 1024, 2048, 4096. Everything lands in $OUT/recon_call.tgz; about 4 minutes.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
R=$OUT/r
mkdir -p "$R"
OUT=$R bash scripts/bench/checks.sh .s11/ru.so ru 2>&1 | grep -v "^$" | tail -24
CFG=()
for sh in "4096 4096" "4096 11008" "5120 12288" "5120 17408" "17408 5120"; do
  for m in 1024 2048 4096; do CFG+=("$sh 4 1 $m 0 1 0"); done
done
CFG+=("5120 17408 6 1 1024 0 1 0" "5120 17408 6 1 4096 0 1 0" "5120 17408 3 2 1024 0 1 0"
      "5120 17408 2 0 4096 0 1 0")
for round in 1 2; do
  for e in main ru; do
    OUT=$R timeout 150 python3 scripts/bench/pin.py .s11/$e.so ${e}_r$round "${CFG[@]}"
  done
done > "$R/pinned.log" 2>&1
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def best(e):
    t = {}
    for r in (1, 2):
        for row in json.loads((d / f"pin_{e}_r{r}.json").read_text()):
            key = (row["k"], row["n"], row["bits"], row["cb"], row["m"])
            t[key] = min(t.get(key, 1e9), row["us"])
    return t
a, b = best("main"), best("ru")
rs = []
for key in sorted(a):
    r = b[key] / a[key]
    rs.append(r)
    print(f"{key[0]}x{key[1]} b{key[2]} cb{key[3]} m={key[4]:5d}: main {a[key]:8.1f}  ru {b[key]:8.1f} us  {r:.3f}")
print(f"ru / main geomean {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)}")
PY
tar czf "$OUT/recon_call.tgz" -C "$R" .
