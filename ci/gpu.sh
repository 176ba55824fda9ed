#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU CI entry: on a CUDA host where the built wheel is installed (`pip install
# dist/<wheel>`, or the offline bundle's install.sh followed by `source <site>/vllm-exl3-env.sh`),
# run from the repository root:
#
#   ci/gpu.sh [--out DIR] [STEP ...]
#
# Steps, in order (all of them when none is named):
#   tests       pytest -m gpu overlay/tests (the kernel oracle and the GPU unit tests), less
#               the two files that import vLLM's own test helpers (the harness step runs them)
#   kernels     build the standalone extension for ARCH (default 9.0; VLLM_EXL3_EXT names one
#               built beforehand; none where the installed vLLM's own _C_stable_libtorch
#               registers the ops: `build --from-source --only target`), then the GPU kernel
#               tests, two processes' plan logs (must match), compute-sanitizer on the
#               oracle's, the MoE kernels' and the sparse-MLA decode's samples, and the plan
#               tuner
#   e2e         scripts/e2e/run_fixture_e2e.py (fixture perplexity, eager vs graphs, vllm serve)
#   throughput  scripts/e2e/throughput.py (synthetic Qwen3-8B dimensions, EXL3 vs bf16)
#   bench       scripts/bench/bench_linear.py --no-exl3 --bits 4 (the op against bf16)
#   moebench    scripts/bench/bench_moe.py --bits 4 on the four layer shapes of the MoE record
#               (one MoE layer against bf16, int4 Marlin and, when EXL3_ANCHOR_STATE names a
#               finished exllamav3_anchor.py build, ExLlamaV3's own block)
#   sparsebench  scripts/bench/bench_sparse_mla.py (sparse-MLA decode against FlashMLA-sparse)
#   moe         scripts/e2e/run_moe_e2e.py on the MoE fixture conversions staged in
#               VLLM_EXL3_MOE_DIR by scripts/e2e/stage_fixtures.sh (perplexity, eager vs graphs)
#   mtp         scripts/e2e/run_mtp_e2e.py, both MTP layouts (speculation against plain decoding)
#   qwen35      scripts/e2e/run_qwen3_5_e2e.py --stages ppl mtp on the Qwen3.5 fixtures (perplexity
#               against ExLlamaV3's, the stored MTP layer's speculation); the agreement, image
#               and serve stages take longer than a step: run them with the script's --stages
#   sparse      scripts/e2e/run_sparse_mla_e2e.py --resume (EXL3_MLA_SPARSE vs FLASHMLA_SPARSE;
#               its runs stay in .e2e/sparse-mla, so repeating the step completes the table)
#   harness     ci/test_vllm_harness.sh, GPU part included (vLLM's own harness on our test files;
#               needs VLLM_EXL3_HARNESS_PACK, the pack `ci/test_vllm_harness.sh --pack` wrote)
#   serve       scripts/e2e/serve_bench.py --resume: `vllm serve` + `vllm bench serve`, 8k in /
#               1k out, EXL3 vs GPTQ int4 vs FP8 vs bf16 at concurrency 1-64, both presets, and
#               the same load on ExLlamaV3's own generator when EXL3_ANCHOR_STATE names a
#               finished exllamav3_anchor.py build; its rows stay in .e2e/serve, so repeating
#               the step completes the table
#   soak        scripts/e2e/serve_bench.py --soak: ten minutes of the EXL3 MoE server under
#               cancelling clients, started detached (it outlives the step); repeat the step
#               to collect its verdicts (remove .e2e/serve-soak to soak again)
#
# Everything goes to the results folder ($OUT, or --out DIR, else ./gpu-results): one log per
# step, each script's JSON, and summary.txt (step, exit status, seconds). Each step runs under
# its own time limit (GPU_STEP_S, default 540 s) so that one step fits a 10-minute slot; the
# scripts that can stop early are told to stop a minute before it. The exit status is nonzero
# when any step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS=(tests kernels e2e throughput bench moebench sparsebench moe mtp qwen35 sparse harness serve
  soak)
OUT_DIR=${OUT:-gpu-results}
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=${2:?--out needs a directory}; shift 2 ;;
    -h|--help) sed -n '3,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *)
      if [[ " ${ALL_STEPS[*]} " != *" $1 "* ]]; then
        echo "gpu.sh: unknown step '$1' (steps: ${ALL_STEPS[*]})" >&2; exit 2
      fi
      steps+=("$1"); shift ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=("${ALL_STEPS[@]}")

