#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GPU record (issues 3 and 4) on one nvidia-h200-x2 lease, after the bundle's staging
# calls (.e2e/calls.md). The two GPUs work side by side so the session's 30 device-minutes cover it:
#   tp1    GPU 0: run_fixture_e2e.py (TP=1: perplexity, eager vs defaults, vllm serve)
#          GPU 1: scripts/bench/next_session.sh call1 (verify, memcheck, SASS/ncu, our cold
#                 benchmark) on the bundle's own _exl3_C; starts ExLlamaV3's build (background)
#   tp2    GPUs 0+1: run_fixture_e2e.py --tp 2 against the TP=1 JSON of `tp1`
#   final  GPU 0: throughput.py (synthetic qwen3-8b 4 bpw vs bf16)
#          GPU 1: next_session.sh call2 (same-run ExLlamaV3 anchor)
# Run from the repository root after `. /tmp/vx/site/vllm-exl3-env.sh`. DEADLINE (epoch seconds,
# default now + 540) bounds every job; $OUT is packed into one archive at the end, because the
# tool returns at most 8 files.
set -u
phase=${1:?usage: x2_session.sh tp1|tp2|final}
: "${OUT:?OUT must be set}"
DEADLINE=${DEADLINE:-$(( $(date +%s) + 540 ))}
# Seconds kept for packing $OUT and the tool's copy back.
PACK_S=25
HOST=/tmp/vx
EXT_INSTALLED=$HOST/site/vllm/_exl3_C.abi3.so
export PYTHONUNBUFFERED=1
left() { echo $(( DEADLINE - PACK_S - $(date +%s) )); }

# The kernel scripts need torch alone: keep the bundle's site-packages (its pydantic among them)
# off their path so ExLlamaV3 imports the versions it was installed with.
kernels() {
  local phase=$1 gpu=$2
  mkdir -p "$OUT/kernels"
  # The commit the kernels were built from, from the installed wheel's version (0.26.0+exl3.<hash>).
  local commit
  commit=$(python3 -c "import importlib.metadata as m; print(m.version('vllm').rpartition('exl3.')[2])" 2>/dev/null)
  timeout "$(left)" env -u PYTHONPATH CUDA_VISIBLE_DEVICES="$gpu" OUT="$OUT/kernels" \
    EXT="$EXT_INSTALLED" CALL_LIMIT_S="$(left)" EXL3_JOBS="${EXL3_JOBS:-20}" EXL3_COMMIT="$commit" \
    bash scripts/bench/next_session.sh "$phase" > /dev/null 2>&1
}

pack() {
  wait
  local tgz=/tmp/x2_${phase}_$$.tgz
  tar -C "$OUT" -czf "$tgz" . && find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/$phase.tgz"
  ls -la "$OUT"
}

case "$phase" in
tp1)
  kernels call1 1 &
  mkdir -p "$OUT/e2e"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 scripts/e2e/run_fixture_e2e.py \
    --out "$OUT/e2e" --budget-s $(( $(left) - 30 )) 2>&1 | tee "$OUT/e2e/fixture_e2e.log"
  echo "== waiting for the kernel job (GPU 1)"; wait
  tail -40 "$OUT/kernels/call1.log"
  ;;
tp2)
  mkdir -p "$OUT/e2e"
  timeout "$(left)" python3 scripts/e2e/run_fixture_e2e.py --tp 2 --out "$OUT/e2e" \
    --baseline "$HOST/e2e/fixture_e2e.json" --budget-s $(( $(left) - 30 )) 2>&1 | \
    tee "$OUT/e2e/fixture_e2e_tp2.log"
  ;;
final)
  kernels call2 1 &
  mkdir -p "$OUT/e2e"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 scripts/e2e/throughput.py --out "$OUT/e2e" \
    --budget-s $(( $(left) - 30 )) 2>&1 | tee "$OUT/e2e/throughput.log"
  echo "== waiting for the kernel job (GPU 1)"; wait
  tail -40 "$OUT/kernels/call2.log"
  ;;
*)
  echo "unknown phase $phase (tp1 | tp2 | final)"; exit 2 ;;
esac
pack
