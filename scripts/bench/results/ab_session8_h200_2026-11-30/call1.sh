# Session 8, call 1 (run on branch wg-streamk, rebased on main 8aaf6ea as a138990): start
# ExLlamaV3's JIT build for call 2's anchor, then the branch's first GPU call
# (scripts/bench/streamk_call.sh: full checks of sk.so + pinned A/B against main.so), then a tuned
# A/B (the autotuner picks; sk.so may pick the stream-k grid) of both builds, 4-bit MCG, five
# shapes, m 64..1024, bf16 in the same run.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >(tee -a "$OUT/call1.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
S=/tmp/exl3_next
mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site .whl/*.whl
python3 scripts/bench/exllamav3_anchor.py build --state $S --jobs 12
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
log "streamk_call"
bash scripts/bench/streamk_call.sh
for v in main sk; do
  log "tuned $v"
  timeout 110 python3 scripts/bench/bench_linear.py --ext .s8/$v.so --no-exl3 --out $OUT --tag ab8_$v \
    --bits 4 --codebooks 1 --m 64 128 256 512 1024 --budget-s 95 2>/dev/null | grep -E "^ *[0-9]+x"
done
log "call1 done"; ls $S
cd "$OUT" && tar czf call1_files.tgz --exclude=call1_files.tgz --exclude=call1.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call1_files.tgz ! -name call1.log -delete; ls