PY=${PYTHON:-python3}
# The overlay's test files that import vLLM's own test helpers (tests.models.utils,
# tests.kernels.utils): they run only inside vLLM's tree, in the harness step.
HARNESS_ONLY="--ignore=overlay/tests/quantization/test_exl3.py
  --ignore=overlay/tests/kernels/quantization/test_exl3_ops.py"
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
# The tool's package (vllm_exl3.testing, .bench, .e2e), editable from this checkout: the
# tests and scripts import it by name. Offline: setuptools is all it needs.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  --config-settings editable_mode=strict 2>/dev/null ||
  { echo "gpu.sh: cannot install this checkout's vllm-exl3 package" >&2; exit 1; }

# The kernels step's parts, each logged to $OUT_DIR/kernels/<part>.log.
kernels_step() {
  local out=$OUT_DIR/kernels status=0
  mkdir -p "$out"
  part() {
    local name=$1; shift
    echo "-- $name"
    if "$@" >"$out/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?, $out/$name.log)"; status=1; fi
    tail -3 "$out/$name.log"
  }
  if "$PY" -c 'import sys, torch, vllm._C_stable_libtorch
sys.exit(0 if hasattr(torch.ops._C, "exl3_linear") else 1)' 2>/dev/null; then
    # `build --from-source --only target --install-into`: the ops are vLLM's own; a
    # standalone extension would register them a second time.
    echo "-- build: the installed vLLM's _C_stable_libtorch registers the ops; no extension"
    unset VLLM_EXL3_EXT
  elif [ -n "${VLLM_EXL3_EXT:-}" ] && [ -f "$VLLM_EXL3_EXT" ]; then
    echo "-- build: using $VLLM_EXL3_EXT"
  else
    part build bash -c "cd scripts && $PY -m vllm_exl3.kernels_build --arch ${ARCH:-9.0} --jobs $(nproc) --out ../build/exl3"
    export VLLM_EXL3_EXT=$PWD/build/exl3/_exl3_C.abi3.so
  fi
  part gpu_tests "$PY" -m pytest -q -m gpu overlay/tests/kernels/quantization \
    overlay/tests/v1/attention $HARNESS_ONLY --junitxml "$out/gpu_tests.xml"
  part plan_log_a "$PY" -m vllm_exl3.testing.exl3_oracle --log-plans
  part plan_log_b "$PY" -m vllm_exl3.testing.exl3_oracle --log-plans
  if cmp -s "$out/plan_log_a.log" "$out/plan_log_b.log"; then echo "   plans identical across processes"
  else echo "   plans DIFFER"; status=1; fi
  local san
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  part memcheck "$san" --tool memcheck --error-exitcode 1 "$PY" -m vllm_exl3.testing.exl3_oracle --sample
  # The MoE kernels' sample (grouped GEMM, transforms, the large-batch reconstruct), uncached so
  # memcheck sees each buffer's true bounds.
  part moe_memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool memcheck \
    --error-exitcode 1 "$PY" -m pytest -q -m gpu overlay/tests/kernels/quantization/test_exl3_moe_kernels.py -k sanitizer_sample
  # Sparse-MLA decode: small cases covering partial head groups of 16 and 32 heads, fp8_ds_mla,
  # split-k with the combine, short lists, a strided cache, Hopper's wgmma path from 64 heads on
  # (lists and splits that end inside its 64-row tile); shared-memory races and barriers too.
  local mla_cases="T4-H17-D576-bf16 or T3-H17-D576-fp8 or T4-H20-D576 \
or T1-H16-D576-bf16-k2048-ctx65536 or T8-H16-D576-fp8-k2048-ctx4096-bs256-strided or T5-H16-D512 \
or T4-H100-D576 or T3-H64-D576-fp8 or T3-H65-D576-fp8-k4096 or T7-H65-D576-fp8-k33 \
or T2-H100-D576-bf16-k1000 or T2-H64-D576-bf16-k100 or T1-H65-D576-fp8-k2016"
  local tool
  for tool in memcheck racecheck synccheck; do
    part "sparse_mla_$tool" "$san" --tool "$tool" --error-exitcode 1 "$PY" -m pytest -q -m gpu \
      overlay/tests/v1/attention/test_exl3_sparse_mla_kernel.py -k "test_matches_reference and ($mla_cases)"
  done
  part tune_plans "$PY" scripts/bench/tune_plans.py tests/fixtures/qwen3-tiny/exl3-4.0bpw \
    tests/fixtures/qwen3-tiny/exl3-3.0bpw-mcg --bench-shapes --dtype bfloat16 --dtype float16 \
    --out "$out/configs"
  return $status
}

