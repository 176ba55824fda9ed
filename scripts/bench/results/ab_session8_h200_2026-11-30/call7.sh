# Session 8, call 7 (main 4f788b0: the stream-k grid merged; .s8/final.so is its quick build,
# SASS byte-identical to sk2.so of call 6): tuned cold benchmark against bf16 torch.matmul in the
# same run, 4-bit, all three codebooks, five shapes, every m (pct_sol from sass_loop.py on the
# same build, made before the call: .s8/sass.json). Then why 2-bit at m = 4096 ran 6-10 %
# slower than 4-bit in the anchor (call 5): the tuner's timed candidates and a pinned A/B of the
# reconstruct path (bm 0) and the fused BM 256 path at 2 and 4 bits.
set -u; export PYTHONUNBUFFERED=1; exec > >(tee -a $OUT/call7.log) 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 240 python3 scripts/bench/bench_linear.py --ext .s8/final.so --no-exl3 --out $OUT \
  --tag bench_ours --sass-json .s8/sass.json --bits 4 --codebooks 0 1 2 2>$OUT/bench.err | grep -E "^wrote|^ *[0-9]+x"
echo "== plans $SECONDS s"
VLLM_EXL3_LOG_PLANS=1 timeout 90 python3 scripts/bench/bench_linear.py --ext .s8/final.so --no-exl3 \
  --out $OUT --tag plans4096 --bits 2 4 --codebooks 1 --m 4096 --shapes 17408x5120 5120x17408 2>&1 | grep -E "exl3 plan|^ *[0-9]+x"
echo "== pinned $SECONDS s"
CFG=()
for b in 2 4; do CFG+=("17408 5120 $b 1 4096 0 0 0" "17408 5120 $b 1 4096 256 1 1"); done
for r in 1 2; do timeout 100 python3 scripts/bench/pin.py .s8/final.so p4096_r$r "${CFG[@]}"; done
echo "== done $SECONDS s"
cd $OUT && tar czf call7_files.tgz --exclude=call7_files.tgz --exclude=call7.log ./* ; find . -maxdepth 1 -type f ! -name call7_files.tgz ! -name call7.log -delete
