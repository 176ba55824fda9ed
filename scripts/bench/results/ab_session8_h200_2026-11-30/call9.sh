# Session 8, call 9 (branch small-m-splits, even.so: main 4f788b0 + the tuner's even k-split
# candidates below m = 17; SASS byte-identical to final.so): verify (full) and tests/gpu of
# even.so, then a tuned A/B of final.so (main) against even.so, 4-bit, three codebooks, five
# shapes, m = 1-16, alternated twice, and 3- and 5-bit MUL1 at m = 1 (ExLlamaV3's int8 GEMV
# points), bf16 in the same run.
set -u; export PYTHONUNBUFFERED=1; exec > >(tee -a $OUT/call9.log) 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s8/even.so --json $OUT/verify_even.json 2>&1 | tail -10
VLLM_EXL3_EXT=.s8/even.so timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
for r in 1 2; do for v in final even; do echo "== $v r$r $SECONDS s"
timeout 70 python3 scripts/bench/bench_linear.py --ext .s8/$v.so --no-exl3 --out $OUT --tag small_${v}_r$r --bits 4 --codebooks 0 1 2 --m 1 2 4 8 16 --budget-s 60 2>/dev/null | grep -E "^wrote"
timeout 30 python3 scripts/bench/bench_linear.py --ext .s8/$v.so --no-exl3 --out $OUT --tag mul1_${v}_r$r --bits 3 5 --codebooks 2 --m 1 --budget-s 25 2>/dev/null | grep -E "^wrote"
done; done
echo "== done $SECONDS s"
cd $OUT && tar czf call9_files.tgz --exclude=call9_files.tgz --exclude=call9.log ./* ; find . -maxdepth 1 -type f ! -name call9_files.tgz ! -name call9.log -delete
