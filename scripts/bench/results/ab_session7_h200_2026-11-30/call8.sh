# Session 7, call 8: the current kernels (rb.so = ea60c72's csrc, main's), tuned cold benchmark
# against bf16 torch.matmul in the same run, 4-bit, all three codebooks, five shapes, every m
# (bench_linear.py with LIGHT_M = 256: points up to m = 256 start from 0.25 s of idle).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >(tee -a "$OUT/call8.log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python3 scripts/bench/bench_linear.py --ext .s7/rb.so --no-exl3 --out $OUT \
  --tag current_rb --bits 4 --codebooks 0 1 2 2>$OUT/call8.err | grep -E "^wrote|^ *[0-9]+x"
echo "== $(( $(date +%s) - T0 )) s: call8 done"
