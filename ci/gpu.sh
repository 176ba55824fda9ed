#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU CI entry: on a CUDA host where the built wheel is installed (`pip install
# dist/<wheel>`, or the offline bundle's install.sh followed by `source <site>/vllm-exl3-env.sh`),
# run from the repository root:
#
#   ci/gpu.sh [--out DIR] [STEP ...]
#
# Steps, in order (all of them when none is named):
#   tests       pytest -m gpu tests (the kernel oracle and the GPU unit tests)
#   kernels     ci/gpu_kernels.sh, when the checkout has it
#   e2e         scripts/e2e/run_fixture_e2e.py (fixture perplexity, eager vs graphs, vllm serve)
#   throughput  scripts/e2e/throughput.py (synthetic Qwen3-8B dimensions, EXL3 vs bf16)
#   bench       scripts/bench/bench_linear.py --no-exl3 --bits 4 (the op against bf16)
#
# Everything goes to the results folder ($OUT, or --out DIR, else ./gpu-results): one log per
# step, each script's JSON, and summary.txt (step, exit status, seconds). Each step runs under
# its own time limit (GPU_STEP_S, default 540 s) so that one step fits a 10-minute slot; the
# scripts that can stop early are told to stop a minute before it. The exit status is nonzero
# when any step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS=(tests kernels e2e throughput bench)
OUT_DIR=${OUT:-gpu-results}
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=${2:?--out needs a directory}; shift 2 ;;
    -h|--help) sed -n '3,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *)
      if [[ " ${ALL_STEPS[*]} " != *" $1 "* ]]; then
        echo "gpu.sh: unknown step '$1' (steps: ${ALL_STEPS[*]})" >&2; exit 2
      fi
      steps+=("$1"); shift ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=("${ALL_STEPS[@]}")

PY=${PYTHON:-python3}
STEP_S=${GPU_STEP_S:-540}
# What a script that honours --budget-s leaves for writing its results before the hard limit.
MARGIN_S=60
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export OUT=$OUT_DIR

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu.sh: $PY sees no CUDA device (torch.cuda.is_available() is False)" >&2
  exit 1
fi

run_step() {
  local step=$1
  local budget=$(( STEP_S - MARGIN_S ))
  case "$step" in
    tests) "$PY" -m pytest -q -ra -m gpu -p no:cacheprovider tests ;;
    kernels)
      if [ -f ci/gpu_kernels.sh ]; then bash ci/gpu_kernels.sh
      else echo "ci/gpu_kernels.sh is not in this checkout: nothing to run"; fi ;;
    e2e) "$PY" scripts/e2e/run_fixture_e2e.py --out "$OUT_DIR/e2e" --budget-s "$budget" ;;
    throughput) "$PY" scripts/e2e/throughput.py --out "$OUT_DIR/throughput" --budget-s "$budget" ;;
    bench) "$PY" scripts/bench/bench_linear.py --out "$OUT_DIR/bench" --no-exl3 --bits 4 \
             --budget-s "$budget" ;;
  esac
}

failed=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  echo "== gpu.sh: $step (limit ${STEP_S} s)"
  # run_step is a shell function: timeout runs it through a child bash that sees it.
  export -f run_step
  export PY OUT_DIR STEP_S MARGIN_S
  timeout --kill-after=15 "$STEP_S" bash -c "run_step $step" 2>&1 | tee "$OUT_DIR/$step.log"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - t0 ))
  [ "$rc" -eq 124 ] && echo "gpu.sh: $step ran out of its ${STEP_S} s" | tee -a "$OUT_DIR/$step.log"
  printf '%-10s rc=%-3s %5ss\n' "$step" "$rc" "$secs" | tee -a "$OUT_DIR/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
done
echo "gpu.sh: results in $OUT_DIR"
exit $failed