run_step() {
  local step=$1
  local budget=$(( STEP_S - MARGIN_S ))
  case "$step" in
    tests) "$PY" -m pytest -q -ra -m gpu -p no:cacheprovider overlay/tests \
             $HARNESS_ONLY ;;
    kernels) kernels_step ;;
    e2e) "$PY" scripts/e2e/run_fixture_e2e.py --out "$OUT_DIR/e2e" --budget-s "$budget" ;;
    throughput) "$PY" scripts/e2e/throughput.py --out "$OUT_DIR/throughput" --budget-s "$budget" ;;
    bench) "$PY" scripts/bench/bench_linear.py --out "$OUT_DIR/bench" --no-exl3 --bits 4 \
             --budget-s "$budget" ;;
    moebench)
      local anchor=(--no-exllamav3)
      [ -n "${EXL3_ANCHOR_STATE:-}" ] && anchor=(--exl3-state "$EXL3_ANCHOR_STATE")
      local moe=("$PY" scripts/bench/bench_moe.py --out "$OUT_DIR/moebench" --bits 4)
      "${moe[@]}" --shapes qwen3-30b-a3b glm-4.5-air --tokens 1 2 4 8 16 64 256 1024 4096 \
        --no-mma --no-unsplit "${anchor[@]}" &&
        "${moe[@]}" --shapes qwen3-235b-a22b deepseek-v3 --tokens 1 4 16 64 256 1024 4096 \
          --no-mma --no-unsplit "${anchor[@]}" &&
        "${moe[@]}" --shapes qwen3-30b-a3b glm-4.5-air --tokens 8192 --no-pairs --no-aligned \
          --no-mma --no-unsplit --no-exllamav3 ;;
    sparsebench) "$PY" scripts/bench/bench_sparse_mla.py --json "$OUT_DIR/sparse_mla_bench.json" ;;
    moe) "$PY" scripts/e2e/run_moe_e2e.py --moe-dir "${VLLM_EXL3_MOE_DIR:?the moe step needs \
VLLM_EXL3_MOE_DIR (scripts/e2e/stage_fixtures.sh)}" --out "$OUT_DIR/moe" --budget-s "$budget" ;;
    mtp)
      "$PY" scripts/e2e/run_mtp_e2e.py --out "$OUT_DIR/mtp" --budget-s $(( budget / 2 )) &&
        "$PY" scripts/e2e/run_mtp_e2e.py --layout qwen3-next --out "$OUT_DIR/mtp" \
          --budget-s $(( budget / 2 )) ;;
    qwen35) "$PY" scripts/e2e/run_qwen3_5_e2e.py --out "$OUT_DIR/qwen3_5" --stages ppl mtp ;;
    sparse)
      "$PY" scripts/e2e/run_sparse_mla_e2e.py --out .e2e/sparse-mla --resume --budget-s "$budget"
      local rc=$?
      cp -r .e2e/sparse-mla "$OUT_DIR/"
      return $rc ;;
    # -v (unbuffered) names each test as it starts, so one that outlives the step is in its log;
    # faulthandler dumps the stacks of one still running after 300 s.
    harness) PYTHONUNBUFFERED=1 PYTHON=$PY bash ci/test_vllm_harness.sh -v --durations=20 \
               -o faulthandler_timeout=300 ;;
    serve)
      local anchor=()
      [ -n "${EXL3_ANCHOR_STATE:-}" ] && anchor=(--exl3-state "$EXL3_ANCHOR_STATE")
      "$PY" scripts/e2e/serve_bench.py --out .e2e/serve --resume .e2e/serve/serve_bench.json \
        --budget-s "$budget" ${anchor[@]+"${anchor[@]}"}
      local rc=$?
      cp -r .e2e/serve "$OUT_DIR/"
      return $rc ;;
    soak)
      "$PY" scripts/e2e/serve_bench.py --soak --detach --out .e2e/serve-soak &&
        "$PY" scripts/e2e/serve_bench.py --soak --collect --out .e2e/serve-soak \
          --budget-s "$budget"
      local rc=$?
      cp -r .e2e/serve-soak "$OUT_DIR/"
      return $rc ;;
  esac
}

failed=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  echo "== gpu.sh: $step (limit ${STEP_S} s)"
  # run_step is a shell function: timeout runs it through a child bash that sees it.
  export -f run_step kernels_step
  export PY OUT_DIR STEP_S MARGIN_S HARNESS_ONLY
  timeout --kill-after=15 "$STEP_S" bash -c "run_step $step" 2>&1 | tee "$OUT_DIR/$step.log"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - t0 ))
  [ "$rc" -eq 124 ] && echo "gpu.sh: $step ran out of its ${STEP_S} s" | tee -a "$OUT_DIR/$step.log"
  printf '%-10s rc=%-3s %5ss\n' "$step" "$rc" "$secs" | tee -a "$OUT_DIR/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
done
echo "gpu.sh: results in $OUT_DIR"
exit $failed
