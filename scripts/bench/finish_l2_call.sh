#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Where the split-k finish kernel's bytes come from (written in session 15, not yet run). Its
# tail after the stream-k GEMM moves 31.5 / 63 MB in 7.3 / 13.9 µs at 5120x12288 m = 256 / 512
# (ab_session15 §6), the card's copy rate, so the partial sums seem to come from HBM. ncu on the
# finish kernel inside pin.py's cold graph replays (weights rotated past L2), caches left as the
# GEMM leaves them (--cache-control none), in the steady state (--launch-skip): its L2 read hit
# rate and DRAM bytes. If EXT2 is given (e.g. the l2-persist build), the same with
# EXL3_L2_PERSIST=1 on it.
#   bash scripts/bench/finish_l2_call.sh EXT [EXT2]    (repository root, on the device machine)
set -u
EXT=${1:?usage: finish_l2_call.sh EXT [EXT2]}
EXT2=${2:-}
export PYTHONUNBUFFERED=1 VLLM_EXL3_SPREAD=1
: "${OUT:?}"
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
M=$M,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
run() {  # LABEL EXT SPEC
  echo "== $1: $3"
  timeout 150 ncu --clock-control none --cache-control none -k regex:exl3_splitk_finish \
    --launch-skip 20 -c 1 --metrics "$M" python3 scripts/bench/pin.py "$2" "ncu_$1" "$3" 2>&1 \
    | grep -E "^\s+(gpu__|dram__|lts__)|==ERR|rror"
}
for spec in "5120 12288 4 1 256 256 sk 1" "5120 12288 4 1 512 256 sk 1"; do
  run main "$EXT" "$spec"
  if [ -n "$EXT2" ]; then EXL3_L2_PERSIST=1 run persist "$EXT2" "$spec"; fi
done
