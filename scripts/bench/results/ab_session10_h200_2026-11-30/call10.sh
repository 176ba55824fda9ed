#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Branch cluster-k's first GPU call: the k-splits of a tile as one thread-block cluster, summed
# through distributed shared memory with the epilogue in the GEMM (no workspace atomics, no
# finish kernel). Run from the repository root with .s11 carried: .s11/main.so (main's quick
# build) and .s11/ck.so (this branch's). 1) the full checks with VLLM_EXL3_CLUSTER=1, so every
# split plan that fits runs as a cluster; 2) a pinned cold A/B of main's split-k against the
# cluster form at m = 1, 16 (BM 16) and 64 (wgmma BM 64) over splits 4 / 8 / 16, two rounds;
# 3) a tuned A/B (the tuner times both forms) at m = 1-64 with bf16 in the same run.
# Everything lands in $OUT/cluster_call.tgz; about 5-6 minutes.
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must be set}"
R=$OUT/r
mkdir -p "$R"
VLLM_EXL3_CLUSTER=1 OUT=$R bash scripts/bench/checks.sh .s11/ck.so ck_cluster 2>&1 | grep -v "^$" | tail -30
CFG=()
for sh in "4096 4096" "4096 11008" "5120 12288" "5120 17408" "17408 5120"; do
  for s in 4 8 16; do
    CFG+=("$sh 4 1 1 16 $s 0" "$sh 4 1 16 16 $s 0" "$sh 4 1 64 64 $s 1")
  done
done
for round in 1 2; do
  OUT=$R timeout 120 python3 scripts/bench/pin.py .s11/main.so main_r$round "${CFG[@]}"
  OUT=$R VLLM_EXL3_CLUSTER=1 timeout 120 python3 scripts/bench/pin.py .s11/ck.so ck_r$round "${CFG[@]}"
done > "$R/pinned.log" 2>&1
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def best(e):
    t = {}
    for r in (1, 2):
        for row in json.loads((d / f"pin_{e}_r{r}.json").read_text()):
            key = (row["k"], row["n"], row["m"], row["split"])
            t[key] = min(t.get(key, 1e9), row["us"])
    return t
m, c = best("main"), best("ck")
ratios = []
for key in sorted(m):
    r = c[key] / m[key]
    ratios.append(r)
    print(f"{key[0]}x{key[1]} m={key[2]:3d} split={key[3]:>2}: main {m[key]:7.1f}  cluster {c[key]:7.1f} us  {r:.3f}")
print(f"cluster / main geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
PY
for e in main ck; do
  timeout 100 python3 scripts/bench/bench_linear.py --ext .s11/$e.so --no-exl3 --out "$R" \
    --tag cluster_tuned_$e --bits 4 --codebooks 1 2 --m 1 4 16 32 64 --budget-s 75 \
    > "$R/tuned_$e.log" 2>&1
done
python3 - "$R" <<'PY'
import json, math, sys
from pathlib import Path
d = Path(sys.argv[1])
def rows(e):
    f = sorted(d.glob(f"cluster_tuned_{e}_*.json"))[-1]
    data = json.loads(f.read_text())
    return {(r["k"], r["n"], r["codebook"], r["m"]): r for r in data["rows"]}
a, b = rows("main"), rows("ck")
rs = {}
for key in sorted(a):
    if key in b:
        r = b[key]["ours_us"] / a[key]["ours_us"]
        rs.setdefault(key[3], []).append(r)
        print(f"{key[0]}x{key[1]} cb{key[2]} m={key[3]:3d}: main {a[key]['ours_us']:6.1f} "
              f"({a[key]['ours_us'] / a[key]['bf16_us']:.2f} bf16)  ck {b[key]['ours_us']:6.1f} "
              f"({b[key]['ours_us'] / b[key]['bf16_us']:.2f} bf16)  {r:.3f}")
for m, v in sorted(rs.items()):
    print(f"m={m}: ck / main geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f} over {len(v)}")
PY
tar czf "$OUT/cluster_call.tgz" -C "$R" .
