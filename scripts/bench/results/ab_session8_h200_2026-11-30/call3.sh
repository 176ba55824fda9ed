# Session 8, call 3 (branch wg-streamk): pinned cold sweep on sk.so, four classic k-splits
# against the stream-k grid, BM 128 at m = 128 and BM 256 at m = 256-1024, five shapes, 4-bit
# MCG, twice.
set -u; export PYTHONUNBUFFERED=1; exec > >(tee -a $OUT/call3.log) 2>&1
CFG=()
for sh in "5120 12288" "5120 17408" "17408 5120" "4096 4096" "4096 11008"; do
  for m in 128; do for s in 1 2 3 4 sk; do CFG+=("$sh 4 1 $m 128 $s 1"); done; done
  for m in 256 512 1024; do for s in 1 2 3 4 sk; do CFG+=("$sh 4 1 $m 256 $s 1"); done; done
done
for r in 1 2; do timeout 200 python3 scripts/bench/pin.py .s8/sk.so sweep_r$r "${CFG[@]}"; done
python3 scripts/bench/exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 5 | head -3
