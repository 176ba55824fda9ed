#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The kernels' GPU session in two back-to-back device calls (NEXT_SESSION.md has the exact calls).
# Run from the repository root on the device machine; everything it reports goes to $OUT.
#   call1 - start ExLlamaV3's JIT build in the background (own process session, private
#           TORCH_EXTENSIONS_DIR), load the carried _exl3_C (build it only if it does not load),
#           full verification, compute-sanitizer memcheck sample, SASS loop counts, ncu
#           instructions per weight, then the cold benchmark of our kernels (no ExLlamaV3)
#   call2 - the same-run anchor benchmark (ours, ExLlamaV3 with its path per m, bf16) on the
#           issue's five shapes, bits 4 6 2 3 5, all codebooks, once ExLlamaV3's build is done
#           (results rewritten after every configuration, so a cut run still reports)
# Each call stays under the device tool's 10-minute limit: every step has its own timeout and
# the benchmarks a budget computed from the time left.
set -u
phase=${1:?usage: next_session.sh call1|call2}
OUT=${OUT:-/tmp/exl3_out}
mkdir -p "$OUT"
PY=${PY:-python3}
# The kernels under test; scripts/e2e/x2_session.sh points this at the bundle-installed copy.
EXT=${EXT:-build/exl3/_exl3_C.abi3.so}
# Kept between the two calls while the machine stays warm (a fresh machine rebuilds).
STATE=${EXL3_STATE:-/tmp/exl3_next}
# The whole call must end inside the device tool's 600 s, with room to copy $OUT back
# (less when the caller shares the call with other work).
CALL_LIMIT_S=${CALL_LIMIT_S:-560}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LOG="$OUT/$phase.log"
exec > >(tee -a "$LOG") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( CALL_LIMIT_S - ($(date +%s) - T0) )); }

