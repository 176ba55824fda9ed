# Session 8, call 4 (branch wg-streamk): tuned A/B of main.so and sk.so, 4-bit and 6-bit 3INST
# and MUL1, five shapes, m 128 256 512, alternated twice; then wait for ExLlamaV3's build.
set -u; export PYTHONUNBUFFERED=1; exec > >(tee -a $OUT/call4.log) 2>&1
for r in 1 2; do for v in main sk; do echo "== $v r$r $SECONDS s"
timeout 100 python3 scripts/bench/bench_linear.py --ext .s8/$v.so --no-exl3 --out $OUT --tag ab8c_${v}_r$r --bits 4 6 --codebooks 0 2 --m 128 256 512 --budget-s 90 2>&1 | grep -E "^ *[0-9]+x"
done; done
python3 scripts/bench/exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 330 | head -3; echo "== $SECONDS s"
cd $OUT && tar czf call4_files.tgz --exclude=call4_files.tgz --exclude=call4.log ./* ; find . -maxdepth 1 -type f ! -name call4_files.tgz ! -name call4.log -delete
