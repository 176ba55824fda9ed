# Session 9, call 2: branch wg-ws's first GPU call (ws_call.sh from e3ddbc7, carried in .s9):
# full checks of ws.so (e3ddbc7 built with -DEXL3_WS_BM256=1), pinned cold A/B of the BM 256
# tier against main.so, tuned A/B. ExLlamaV3 keeps building beside it.
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/call2.log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
OUT=$OUT timeout 560 bash .s9/ws_call.sh
python3 scripts/bench/exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 1
cd "$OUT" && tar czf call2_files.tgz --exclude=call2_files.tgz --exclude=call2.log ./* 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call2_files.tgz ! -name call2.log -delete; ls
