#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Session 16, call 4 (fresh machine): the rest of call 3's anchor on main's kernels
# (.s19/base.so). Call 3's run stopped at its time budget before 4096x11008 at 3 and 5 bits.
# 1) ExLlamaV3 1.6.5's JIT build in the background (16 jobs); meanwhile, on the GPU, ours
#    against bf16 in alternation at m = 1024-4096 (interleaved.py, 4-bit MCG, five shapes) and
#    the SASS loop counts for bench_linear's speed-of-light column;
# 2) once built: the same-run anchor at 4096x11008, bits 3 and 5, all codebooks, all m.
set -u
: "${OUT:?}"
export PYTHONUNBUFFERED=1 EXL3_COMMIT=5e7a445
S=/tmp/exl3_next
mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target $S/site .whl/*.whl && python3 scripts/bench/exllamav3_anchor.py build --state $S --jobs 16
timeout 60 python3 scripts/bench/sass_loop.py .s19/base.so --json $S/sass.json > /dev/null
timeout 240 python3 scripts/bench/interleaved.py --ext .s19/base.so --m 1024 2048 4096 \
  --json "$OUT/interleaved_base.json" 2>&1 | grep -v -i warn | tail -20
python3 scripts/bench/exllamav3_anchor.py wait --state $S --timeout 400 | head -3
timeout 150 python3 scripts/bench/bench_linear.py --ext .s19/base.so --out "$OUT" \
  --tag bench_anchor_rest --exl3-state $S --exl3-wait-s 30 --exl3-import-timeout-s 90 \
  --bits 3 5 --codebooks 0 1 2 --shapes 4096x11008 --sass-json $S/sass.json | grep -E "^ *[0-9]+x"
