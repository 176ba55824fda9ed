#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One device-machine session step (run from the repository root on the GPU host):
#   verify  - load (or build) the extension, full verification, compute-sanitizer sample,
#             SASS loop counts, ncu probe; starts ExLlamaV3's JIT build in the background
#   bench   - wait for ExLlamaV3's build, then the cold benchmark (extra args go to it)
# Logs and results go to $OUT (default /tmp/exl3_out).
set -u
phase=${1:-verify}; shift || true
OUT=${OUT:-/tmp/exl3_out}; mkdir -p "$OUT"
PY=${PY:-python3}
EXT=build/exl3/_exl3_C.abi3.so
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
log() { echo "== $(date +%T) $*"; }

# ExLlamaV3 1.6.5 (wheels carried in .whl): its extension JIT-builds for minutes, so start it
# first and let it run beside our checks.
if [ -d .whl ] && [ ! -e /tmp/exl3_build.started ]; then
  touch /tmp/exl3_build.started
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/tmp/exl3_pip.log 2>&1
  setsid nohup env PYTHONPATH=/tmp/site MAX_JOBS=${EXL3_JOBS:-12} TORCH_CUDA_ARCH_LIST=9.0 \
    bash -c "$PY -c 'import exllamav3.ext' >/tmp/exl3_build.log 2>&1; echo \$? >/tmp/exl3_build.done" \
    >/dev/null 2>&1 < /dev/null &
  log "ExLlamaV3 build started"
fi

if ! $PY -c "import torch; torch.ops.load_library('$EXT')" 2>/tmp/exl3_load_error.txt; then
  log "carried extension does not load here ($(tail -1 /tmp/exl3_load_error.txt)); building"
  (cd scripts && $PY -m vllm_exl3.kernels_build --out ../build/exl3 --arch 9.0 --jobs 8) || exit 1
fi

if [ "$phase" = verify ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  log verify
  timeout 300 $PY scripts/bench/verify_kernels.py --ext $EXT --json "$OUT/verify.json" "$@"
  log "sanitizer + sass + ncu"
  {
    echo "--- compute-sanitizer memcheck"
    timeout 80 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
      $PY scripts/bench/verify_kernels.py --ext $EXT --sample 2>&1 | tail -6
    echo "exit ${PIPESTATUS[0]}"
    # racecheck one kernel family at a time, so a tool failure is attributed to its kernel.
    for k in exl3_gemm exl3_input_transform exl3_splitk_finish exl3_reconstruct_rotated \
             exl3_reconstruct_original; do
      echo "--- compute-sanitizer racecheck $k"
      timeout 45 compute-sanitizer --tool racecheck --kernel-name kns=$k --error-exitcode 9 \
        $PY scripts/bench/verify_kernels.py --ext $EXT --sample 2>&1 | grep -E "=====|ALL PASS|FAILED|Error" | head -8
      echo "exit ${PIPESTATUS[0]}"
    done
    echo "--- sass"
    $PY scripts/bench/sass_loop.py $EXT --json "$OUT/sass.json" 2>&1 && cp "$OUT/sass.json" /tmp/sass.json
  } > "$OUT/probes.log" 2>&1
  tail -40 "$OUT/probes.log"
fi

if [ "$phase" = ncu ]; then
  {
    for cfg in "$@"; do
      timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
        --metrics smsp__sass_thread_inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active \
        $PY scripts/bench/ncu_probe.py $cfg 2>&1 | grep -E "k\*n|inst_executed|duration|bytes_read|stalled|issue_active|ERR" | sed "s/^/[$cfg] /"
    done
  } > "$OUT/ncu.log" 2>&1
  cat "$OUT/ncu.log"
fi

if [ "$phase" = bench ]; then
  export PYTHONPATH=/tmp/site
  for i in $(seq 1 ${EXL3_WAIT:-60}); do [ -e /tmp/exl3_build.done ] && break; sleep 5; done
  log "ExLlamaV3 build: $(cat /tmp/exl3_build.done 2>/dev/null || echo 'not finished')"
  tail -3 /tmp/exl3_build.log 2>/dev/null
  sass=""; [ -f "$OUT/sass.json" ] && sass="--sass-json $OUT/sass.json"
  [ -f /tmp/sass.json ] && sass="--sass-json /tmp/sass.json"
  $PY scripts/bench/bench_linear.py --ext $EXT --out "$OUT" $sass "$@" 2>&1 | tail -150
fi
