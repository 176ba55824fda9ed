#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 1: branch sk-store (split-k's first contributor to a tile stores, the rest
# add after its "stored" flag; the finish kernel reads the sums and resets the tile tickets, no
# re-zeroing). .s20/sk.so = the branch. Carries .whl: ExLlamaV3 1.6.5's JIT build starts in the
# background first (for call 3's anchor), on 12 of the 16 cores.
# 1) checks.sh on sk (verify, tests/gpu, memcheck, racecheck);
# 2) the finish kernel's DRAM bytes and L2 hit rate under ncu (finish_l2_call.sh) on sk.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1
STATE=/tmp/exl3_next
mkdir -p "$STATE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$STATE/site" .whl/*.whl && python3 scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs 12
bash scripts/bench/checks.sh .s20/sk.so sk 2>&1 | grep -E "^==|ALL|FAIL|passed|failed|exit|ERROR|rror" | head -40
bash scripts/bench/finish_l2_call.sh .s20/sk.so 2>&1 | tee "$OUT/finish_l2_sk.log"
