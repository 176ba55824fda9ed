# Session 8, call 2 (branch wg-streamk checked out, machine kept warm while ExLlamaV3 builds):
# tuned A/B of main.so and sk.so, 4-bit MCG, five shapes, m 128 512 1024, alternated twice.
set -u; export PYTHONUNBUFFERED=1; exec > >(tee -a $OUT/call2.log) 2>&1
for r in 1 2; do for v in main sk; do echo "== $v r$r $SECONDS s"
timeout 140 python3 scripts/bench/bench_linear.py --ext .s8/$v.so --no-exl3 --out $OUT --tag ab8b_${v}_r$r --bits 4 --codebooks 1 --m 128 512 1024 --budget-s 120 2>&1 | grep -vE "^\s*$" | tail -22
done; done
python3 scripts/bench/exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 5 | head -3
cd $OUT && tar czf call2_files.tgz --exclude=call2_files.tgz --exclude=call2.log ./* ; find . -maxdepth 1 -type f ! -name call2_files.tgz ! -name call2.log -delete
