# Session 9, call 7: branch wg-ws2's first GPU call (3d7f003-based build, -DEXL3_WS_BM256=1):
# the warp-specialized BM 256 tier with two producer warpgroups, stmatrix stores and setmaxnreg
# (ws2.so), against main.so. verify (full matrix) and a memcheck sample of ws2.so, then a pinned
# cold A/B at BM 256, two alternating rounds.
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/call7.log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 60 python3 scripts/bench/verify_kernels.py --ext .s9/ws2.so --json "$OUT/verify_ws2.json" 2>&1 | tail -12
rc=${PIPESTATUS[0]}; echo "verify exit $rc"
if [ "$rc" != 0 ]; then  # a failing or hanging build is not timed
  cd "$OUT" && tar czf call7_files.tgz --exclude=call7_files.tgz --exclude=call7.log ./*; exit 0
fi
timeout 60 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  python3 scripts/bench/verify_kernels.py --ext .s9/ws2.so --sample 2>&1 | tail -2
CFG=()
for sh in "5120 12288" "5120 17408" "17408 5120" "4096 4096" "4096 11008"; do
  for m in 256 1024; do CFG+=("$sh 4 1 $m 256 1 1"); done
done
CFG+=("5120 12288 4 1 4096 256 1 1" "5120 17408 4 1 256 256 sk 1" "5120 12288 6 1 1024 256 1 1" "5120 12288 2 2 1024 256 2 1")
for round in 1 2; do
  for e in main ws2; do
    timeout 70 python3 scripts/bench/pin.py .s9/$e.so ${e}_r$round "${CFG[@]}"
  done
done 2>&1 | tee "$OUT/ws2_pinned.log" | grep -v "^$"
cd "$OUT" && tar czf call7_files.tgz --exclude=call7_files.tgz --exclude=call7.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call7_files.tgz ! -name call7.log -delete; ls
