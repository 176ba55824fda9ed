# Session 6, call 7 (as run, one command line): while ExLlamaV3 builds (started in call 6), a tuned
# A/B of base.so (d46a0e8's kernels) vs final.so (wgmma engine), 4-bit MCG+MUL1, five shapes,
# m 32..1024, bf16 in the same run.
set -u; OUT=$OUT; exec > >(tee -a $OUT/call7.log) 2>&1
for v in base final; do e=.s6/$v.so; echo "== $v $SECONDS s"; timeout 170 python3 scripts/bench/bench_linear.py --ext $e --no-exl3 --out $OUT --tag ab6_${v} --bits 4 --codebooks 1 2 --m 32 64 128 256 512 1024 2>/dev/null | grep -E "^ *[0-9]+x"; done
python3 scripts/bench/exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 150 | head -3; echo "== done $SECONDS s"
