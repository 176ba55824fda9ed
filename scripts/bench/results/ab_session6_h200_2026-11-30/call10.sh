# Session 6, call 10: where the wgmma engine's warps stall (ncu warp-state sampling by SASS
# instruction), 5120x12288 4-bit MCG, m = 1024, BM 256, final.so.
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/call10.log") 2>&1
VLLM_EXL3_WGMMA=1 timeout 200 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
  --section WarpStateStats --section SourceCounters --import-source no -o $OUT/wg256 \
  python3 scripts/bench/ncu_probe.py 4 1 1024 --k 5120 --n 12288 --bm 256 --split 1 --ext .s6/final.so 2>&1 | tail -3
ncu -i $OUT/wg256.ncu-rep --page details --print-details all 2>&1 | grep -v "^\s*$" | head -120
ncu -i $OUT/wg256.ncu-rep --page source --csv --print-source sass 2>/dev/null > $OUT/wg256_sass.csv; wc -l $OUT/wg256_sass.csv
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/wg256_sass.csv")))
hdr = rows[0]; print(hdr[:12])
idx = {h: i for i, h in enumerate(hdr)}
key = next((h for h in hdr if "Warp Stall Sampling (All" in h), None)
src = next((h for h in hdr if h in ("Source", "SASS")), hdr[1])
if key:
    body = [r for r in rows[1:] if len(r) > idx[key] and r[idx[key]].replace('.', '').isdigit()]
    body.sort(key=lambda r: -float(r[idx[key]]))
    tot = sum(float(r[idx[key]]) for r in body)
    for r in body[:40]:
        print(f"{float(r[idx[key]])/tot*100:5.1f}%  {r[idx[src]][:90]}")
PY
cd $OUT && tar czf call10_files.tgz --exclude=call10_files.tgz --exclude=call10.log ./* && find . -maxdepth 1 -type f ! -name call10_files.tgz ! -name call10.log -delete
