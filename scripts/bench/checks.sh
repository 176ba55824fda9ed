#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The full GPU checks of one kernel build, as every merge of a kernel change has run them
# (results/ab_session*/: call12 of session 6, calls 1, 6, 10 of session 7): verify_kernels.py
# (every tier of both engines, split-k, reconstruct, deterministic, CUDA graphs, autotuned real
# shapes), tests/gpu, and compute-sanitizer memcheck and racecheck on verify's sample. Run from
# the repository root on the device machine; the log goes to $OUT/checks_<name>.log.
#   bash scripts/bench/checks.sh EXT [NAME]
set -u
EXT=${1:?usage: checks.sh EXT [NAME]}
NAME=${2:-$(basename "$EXT" .so)}
: "${OUT:?OUT must be set}"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >(tee -a "$OUT/checks_$NAME.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
log "verify $NAME (full)"
timeout 90 $PY scripts/bench/verify_kernels.py --ext "$EXT" --json "$OUT/verify_$NAME.json" 2>&1 | tail -10
log "pytest tests/gpu ($NAME)"
VLLM_EXL3_EXT=$EXT timeout 90 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
log "memcheck sample"
timeout 40 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext "$EXT" --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample"
timeout 80 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext "$EXT" --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "checks done"
