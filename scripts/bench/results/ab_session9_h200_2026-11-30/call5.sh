# Session 9, call 5: the two m = 1 points still behind ExLlamaV3's int8 GEMV in call 4
# (5120x17408 MUL1, 3- and 5-bit). Which plan the tuner picks (VLLM_EXL3_LOG_PLANS=1, tuned and
# timed cold by bench_linear), then every k-split pinned cold at BM 16 (pin.py, two rounds).
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/call5.log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
VLLM_EXL3_LOG_PLANS=1 timeout 100 python3 scripts/bench/bench_linear.py --ext .s9/main.so --no-exl3 \
  --out "$OUT" --tag tuned_m1 --shapes 5120x17408 --bits 3 5 --codebooks 2 --m 1 2>&1 | \
  grep -vE "^\s*$" | tail -40
CFG=()
for b in 3 5; do for s in 1 2 3 4 5 6 8 10 16 20; do CFG+=("5120 17408 $b 2 1 16 $s 0"); done; done
for round in 1 2; do
  timeout 120 python3 scripts/bench/pin.py .s9/main.so m1_r$round "${CFG[@]}"
done
cd "$OUT" && tar czf call5_files.tgz --exclude=call5_files.tgz --exclude=call5.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call5_files.tgz ! -name call5.log -delete; ls