start_exllamav3_build() {
  if [ ! -d .whl ]; then log "no .whl carried: ExLlamaV3 cannot be installed"; return; fi
  if [ ! -d "$STATE/site/exllamav3" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$STATE/site" .whl/*.whl || { log "ExLlamaV3 wheels did not install"; return; }
  fi
  # 12 of the 16 cores: our checks run beside it.
  $PY scripts/bench/exllamav3_anchor.py build --state "$STATE" --jobs "${EXL3_JOBS:-12}"
}

load_or_build_ours() {
  if $PY -c "import torch; torch.ops.load_library('$EXT')" 2>"$OUT/load_error.txt"; then
    log "carried $EXT loads"
  else
    log "carried $EXT does not load ($(tail -1 "$OUT/load_error.txt")); building for sm_90"
    (cd scripts && timeout 400 $PY -m vllm_exl3.kernels_build --out ../build/exl3 --arch 9.0 \
      --jobs 8) || { log "build failed"; exit 1; }
    EXT=build/exl3/_exl3_C.abi3.so
  fi
  rm -f "$OUT/load_error.txt"
}

case "$phase" in
call1)
  mkdir -p "$STATE"
  start_exllamav3_build
  load_or_build_ours
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  git log --oneline -1 2>/dev/null || true

  log "verify (full matrix)"
  timeout 240 $PY scripts/bench/verify_kernels.py --ext $EXT --json "$OUT/verify.json"
  echo "verify exit $?"

  # The GPU tests: verify's checks as pytest cases plus the tuner-candidate and workspace tests.
  log "pytest tests/gpu"
  VLLM_EXL3_EXT=$EXT timeout 200 $PY -m pytest -q -x -p no:cacheprovider tests/gpu \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest tests/gpu exit $?"; tail -3 "$OUT/pytest_gpu.log"

  log "compute-sanitizer memcheck (sample)"
  timeout 120 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
    $PY scripts/bench/verify_kernels.py --ext $EXT --sample > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $? (9 = errors found, 124 = timed out)"; tail -4 "$OUT/memcheck.log"

  # racecheck is slow (every shared-memory access is tracked): a handful of cases, its own log.
  # No kernel filter: that is how it ran clean on the H200 in session 3 (results/
  # ab_session3_h200_2026-11-30); sessions 1-2 ended at the first kernel with the sanitizer's
  # internal "failed to handle a hardware exception", cause not established. If that returns,
  # retry without its cp.async tracking.
  log "compute-sanitizer racecheck (sample)"
  timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard \
    --error-exitcode 9 $PY scripts/bench/verify_kernels.py --ext $EXT --sample \
    > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $? (9 = hazards found, 124 = timed out)"; tail -4 "$OUT/racecheck.log"
  if grep -q "Internal Sanitizer Error" "$OUT/racecheck.log"; then
    timeout 150 compute-sanitizer --tool racecheck --racecheck-memcpy-async no \
      --racecheck-report hazard --error-exitcode 9 \
      $PY scripts/bench/verify_kernels.py --ext $EXT --sample > "$OUT/racecheck_no_async.log" 2>&1
    echo "racecheck (no cp.async tracking) exit $?"; tail -4 "$OUT/racecheck_no_async.log"
  fi
  timeout 120 compute-sanitizer --tool synccheck --kernel-name kns=exl3 --error-exitcode 9 \
    $PY scripts/bench/verify_kernels.py --ext $EXT --sample > "$OUT/synccheck.log" 2>&1
  echo "synccheck exit $? (9 = errors found)"; tail -3 "$OUT/synccheck.log"

  log "SASS k-loop instructions per weight (this build)"
  timeout 60 $PY scripts/bench/sass_loop.py $EXT --mt 1 8 --json "$OUT/sass.json" | \
    grep -E "bits +(2|4|6) " || true
  cp "$OUT/sass.json" "$STATE/sass.json" 2>/dev/null  # $OUT is emptied before call2

  log "ncu: executed instructions per weight, 4096x4096 4-bit, BM 16, split 8"
  for cfg in "4 1 1" "4 2 1" "4 0 16"; do
    timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
      --metrics smsp__sass_thread_inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
      $PY scripts/bench/ncu_probe.py $cfg --split 8 --ext $EXT 2>&1 | \
      grep -E "k\*n|inst_executed|duration|issue_active|ERR" | sed "s/^/[$cfg] /"
  done
  # Which pipe binds the decode (the ALU/FMA balance of 71d617a rests on the integer ALU and
  # IMAD pipes each taking a warp instruction per 2 cycles) and why warps stall. Regex metric
  # names, so a name this ncu lacks drops out instead of failing the run.
  log "ncu: pipe utilisation and stall reasons, 4-bit MCG m=1 and MUL1 m=1"
  for cfg in "4 1 1" "4 2 1"; do
    timeout 60 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics \
      "regex:^sm__(inst_executed_pipe|pipe)_(alu|fma|fmaheavy|fmalite|fp16|shared|tensor|lsu|uniform).*(sum|pct_of_peak_sustained_active)$,regex:^smsp__warp_issue_stalled_.*_per_warp_active.pct$" \
      $PY scripts/bench/ncu_probe.py $cfg --split 8 --ext $EXT 2>&1 | \
      grep -E "sm__|smsp__|ERR" | grep -v -E " 0(\.0+)?$" | sed "s/^/[$cfg] /"
  done

  # The mid-m question of NEXT_SESSION.md: is BM 128 at m = 256 (4096x11008) held back by
  # wave quantization (SMs with one block vs two) or by something inside a block?
  log "ncu: BM 128, m = 256, 4096x11008: occupancy, per-SM activity spread, stalls"
  timeout 90 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics \
    "launch__grid_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,regex:^smsp__warp_issue_stalled_.*_per_warp_active.pct$" \
    $PY scripts/bench/ncu_probe.py 4 1 256 --n 11008 --bm 128 --split 1 --ext $EXT 2>&1 | \
    grep -E "launch__|sm__|smsp__|l1tex__|gpu__|ERR" | grep -v -E " 0(\.0+)?$" | sed "s/^/[bm128 m256] /"

  # The large-m lever of NEXT_SESSION.md: the original-basis reconstruct runs at ~55 % of copy
  # bandwidth and a prefetching rewrite was slower (results/ab_session3 §1); what binds it?
  log "ncu: original-basis reconstruct, 5120x17408 4-bit MCG"
  timeout 90 ncu --clock-control none -k regex:exl3_reconstruct_original -c 1 --metrics \
    "gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,regex:^smsp__warp_issue_stalled_.*_per_warp_active.pct$" \
    $PY scripts/bench/ncu_probe.py 4 1 1024 --k 5120 --n 17408 --reconstruct original --ext $EXT 2>&1 | \
    grep -E "sm__|smsp__|l1tex__|gpu__|dram__|ERR" | grep -v -E " 0(\.0+)?$" | sed "s/^/[recon] /"

  budget=$(( $(left) - 60 ))
  log "benchmark of our kernels, budget ${budget} s"
  if [ "$budget" -gt 60 ]; then
    timeout $(( budget + 50 )) $PY scripts/bench/bench_linear.py --ext $EXT --no-exl3 \
      --out "$OUT" --tag bench_ours --sass-json "$OUT/sass.json" --bits 4 6 2 3 5 \
      --codebooks 1 --budget-s "$budget" | grep -v '^{"k"' || true
  fi
  $PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout 0 | head -2
  log "call1 done"
  ;;
call2)
  if [ ! -e "$STATE/build.started" ]; then
    log "fresh machine: ExLlamaV3 build starts now (needs .whl carried; several minutes)"
    mkdir -p "$STATE"
    start_exllamav3_build
    load_or_build_ours
  fi
  if [ ! -f "$STATE/sass.json" ]; then
    timeout 60 $PY scripts/bench/sass_loop.py $EXT --json "$STATE/sass.json" > /dev/null
  fi
  log "waiting for ExLlamaV3's build"
  $PY scripts/bench/exllamav3_anchor.py wait --state "$STATE" --timeout $(( $(left) - 240 ))
  budget=$(( $(left) - 60 ))
  log "same-run anchor benchmark, budget ${budget} s"
  timeout $(( budget + 50 )) $PY scripts/bench/bench_linear.py --ext $EXT --out "$OUT" \
    --tag bench_anchor --exl3-state "$STATE" --exl3-wait-s 30 --exl3-import-timeout-s 90 \
    --bits 4 6 2 3 5 --codebooks 0 1 2 --budget-s "$budget" \
    --sass-json "$STATE/sass.json" | grep -v '^{"k"' || true
  log "call2 done"
  ;;
*)
  echo "unknown phase $phase (call1 | call2)"; exit 2 ;;
esac
